"""One DiT forward, ours vs diffusers 0.42.1, at the released size on the 768p / 5 s T2VA layout (H3_SPEC §10).

Layout: 512 text + 414 audio + 37,296 video rows (S = 38,222), T2VA timesteps (text uses the video t, M = 2),
positions built like T2VA. Both models use random weights with the `random_native_tensor` recipe in bf16 with
the released fp32 islands, the same values for both.

Both models do not fit on one H200 at once (2 x 66 GB), so: build ours (meta, then materialized on the GPU and
filled tensor by tensor), time it and keep its velocities on the GPU, then move its weights into a meta-built
diffusers model group by group (converted with `native_to_diffusers`), freeing ours as it goes, and time
diffusers. Timing: warm-up forwards, then CUDA-event timing of `--runs` forwards, median reported.

    python benchmarks/dit_forward.py                              # GPU, released size, JSON to benchmarks/results
    python benchmarks/dit_forward.py --tiny --device cpu --output-dir /tmp   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import diffusers
import torch
from diffusers import MiniMaxH3Transformer3DModel

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))
sys.path.insert(0, str(REPOSITORY_ROOT / "tests"))

from _dit_helpers import PackedRequest, build_packed_request, max_relative_error  # noqa: E402

from h3engine.checkpoint.dit_keys import native_to_diffusers, random_native_tensor  # noqa: E402
from h3engine.models.dit import DiTConfig, H3DiT  # noqa: E402

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
    """Useful FLOPs of one forward (2 per MAC), from the shapes; ~3.57e15 at the released size (H3_SPEC §10)."""
    sequence = request.tags.numel()
    text = request.text_index.numel()
    num_timesteps = request.timesteps.numel()
    hidden, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    linear_per_row = 2 * (hidden * 3 * inner + inner * hidden + hidden * 2 * ffn + ffn * hidden)

    def attention_per_layer(rows: int) -> int:
        return 4 * rows * rows * inner  # QK^T and PV, S^2 * inner MACs each

    blocks = config.num_layers * (linear_per_row * sequence + attention_per_layer(sequence))
    refiner = config.num_refiner_layers * (linear_per_row * text + attention_per_layer(text))
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
    return float(blocks + refiner + adaln + time_mlp + projections)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def build_ours(config: DiTConfig, device: torch.device, seed: int) -> H3DiT:
    """Ours, built on meta and assigned random tensors drawn straight on `device` (no 66 GB host copy)."""
    model = H3DiT(config, dtype=torch.bfloat16, device="meta")
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {
        key: random_native_tensor(key, tuple(tensor.shape), config, generator).to(device)
        for key, tensor in model.state_dict().items()
    }
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def move_into_diffusers(ours: H3DiT, config: DiTConfig, device: torch.device) -> MiniMaxH3Transformer3DModel:
    """Hand ours' weights to a meta-built diffusers model one group at a time, freeing ours as it goes.

    Renamed tensors are shared (no copy); split/swapped ones are new, so the peak is ours + one block.
    The fp32 islands keep their dtype, which is exactly where diffusers' `_keep_in_fp32_modules` keeps fp32.
    """
    with torch.device("meta"):
        reference = MiniMaxH3Transformer3DModel.from_config(config.to_diffusers())
    groups: list[tuple[str, torch.nn.Module]] = [
        (f"blocks.{i}.", block) for i, block in enumerate(ours.blocks)
    ]
    groups += [(f"token_refiner.blocks.{i}.", block) for i, block in enumerate(ours.token_refiner.blocks)]
    for prefix, module in groups:
        partial = module.state_dict(prefix=prefix)
        result = reference.load_state_dict(native_to_diffusers(partial), strict=False, assign=True)
        assert not result.unexpected_keys, result.unexpected_keys
        del partial
        module.to_empty(device="meta")
    remaining = {key: tensor for key, tensor in ours.state_dict().items() if not tensor.is_meta}
    result = reference.load_state_dict(native_to_diffusers(remaining), strict=False, assign=True)
    assert not result.unexpected_keys, result.unexpected_keys
    del remaining
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


def gpu_label(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config and layout (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=3, help="timed forwards per model (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    device = torch.device(args.device)
    config = DiTConfig.tiny() if args.tiny else DiTConfig.released()
    request = t2va_request(config, args.tiny, args.seed).to(device)
    flops = forward_flops(config, request)
    print(
        f"layout: {request.text_index.numel()} text + {request.audio_index.numel()} audio + "
        f"{request.video_index.numel()} video rows, M = {request.timesteps.numel()}, {flops:.3e} FLOP per forward"
    )

    with torch.no_grad():
        began = time.perf_counter()
        ours = build_ours(config, device, args.seed)
        synchronize(device)
        print(f"ours built in {time.perf_counter() - began:.1f} s")
        ours_seconds, (ours_video, ours_audio) = time_forward(
            lambda: ours(*request.as_h3_arguments()), device, args.warmup, args.runs
        )
        print(f"ours: median {statistics.median(ours_seconds):.4f} s over {ours_seconds}")

        began = time.perf_counter()
        reference = move_into_diffusers(ours, config, device)
        synchronize(device)
        print(f"weights moved into diffusers in {time.perf_counter() - began:.1f} s")
        kwargs = request.as_diffusers_kwargs()

        def run_reference() -> tuple[torch.Tensor, torch.Tensor]:
            video, audio = reference(**kwargs, return_dict=False)
            return video[0], audio[0]

        reference_seconds, (reference_video, reference_audio) = time_forward(
            run_reference, device, args.warmup, args.runs
        )
        print(f"diffusers: median {statistics.median(reference_seconds):.4f} s over {reference_seconds}")

    ours_median, reference_median = statistics.median(ours_seconds), statistics.median(reference_seconds)
    video_error = max_relative_error(ours_video, reference_video)
    audio_error = max_relative_error(ours_audio, reference_audio)
    result = {
        "benchmark": "dit_forward",
        "config": "tiny" if args.tiny else "released",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
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
        "attention": {
            "ours": "torch SDPA (default backend choice)",
            "diffusers": "default attention backend",
        },
        "warmup": args.warmup,
        "runs": args.runs,
        "ours_seconds": ours_seconds,
        "diffusers_seconds": reference_seconds,
        "ours_median_s": ours_median,
        "diffusers_median_s": reference_median,
        "ratio_ours_over_diffusers": ours_median / reference_median,
        "flop_per_forward": flops,
        "ours_tflops": flops / ours_median / 1e12,
        "diffusers_tflops": flops / reference_median / 1e12,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "max_relative_error": {"video": video_error, "audio": audio_error},
        "error_definition": "max |ours - diffusers| / max |diffusers| per velocity",
    }
    print(
        f"ours {ours_median:.4f} s ({result['ours_tflops']:.0f} TFLOP/s), diffusers {reference_median:.4f} s "
        f"({result['diffusers_tflops']:.0f} TFLOP/s), ratio ours/diffusers {result['ratio_ours_over_diffusers']:.3f}"
    )
    print(f"max relative error: video {video_error:.3e}, audio {audio_error:.3e}")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().strftime("%Y%m%d")
    suffix = "_tiny" if args.tiny else ""
    output_path = args.output_dir / f"dit_forward_{gpu_label(device)}_{date}{suffix}.json"
    output_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output_path}")


if __name__ == "__main__":
    main()
