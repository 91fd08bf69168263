"""One DiT forward, ours vs diffusers 0.42.1, at the released size on the 768p / 5 s T2VA layout (docs/MODEL.md §9).

Both models get the same random bf16 weights (`random_native_tensor`, with the released fp32 islands) and the same
packed T2VA request (benchmarks/_packed_request.py). They do not fit on one GPU together, so ours is timed first,
then its weights move into a meta-built diffusers model group by group and diffusers is timed. Timing: warm-up
forwards, then CUDA-event timing of `--runs` forwards, median reported. `--interleaved PAIRS` keeps ours beside
diffusers and times them in alternation (cancels a drift of the GPU's speed); `--fp32-reference` reports every
variant's error against the same forward in fp32. Method and results: benchmarks/NOTES.md.

    python -m benchmarks.dit_forward                              # GPU, released size, JSON to benchmarks/results
    python -m benchmarks.dit_forward --tiny --device cpu --output-dir /tmp   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks._common import RESULTS_DIR, device_label, kernel_profile, package_version, synchronize
from benchmarks._packed_request import PackedRequest, build_packed_request, max_relative_error, relative_l2
from h3engine.checkpoint.dit_format import config_to_diffusers, module_to_diffusers, native_to_module
from h3engine.checkpoint.dit_keys import random_native_tensor
from h3engine.engine.sampling import modulation as modulation_module
from h3engine.models import attention as attention_ops
from h3engine.models import ops
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.quantization import quantize_dit_linears

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0


def mid_schedule_timestep(shift: float, base: float = 0.5) -> float:
    """t = 1 - sigma at the middle of a shifted schedule (sigma = s*b / (1 + (s-1)*b)), a typical loop step."""
    return 1.0 - shift * base / (1.0 + (shift - 1.0) * base)


def t2va_request(config: DiTConfig, tiny: bool, seed: int) -> PackedRequest:
    """768p / 5 s T2VA: 16:9 canvas 1344x768 -> latent 48x84, 37 latent frames, 207 audio latents per channel."""
    geometry = (
        {
            "text_rows": 10,
            "latent_frames": 3,
            "latent_height": 8,
            "latent_width": 12,
            "audio_latents_per_channel": 9,
        }
        if tiny
        else {
            "text_rows": 512,
            "latent_frames": 37,
            "latent_height": 48,
            "latent_width": 84,
            "audio_latents_per_channel": 207,
        }
    )
    return build_packed_request(
        **geometry,
        vision_rows_in_text=0,
        condition_frames=0,
        video_channels=config.video_in_channels,
        audio_channels=config.audio_in_channels,
        text_dim=config.text_dim,
        text_dtype=torch.bfloat16,
        video_timestep=mid_schedule_timestep(VIDEO_SHIFT),
        audio_timestep=mid_schedule_timestep(AUDIO_SHIFT),
        seed=seed,
    )


def forward_flops(config: DiTConfig, request: PackedRequest) -> float:
    """Useful FLOPs of one forward (2 per MAC), from the shapes; ~3.57e15 at the released size (docs/MODEL.md §9)."""
    return sum(forward_flop_parts(config, request).values())


def forward_flop_parts(config: DiTConfig, request: PackedRequest) -> dict[str, float]:
    """The forward's FLOPs split into attention (QK^T and PV) and everything else (GEMMs, mostly)."""
    sequence = request.tags.numel()
    text = request.text_index.numel()
    num_timesteps = request.timesteps.numel()
    hidden, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    linear_per_row = 2 * (hidden * 3 * inner + inner * hidden + hidden * 2 * ffn + ffn * hidden)

    def attention_per_layer(rows: int) -> int:
        return 4 * rows * rows * inner  # QK^T and PV, S^2 * inner MACs each

    attention = config.num_layers * attention_per_layer(sequence)
    attention += config.num_refiner_layers * attention_per_layer(text)
    blocks = config.num_layers * linear_per_row * sequence
    refiner = config.num_refiner_layers * linear_per_row * text
    adaln = (
        2
        * num_timesteps
        * config.time_embed_dim
        * (config.num_layers * config.adaln_out_features + config.final_adaln_out_features)
    )
    time_mlp = (
        2
        * num_timesteps
        * (config.timestep_dim * config.time_hidden_dim + config.time_hidden_dim * config.time_embed_dim)
    )
    video_rows, audio_rows = request.video_index.numel(), request.audio_index.numel()
    projections = (
        2
        * hidden
        * (
            2 * video_rows * config.video_patch_dim
            + 2 * audio_rows * config.audio_in_channels
            + text * config.text_dim
        )
    )
    return {"attention": float(attention), "linear": float(blocks + refiner + adaln + time_mlp + projections)}


def time_forward(
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device, warmup: int, runs: int
) -> tuple[list[float], tuple[torch.Tensor, torch.Tensor]]:
    """Seconds of each timed run (CUDA events on GPU, perf_counter on CPU) and the last output."""
    for _ in range(warmup):
        output = run()
    synchronize(device)
    seconds = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            output = run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000.0)
        else:
            began = time.perf_counter()
            output = run()
            seconds.append(time.perf_counter() - began)
    return seconds, output


def interleaved_pairs(
    run_ours: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    run_reference: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    pairs: int,
) -> list[tuple[float, float]]:
    """(ours s, reference s) per pair, timed back to back; even pairs run ours first, odd ones the reference (ABBA),
    so a drift of the GPU's speed over the run (temperature, clocks) weighs on both alike."""

    def seconds(run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> float:
        return time_forward(run, device, warmup=0, runs=1)[0][0]

    timed = []
    for index in range(pairs):
        if index % 2 == 0:
            ours_s = seconds(run_ours)
            reference_s = seconds(run_reference)
        else:
            reference_s = seconds(run_reference)
            ours_s = seconds(run_ours)
        timed.append((ours_s, reference_s))
    return timed


def build_ours(config: DiTConfig, device: torch.device, seed: int) -> H3DiT:
    """Ours, built on meta and assigned random tensors drawn straight on `device` (no host copy of the whole model)."""
    model = H3DiT(config, dtype=torch.bfloat16, device="meta")
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {
        key: random_native_tensor(key, tuple(tensor.shape), config, generator).to(device)
        for key, tensor in model.state_dict().items()
    }
    model.load_state_dict(native_to_module(state, config), strict=True, assign=True)
    return model.eval()


def move_into_diffusers(
    ours: H3DiT, config: DiTConfig, device: torch.device, keep_ours: bool = False
) -> torch.nn.Module:
    """Hand ours' weights to a meta-built diffusers model one group at a time, freeing ours as it goes (diffusers is
    imported here: the benchmarks that reuse this module's builders run without it).

    Renamed tensors are shared (no copy); split/swapped ones are new, so the peak is ours + one block.
    The fp32 islands keep their dtype, which is exactly where diffusers' `_keep_in_fp32_modules` keeps fp32.
    With `keep_ours` ours stays usable: both models share the renamed tensors, and the split/swapped ones (q/k/v,
    fc1) exist twice.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        reference = MiniMaxH3Transformer3DModel.from_config(config_to_diffusers(config))
    groups: list[tuple[str, torch.nn.Module]] = [
        (f"blocks.{i}.", block) for i, block in enumerate(ours.blocks)
    ]
    groups += [(f"token_refiner.blocks.{i}.", block) for i, block in enumerate(ours.token_refiner.blocks)]
    for prefix, module in groups:
        partial = module.state_dict(prefix=prefix)
        result = reference.load_state_dict(module_to_diffusers(partial, config), strict=False, assign=True)
        assert not result.unexpected_keys, result.unexpected_keys
        del partial
        if not keep_ours:
            module.to_empty(device="meta")
    remaining = {key: tensor for key, tensor in ours.state_dict().items() if not tensor.is_meta}
    result = reference.load_state_dict(module_to_diffusers(remaining, config), strict=False, assign=True)
    assert not result.unexpected_keys, result.unexpected_keys
    del remaining
    if not keep_ours:
        ours.to_empty(device="meta")
    # diffusers recomputes inv_freq at construction (non-persistent); on meta it must be rebuilt, its own way.
    reference.rope.inv_freq = type(reference.rope)(config.rope_freq_dim, config.rope_theta).inv_freq.to(
        device
    )
    still_meta = [
        name for name, t in [*reference.named_parameters(), *reference.named_buffers()] if t.is_meta
    ]
    assert not still_meta, f"diffusers tensors never loaded: {still_meta[:5]}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return reference.eval()


# Ceilings measured on the H200 (docs/PERFORMANCE.md §2): bf16 GEMM 8192^3 and FlashAttention-4 at this shape.
GEMM_CEILING_TFLOPS = 751.0
ATTENTION_CEILING_TFLOPS = 662.0


@contextlib.contextmanager
def kernel_choice(reference_ops: bool, attention_backend: str | None) -> Iterator[None]:
    """Force our plain-torch twins for the fused ops and/or one attention backend inside the block."""
    previous = os.environ.get(attention_ops.FORCE_ENVIRONMENT_VARIABLE)
    if attention_backend is not None:
        os.environ[attention_ops.FORCE_ENVIRONMENT_VARIABLE] = attention_backend
    try:
        with ops.force_reference() if reference_ops else contextlib.nullcontext():
            yield
    finally:
        if previous is None:
            os.environ.pop(attention_ops.FORCE_ENVIRONMENT_VARIABLE, None)
        else:
            os.environ[attention_ops.FORCE_ENVIRONMENT_VARIABLE] = previous


@contextlib.contextmanager
def blas_library(model: H3DiT, library: str, layers: tuple[str, ...]) -> Iterator[None]:
    """Run the named block linears (e.g. ("attn.out_proj",), or () for every GEMM) on one torch BLAS library
    (torch.backends.cuda.preferred_blas_library), the rest on the default: which GEMMs would gain from cuBLASLt."""
    default = torch.backends.cuda.preferred_blas_library()
    if not layers:
        torch.backends.cuda.preferred_blas_library(library)
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(default)
        return
    wrapped = [block.get_submodule(name) for block in model.blocks for name in layers]

    def switched(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(hidden: torch.Tensor) -> torch.Tensor:
            torch.backends.cuda.preferred_blas_library(library)
            try:
                return forward(hidden)
            finally:
                torch.backends.cuda.preferred_blas_library(default)

        return run

    for module in wrapped:
        module.forward = switched(module.forward)
    try:
        yield
    finally:
        for module in wrapped:
            del module.forward  # back to the class's forward


# Variant -> (BLAS library, the block linears it runs; () = all): --blas-experiments.
BLAS_VARIANTS = {
    "ours_cublaslt_all_gemms": ("cublaslt", ()),
    "ours_cublaslt_out_proj": ("cublaslt", ("attn.out_proj",)),
    "ours_cublaslt_out_proj_fc2": ("cublaslt", ("attn.out_proj", "mlp.fc2")),
}


# Variant -> (reference ops?, forced attention backend): "ours" is the engine's default choice, the reference one our
# plain-torch twins (torch's default SDPA dispatch, what diffusers runs); the others split the difference by cause.
KERNEL_VARIANTS = {
    "ours": (False, None),
    "ours_reference_kernels": (True, "sdpa"),
}
ERROR_BREAKDOWN_VARIANTS = {
    "ours_fused_ops_sdpa_attention": (False, "sdpa"),
    "ours_reference_ops_fast_attention": (True, None),
    "ours_reference_ops_cudnn_attention": (True, "cudnn"),
}


def fp32_reference_forward(
    model: H3DiT, arguments: tuple, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same forward computed in fp32 throughout: the yardstick against which both bf16 models' errors are measured.

    At the released size the fp32 model would not fit beside the bf16 one, so the weights stay bf16 in memory and are
    widened where they are used (exactly: bf16 -> fp32 is lossless): the small tensors (norms, biases, embedders, the
    text refiner, the heads) for good, each block's linear weights only while that block runs, each AdaLN projection
    while its tables are built (fp32 tables). The fused ops run as their torch twins and attention through torch's
    SDPA (on CUDA its memory-efficient kernel; the math one would need S^2 memory); TF32 stays off. `model` keeps
    its small tensors in fp32 afterwards (use it for nothing else).
    """
    for name, parameter in model.named_parameters():
        block_linear = name.startswith("blocks.") and parameter.ndim == 2
        if not block_linear and ".adaln_proj." not in name:
            parameter.data = parameter.data.float()
    for block in model.blocks:
        linears = [
            parameter
            for name, parameter in block.named_parameters()
            if parameter.ndim == 2 and not name.startswith("adaln_proj.")
        ]

        def widened(*args: object, _forward=block.forward_from, _linears=linears, **kwargs: object) -> object:
            narrow = [parameter.data for parameter in _linears]
            for parameter in _linears:
                parameter.data = parameter.data.float()
            try:
                return _forward(*args, **kwargs)
            finally:
                for parameter, data in zip(_linears, narrow, strict=True):
                    parameter.data = data

        block.forward_from = widened

    def fp32_on_device(linear: torch.nn.Linear, target: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return linear.weight.to(target, torch.float32), linear.bias.to(target, torch.float32)

    sdpa_choice = (
        torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION])
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    tf32 = torch.backends.cuda.matmul.allow_tf32
    on_device = modulation_module._on_device
    torch.backends.cuda.matmul.allow_tf32 = False
    modulation_module._on_device = fp32_on_device
    try:
        with kernel_choice(reference_ops=True, attention_backend="sdpa"), sdpa_choice:
            assert model.compute_dtype == torch.float32
            layout = model.prepare_layout(*arguments[4:])  # fp32 RoPE tables
            modulation = modulation_module.build_modulation(model, [arguments[3]])[0]  # fp32 tables
            return model(*arguments, layout=layout, modulation=modulation)
    finally:
        modulation_module._on_device = on_device
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for block in model.blocks:
            del block.forward_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config and layout (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=3, help="timed forwards per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="also time ours with FP8 linear layers (error against our bf16); diffusers is then not run",
    )
    parser.add_argument(
        "--error-breakdown",
        action="store_true",
        help="also run fused ops with SDPA, reference ops with the fast attention, and reference ops with cuDNN",
    )
    parser.add_argument(
        "--blas-experiments",
        action="store_true",
        help="also time ours with cuBLASLt for every GEMM, for out_proj only, and for out_proj and fc2 (GPU)",
    )
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="PAIRS",
        help="after the usual variants, time PAIRS (ours, diffusers) pairs in one process with both models resident, "
        "alternating which goes first (ABBA), and report the per-pair ratios (cancels drift across the run)",
    )
    parser.add_argument(
        "--fp32-reference",
        action="store_true",
        help="keep ours beside diffusers and, at the end, compute the forward in fp32 (weights widened where used) to "
        "measure every variant's error against it",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one forward of ours: kernel time per group (attention, GEMM, fused ops), top kernels, idle",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = DiTConfig.tiny() if args.tiny else DiTConfig.released()
    request = t2va_request(config, args.tiny, args.seed).to(device)
    flop_parts = forward_flop_parts(config, request)
    flops = sum(flop_parts.values())
    floor_s = flop_parts["linear"] / (GEMM_CEILING_TFLOPS * 1e12) + flop_parts["attention"] / (
        ATTENTION_CEILING_TFLOPS * 1e12
    )
    print(
        f"layout: {request.text_index.numel()} text + {request.audio_index.numel()} audio + "
        f"{request.video_index.numel()} video rows, M = {request.timesteps.numel()}, {flops:.3e} FLOP per forward "
        f"({flop_parts['attention'] / flops:.0%} attention), floor {floor_s:.3f} s"
    )
    arguments = request.as_h3_arguments()
    timed: dict[str, list[float]] = {}
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    interleaved_ratios: list[float] = []
    fp32_outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    with torch.no_grad():
        began = time.perf_counter()
        ours = build_ours(config, device, args.seed)
        synchronize(device)
        print(f"ours built in {time.perf_counter() - began:.1f} s")
        # What the denoising loop does: the layout and the AdaLN tables are built once per request, not per step.
        layout = ours.prepare_layout(*arguments[4:])
        modulation = ours.modulation(request.timesteps)
        implementations = {
            "attention": attention_ops.selected_backend(
                torch.empty(1, 1, config.head_dim, device=device, dtype=ours.compute_dtype)
            ),
            "swiglu": ops.implementation(
                "swiglu", torch.empty(2, 2 * config.ffn_dim, device=device, dtype=ours.compute_dtype)
            ),
        }

        def run_ours() -> tuple[torch.Tensor, torch.Tensor]:
            return ours(*arguments, layout=layout, modulation=modulation)

        variants = dict(KERNEL_VARIANTS)
        if args.error_breakdown:
            variants.update(ERROR_BREAKDOWN_VARIANTS)
            if device.type != "cuda":
                del variants["ours_reference_ops_cudnn_attention"]  # cuDNN attention needs a GPU
        for name, (reference_ops, attention_backend) in variants.items():
            with kernel_choice(reference_ops, attention_backend):
                timed[name], outputs[name] = time_forward(run_ours, device, args.warmup, args.runs)
            print(f"{name}: median {statistics.median(timed[name]):.4f} s over {timed[name]}")
        if args.blas_experiments and device.type == "cuda":
            for name, (library, layers) in BLAS_VARIANTS.items():
                with blas_library(ours, library, layers):
                    timed[name], outputs[name] = time_forward(run_ours, device, args.warmup, args.runs)
                print(f"{name}: median {statistics.median(timed[name]):.4f} s over {timed[name]}")
        profile = kernel_profile(run_ours, device) if args.profile else None
        if profile is not None:
            print(
                f"profile of ours: span {profile.get('span_ms', 0):.1f} ms, idle {profile.get('idle_ms', 0):.1f} ms, "
                f"{profile.get('group_ms')}"
            )
            for kernel in profile.get("top_kernels", [])[:12]:
                print(
                    f"  {kernel['total_ms']:9.2f} ms {kernel['calls']:5d} x  {kernel['group']:>9}  {kernel['name'][:90]}"
                )

        if args.fp8:
            began = time.perf_counter()
            converted = quantize_dit_linears(ours)
            synchronize(device)
            print(f"{converted} linear layers quantized to FP8 in {time.perf_counter() - began:.1f} s")
            timed["ours_fp8"], outputs["ours_fp8"] = time_forward(run_ours, device, args.warmup, args.runs)
            print(f"ours_fp8: median {statistics.median(timed['ours_fp8']):.4f} s over {timed['ours_fp8']}")
        else:
            began = time.perf_counter()
            reference = move_into_diffusers(
                ours, config, device, keep_ours=args.interleaved > 0 or args.fp32_reference
            )
            synchronize(device)
            print(f"weights moved into diffusers in {time.perf_counter() - began:.1f} s")
            kwargs = request.as_diffusers_kwargs()

            def run_reference() -> tuple[torch.Tensor, torch.Tensor]:
                video, audio = reference(**kwargs, return_dict=False)
                return video[0], audio[0]

            timed["diffusers"], outputs["diffusers"] = time_forward(
                run_reference, device, args.warmup, args.runs
            )
            print(
                f"diffusers: median {statistics.median(timed['diffusers']):.4f} s over {timed['diffusers']}"
            )
            if args.interleaved > 0:
                pairs = interleaved_pairs(run_ours, run_reference, device, args.interleaved)
                timed["ours_interleaved"] = [ours_s for ours_s, _ in pairs]
                timed["diffusers_interleaved"] = [reference_s for _, reference_s in pairs]
                interleaved_ratios = [ours_s / reference_s for ours_s, reference_s in pairs]
                print(f"interleaved pairs (ours, diffusers): {pairs}, ratios {interleaved_ratios}")
            del reference, run_reference
            if args.fp32_reference:
                synchronize(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                began = time.perf_counter()
                fp32_outputs = fp32_reference_forward(ours, arguments, device)
                synchronize(device)
                print(f"fp32 reference forward in {time.perf_counter() - began:.1f} s")

    medians = {name: statistics.median(seconds) for name, seconds in timed.items()}
    baseline = "diffusers" if "diffusers" in outputs else "ours_reference_kernels"
    errors = {}
    for name in outputs:
        if name == baseline:
            continue
        video, audio = outputs[name]
        errors[f"{name}_vs_{baseline}"] = {
            "video_max_relative": max_relative_error(video, outputs[baseline][0]),
            "audio_max_relative": max_relative_error(audio, outputs[baseline][1]),
            "video_relative_l2": relative_l2(video, outputs[baseline][0]),
            "audio_relative_l2": relative_l2(audio, outputs[baseline][1]),
        }
    for name in ERROR_BREAKDOWN_VARIANTS:
        if name in outputs:
            errors[f"{name}_vs_ours_reference_kernels"] = {
                "video_relative_l2": relative_l2(outputs[name][0], outputs["ours_reference_kernels"][0]),
                "audio_relative_l2": relative_l2(outputs[name][1], outputs["ours_reference_kernels"][1]),
            }
    if baseline != "ours_reference_kernels":
        # Kernels on vs off: the fused ops and the fast attention against our plain-torch twins.
        errors["ours_vs_ours_reference_kernels"] = {
            "video_relative_l2": relative_l2(outputs["ours"][0], outputs["ours_reference_kernels"][0]),
            "audio_relative_l2": relative_l2(outputs["ours"][1], outputs["ours_reference_kernels"][1]),
            "video_max_relative": max_relative_error(
                outputs["ours"][0], outputs["ours_reference_kernels"][0]
            ),
            "audio_max_relative": max_relative_error(
                outputs["ours"][1], outputs["ours_reference_kernels"][1]
            ),
        }
    if fp32_outputs is not None:
        for name, (video, audio) in outputs.items():
            errors[f"{name}_vs_fp32_reference"] = {
                "video_relative_l2": relative_l2(video, fp32_outputs[0]),
                "audio_relative_l2": relative_l2(audio, fp32_outputs[1]),
                "video_max_relative": max_relative_error(video, fp32_outputs[0]),
                "audio_max_relative": max_relative_error(audio, fp32_outputs[1]),
            }
    if "ours_fp8" in outputs:
        errors["ours_fp8_vs_ours"] = {
            "video_relative_l2": relative_l2(outputs["ours_fp8"][0], outputs["ours"][0]),
            "audio_relative_l2": relative_l2(outputs["ours_fp8"][1], outputs["ours"][1]),
        }
    result = {
        "benchmark": "dit_forward",
        "config": "tiny" if args.tiny else "released",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "flash_attn_4": package_version("flash-attn-4"),
        "diffusers": package_version("diffusers"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes": {
            "text_rows": request.text_index.numel(),
            "audio_rows": request.audio_index.numel(),
            "video_rows": request.video_index.numel(),
            "sequence": request.tags.numel(),
            "num_timesteps": request.timesteps.numel(),
            "timesteps": request.timesteps.tolist(),
            "video_rows_shape": list(request.video_rows.shape),
            "audio_rows_shape": list(request.audio_rows.shape),
            "text_states_shape": list(request.text_states.shape),
        },
        "dtype": "bfloat16 with the released fp32 islands",
        "variants": {
            "ours": "fused Triton ops + the fastest attention backend, layout and AdaLN tables prepared per request",
            "ours_reference_kernels": "the same model with the plain-torch twins and torch SDPA attention",
            "ours_fused_ops_sdpa_attention": "fused Triton ops, torch SDPA attention (error breakdown)",
            "ours_reference_ops_fast_attention": "plain-torch ops, the fastest attention backend (error breakdown)",
            "ours_reference_ops_cudnn_attention": "plain-torch ops, torch's cuDNN attention (error breakdown)",
            **{
                name: f"ours with {library} for {', '.join(layers) or 'every GEMM'}"
                for name, (library, layers) in BLAS_VARIANTS.items()
            },
            "ours_fp8": "ours with FP8 (e4m3, per-channel weight / per-row activation scales) block linears",
            "diffusers": "MiniMaxH3Transformer3DModel, default attention backend, AdaLN per forward",
            "fp32_reference": "errors *_vs_fp32_reference: ours' forward in fp32 throughout (fp32_reference_forward)",
        },
        "implementations": implementations,
        "warmup": args.warmup,
        "runs": args.runs,
        "seconds": timed,
        "median_s": medians,
        "flop_per_forward": flops,
        "flop_parts": flop_parts,
        "tflops": {name: flops / median / 1e12 for name, median in medians.items()},
        "floor_s": floor_s,
        "floor_definition": f"linear FLOPs at {GEMM_CEILING_TFLOPS} + attention FLOPs at {ATTENTION_CEILING_TFLOPS} "
        "TFLOP/s (H200 ceilings, docs/PERFORMANCE.md §2)",
        "fraction_of_floor": {name: floor_s / median for name, median in medians.items()},
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "errors": errors,
        "profile_of_ours": profile,
        "error_definition": "max_relative: max |a - b| / max |b| per velocity; relative_l2: ||a - b|| / ||b||",
    }
    if "diffusers" in medians:
        result["ratio_ours_over_diffusers"] = medians["ours"] / medians["diffusers"]
        result["ratio_reference_kernels_over_diffusers"] = (
            medians["ours_reference_kernels"] / medians["diffusers"]
        )
    if interleaved_ratios:
        result["interleaved_pair_ratios"] = interleaved_ratios
        result["ratio_interleaved_median_of_pairs"] = statistics.median(interleaved_ratios)
        result["interleaving"] = (
            "both models resident, pairs timed back to back, pair i runs ours first when i is even and diffusers "
            "first when it is odd (ABBA); ratio per pair = ours / diffusers"
        )
    if "ours_fp8" in medians:
        result["ratio_fp8_over_ours"] = medians["ours_fp8"] / medians["ours"]
    for name, median in medians.items():
        print(
            f"{name:>24}: {median:.4f} s  {flops / median / 1e12:6.0f} TFLOP/s  {floor_s / median:.0%} of floor"
        )
    for name, error in errors.items():
        print(f"{name}: " + ", ".join(f"{key} {value:.2e}" for key, value in error.items()))
    if "ratio_ours_over_diffusers" in result:
        print(f"ratio ours/diffusers {result['ratio_ours_over_diffusers']:.3f}")
    if interleaved_ratios:
        print(f"interleaved: median of pair ratios {result['ratio_interleaved_median_of_pairs']:.4f}")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().strftime("%Y%m%d")
    suffix = ("_tiny" if args.tiny else "") + ("_fp8" if args.fp8 else "")
    suffix += "_error_breakdown" if args.error_breakdown else ""
    suffix += "_interleaved" if interleaved_ratios else ""
    suffix += "_fp32_reference" if fp32_outputs is not None else ""
    output_path = args.output_dir / f"dit_forward_{device_label(device)}_{date}{suffix}.json"
    output_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output_path}")


if __name__ == "__main__":
    main()
