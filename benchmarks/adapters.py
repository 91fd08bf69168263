"""LoRA adapters on our DiT at the released size, on the 768p / 5 s T2VA layout: time to apply and to remove a
rank-R adapter on every block linear, and one forward with it against none (same process, same GPU, a ratio).

Random bf16 base weights (`benchmarks.dit_forward.build_ours`) and a random adapter (`random_block_adapter`: fp32
factors as a file reads them, a scale of 1). Forwards are timed in ABBA pairs, the adapter applied and removed
between them (outside the timed forwards), with the AdaLN tables built once per variant as the denoising loop does.
Checks: strength 0 and the base after removal are bit-identical to the base forward; the adapter changes it.
The alternative, fused into the weights (`--fused`): each adapted weight is saved to pinned host memory (the only way
back to the base bit for bit), then W + B A is computed in fp32 and rounded to bf16 in place; removing copies the
saved weights back. Its times, host bytes and forward, and how far its bf16 rounding moves the output, are recorded.

    python -m benchmarks.adapters                                          # GPU, released size, rank 64, JSON
    python -m benchmarks.adapters --tiny --device cpu --output-dir /tmp    # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks._common import RESULTS_DIR, device_label, package_version, synchronize
from benchmarks._packed_request import relative_l2
from benchmarks.dit_forward import build_ours, t2va_request, time_forward
from h3engine.checkpoint.lora_format import LoraFile, LoraLayer
from h3engine.engine.lora.adapters import Adapter, apply_adapters, remove_adapters
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig

BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def random_block_adapter(config: DiTConfig, rank: int, seed: int) -> LoraFile:
    """A rank-`rank` adapter on every block linear (q/k/v, out, fc1, fc2 of each block), fp32 factors on the CPU with
    the spread of a trained LoRA's (down ~ 1/sqrt(in), up small), scale 1."""
    model = H3DiT(config, device="meta")
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for index in range(config.num_layers):
        for suffix in BLOCK_LINEARS:
            name = f"blocks.{index}.{suffix}"
            out_features, in_features = model.get_submodule(name).weight.shape
            down = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            up = torch.randn(out_features, rank, generator=generator) * 0.01
            layers[name] = LoraLayer(down=down, up=up, scale=1.0, source_key=name)
    return LoraFile(
        path=Path("random.safetensors"), name="random", layout="original", partitions={None: layers}
    )


def factor_bytes(lora: LoraFile, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    layers = lora.layers()
    return sum((layer.down.numel() + layer.up.numel()) * element for layer in layers.values())


def measure_fused(
    ours: H3DiT, lora: LoraFile, device: torch.device, forward, adapter_output, base_output
) -> dict[str, object]:
    """Fuse the adapter into the weights and back (host copies for an exact restore): seconds, bytes, outputs."""
    linears = {name: ours.get_submodule(name) for name in lora.layers()}
    timings: dict[str, float] = {}

    def span(name: str, action) -> None:
        synchronize(device)
        began = time.perf_counter()
        action()
        synchronize(device)
        timings[name] = time.perf_counter() - began

    saved: dict[str, torch.Tensor] = {}

    def allocate() -> None:
        for name, linear in linears.items():
            saved[name] = torch.empty(
                linear.weight.shape, dtype=linear.weight.dtype, pin_memory=device.type == "cuda"
            )

    def save() -> None:
        for name, linear in linears.items():
            saved[name].copy_(linear.weight, non_blocking=True)

    def fuse() -> None:
        for name, layer in lora.layers().items():
            weight = linears[name].weight
            update = layer.up.to(device) @ layer.down.to(device) * layer.scale
            weight.copy_((weight.float() + update).to(weight.dtype))

    def restore() -> None:
        for name, linear in linears.items():
            linear.weight.copy_(saved[name], non_blocking=True)

    span("host_alloc_s", allocate)
    span("save_s", save)
    span("fuse_s", fuse)
    fused_s, fused_output = time_forward(forward, device, warmup=1, runs=2)
    span("restore_s", restore)
    restored = all(torch.equal(a, b) for a, b in zip(forward(), base_output, strict=True))
    return {
        **timings,
        "host_bytes": sum(tensor.numel() * tensor.element_size() for tensor in saved.values()),
        "forward_s": fused_s,
        "relative_l2_to_low_rank_output": relative_l2(fused_output[0], adapter_output[0]),
        "restored_bit_exact": restored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config and layout (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=4, help="ABBA pairs of (no adapter, adapter) forwards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fused", action="store_true", help="also measure fusing into the weights (see above)"
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = DiTConfig.tiny() if args.tiny else DiTConfig.released()
    request = t2va_request(config, args.tiny, args.seed).to(device)
    arguments = request.as_h3_arguments()
    lora = random_block_adapter(config, args.rank, args.seed)
    adapter = Adapter(lora, 1.0, "transformer")

    with torch.no_grad():
        ours = build_ours(config, device, args.seed)
        layout = ours.prepare_layout(*arguments[4:])
        tables: dict[str, object] = {}

        def run(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
            return ours(*arguments, layout=layout, modulation=tables[variant])

        tables["base"] = ours.modulation(request.timesteps)
        base_s, base_output = time_forward(lambda: run("base"), device, warmup=1, runs=1)

        apply_s = []
        remove_s = []
        for _ in range(2):  # the first apply pays the allocator; both reported
            synchronize(device)
            began = time.perf_counter()
            adapted = apply_adapters(ours, [adapter], device)
            synchronize(device)
            apply_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            remove_adapters(ours)
            synchronize(device)
            remove_s.append(time.perf_counter() - began)

        apply_adapters(ours, [Adapter(lora, 0.0, "transformer")], device)
        tables["strength_0"] = ours.modulation(request.timesteps)
        strength_0_equal = all(torch.equal(a, b) for a, b in zip(run("strength_0"), base_output, strict=True))
        apply_adapters(ours, [adapter], device)
        tables["adapter"] = ours.modulation(request.timesteps)
        _, adapter_output = time_forward(lambda: run("adapter"), device, warmup=1, runs=1)
        change = relative_l2(adapter_output[0], base_output[0])
        remove_adapters(ours)
        restored_equal = all(torch.equal(a, b) for a, b in zip(run("base"), base_output, strict=True))
        fused = (
            measure_fused(ours, lora, device, lambda: run("base"), adapter_output, base_output)
            if args.fused
            else None
        )

        def timed(variant: str) -> float:
            if variant == "adapter":
                apply_adapters(ours, [adapter], device)
            synchronize(device)
            seconds = time_forward(lambda: run(variant), device, warmup=0, runs=1)[0][0]
            remove_adapters(ours)
            return seconds

        pairs = []  # (base s, adapter s); even pairs run the adapter first, odd ones the base (ABBA)
        for index in range(args.pairs):
            order = ("adapter", "base") if index % 2 == 0 else ("base", "adapter")
            seconds = {variant: timed(variant) for variant in order}
            pairs.append((seconds["base"], seconds["adapter"]))

    base_median = statistics.median(pair[0] for pair in pairs)
    adapter_median = statistics.median(pair[1] for pair in pairs)
    ratios = [adapter_s / base_only_s for base_only_s, adapter_s in pairs]
    print(
        f"rank {args.rank} on {adapted} linears ({factor_bytes(lora, ours.compute_dtype) / 1e9:.2f} GB of factors): "
        f"apply {apply_s} s, remove {remove_s} s; forward {base_median:.4f} s without, {adapter_median:.4f} s with, "
        f"ratio median {statistics.median(ratios):.4f} ({[round(r, 4) for r in ratios]}); output change {change:.3e}; "
        f"strength 0 bit-exact {strength_0_equal}, restored bit-exact {restored_equal}"
    )
    if fused is not None:
        print(f"fused into the weights: {fused}")
    result = {
        "benchmark": "adapters",
        "date": datetime.date.today().isoformat(),
        "device": device_label(device),
        "versions": {name: package_version(name) for name in ("torch", "triton", "flash-attn-4")},
        "config": "tiny" if args.tiny else "released",
        "layout_rows": {
            "text": int(request.text_index.numel()),
            "audio": int(request.audio_index.numel()),
            "video": int(request.video_index.numel()),
        },
        "rank": args.rank,
        "adapted_linears": adapted,
        "factor_bytes": factor_bytes(lora, ours.compute_dtype),
        "apply_s": apply_s,
        "remove_s": remove_s,
        "forward_pairs_s": [{"base": base_only_s, "adapter": adapter_s} for base_only_s, adapter_s in pairs],
        "forward_base_median_s": base_median,
        "forward_adapter_median_s": adapter_median,
        "ratio_adapter_over_base": ratios,
        "ratio_median": statistics.median(ratios),
        "output_relative_change": change,
        "strength_0_bit_exact": strength_0_equal,
        "restored_bit_exact": restored_equal,
        "first_forward_s": base_s,
        "fused": fused,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = device_label(device).replace(" ", "_")
    path = args.output_dir / f"adapters_{name}_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
