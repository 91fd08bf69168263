"""The video VAE decode at the released size (768p / 5 s: latents [1, 24, 37, 48, 84]) on one GPU, with the engine's
recipe (fp32 weights under fp16 autocast) and random weights (`video_vae_keys.random_native_state`): seconds per
decode (GPU work only, no host copy), the decoder's tokens and FLOPs, and a kernel profile of one decode (time per
kernel group, busiest kernels) to show where the time goes.

    python -m benchmarks.video_decode --output-dir DIR
    python -m benchmarks.video_decode --tiny --device cpu --output-dir /tmp    # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import RESULTS_DIR, device_label, kernel_profile, package_version, synchronize
from benchmarks.e2e import build_video_vae
from h3engine.models import ops
from h3engine.models.video_vae import DECODE_BATCH_TILES, VideoVAE, VideoVAEConfig

RELEASED_LATENTS = (1, 24, 37, 48, 84)
TINY_LATENTS = (1, 4, 5, 4, 6)


def decoder_flops(vae: VideoVAE, latent_shape: tuple[int, ...]) -> tuple[int, float]:
    """(tokens, FLOPs) of the decoder transformer over every planned tile (2 per MAC, linear layers + attention)."""
    config = vae.config
    hidden, inner = config.decoder_hidden_size, config.decoder_ffn_inner_dim
    per_token_linear = 2 * (3 * hidden * hidden + hidden * hidden + hidden * 2 * inner + inner * hidden)
    tokens = flops = 0
    for tile in vae.plan_decode(latent_shape).tiles:
        count = (
            (tile.frames[1] - tile.frames[0])
            * (tile.rows[1] - tile.rows[0])
            * (tile.columns[1] - tile.columns[0])
            + config.decoder_num_register_tokens
            + 1
        )
        tokens += count
        flops += config.decoder_num_layers * (per_token_linear * count + 4 * count * count * hidden)
    return tokens, float(flops)


def decode_and_mux_runs(
    vae: VideoVAE, latents: torch.Tensor, args: argparse.Namespace, autocast_dtype: torch.dtype | None
) -> dict[str, dict[str, float]]:
    """The engine's decode with the MP4 written while it decodes, per x264 thread type: its timings."""
    from benchmarks.e2e import build_audio_vae
    from h3engine.engine.pipeline import Models, decode
    from h3engine.media import mux
    from h3engine.models.audio_vae import AudioVAEConfig

    audio_config = AudioVAEConfig.tiny() if args.tiny else AudioVAEConfig.released()
    audio_vae = build_audio_vae(audio_config, latents.device, args.seed)
    audio_latents = torch.randn(
        2, audio_config.latent_channels, 9 if args.tiny else 207, device=latents.device
    )
    models = Models(
        dit=None,
        video_vae=vae,
        audio_vae=audio_vae,
        text_encoder=None,
        tokenizer=None,
        video_decode_autocast=autocast_dtype,
    )
    default = mux.ENCODER_THREAD_TYPE
    runs = {}
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for run, thread_type in enumerate(args.mux_thread_types.split(",")):
            mux.ENCODER_THREAD_TYPE = thread_type
            _, _, timings = decode(
                models, latents, audio_latents, mp4_path=Path(folder) / f"{thread_type}.mp4"
            )
            # Keyed by run: a thread type listed twice keeps both runs.
            runs[f"run{run}_{thread_type.lower()}"] = timings
            print(f"decode and mux, x264 {thread_type.lower()} threads: {timings}")
    mux.ENCODER_THREAD_TYPE = default
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config and latents (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiles-per-call",
        default=f"1,{DECODE_BATCH_TILES}",
        help="comma-separated decoder batch sizes to time (VideoVAE.decode_batch_tiles); the last one is profiled",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--mux-thread-types",
        default="",
        help="also run the engine's decode with the MP4 written alongside (h3engine.engine.pipeline.decode), once per x264 "
        "thread type listed (e.g. SLICE,FRAME): decode, writer and after-decode seconds",
    )
    parser.add_argument(
        "--reference-ops",
        action="store_true",
        help="also time each variant with h3engine.models.ops forced to the torch twins (no Triton elementwise kernels)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    config = VideoVAEConfig.tiny() if args.tiny else VideoVAEConfig.released()
    latent_shape = TINY_LATENTS if args.tiny else RELEASED_LATENTS
    autocast_dtype = torch.float16 if device.type == "cuda" else None
    vae = build_video_vae(config, device, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    latents = torch.randn(latent_shape, device=device, generator=generator)
    tokens, flops = decoder_flops(vae, latent_shape)

    def decode() -> list[torch.Tensor]:
        return list(vae.decode_pieces(latents, autocast_dtype=autocast_dtype))

    variants: dict[str, dict] = {}
    first_video = None
    op_choices = [("", contextlib.nullcontext)]
    if args.reference_ops:
        op_choices.append(("_reference_ops", ops.force_reference))
    # The fused ops' variants run last, so the profiled decode (the last batch size listed) uses them.
    runs = [
        (int(value), suffix, choice)
        for suffix, choice in reversed(op_choices)
        for value in args.tiles_per_call.split(",")
    ]
    with torch.no_grad():
        for tiles_per_call, op_suffix, op_choice in runs:
            vae.decode_batch_tiles = tiles_per_call
            with op_choice():
                decode()  # warm-up
                seconds = []
                for _ in range(args.runs):
                    synchronize(device)
                    began = time.perf_counter()
                    pieces = decode()
                    synchronize(device)
                    seconds.append(time.perf_counter() - began)
            video = torch.cat(pieces, dim=2)
            first_video = video if first_video is None else first_video
            median = statistics.median(seconds)
            name = f"tiles_per_call_{tiles_per_call}{op_suffix}"
            variants[name] = {
                "decoder_calls": len(vae.plan_decode(latent_shape).call_batches(tiles_per_call)),
                "seconds": seconds,
                "median_s": median,
                "tflops": flops / median / 1e12,
                "max_relative_vs_first_variant": float(
                    (video - first_video).abs().max() / first_video.abs().max()
                ),
            }
            print(f"{name}: median {median:.3f} s, {flops / median / 1e12:.0f} TFLOP/s, {variants[name]}")
        profile = kernel_profile(decode, device)
    print(f"{tokens} decoder tokens, {flops:.3e} FLOP; profile groups {profile.get('group_ms')}")
    for kernel in profile.get("top_kernels", [])[:20]:
        print(
            f"  {kernel['total_ms']:9.2f} ms {kernel['calls']:5d} x  {kernel['group']:>17}  {kernel['name'][:90]}"
        )
    mux_runs = {}
    if args.mux_thread_types:
        mux_runs = decode_and_mux_runs(vae, latents, args, autocast_dtype)
    record = {
        "benchmark": "video_decode",
        "config": "tiny" if args.tiny else "released",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "latent_shape": list(latent_shape),
        "video_shape": [sum(piece.shape[2] for piece in pieces), *pieces[0].shape[-2:]],
        "precision": "fp32 weights under float16 autocast" if autocast_dtype else "float32",
        "tiles": len(vae.plan_decode(latent_shape).tiles),
        "decoder_tokens": tokens,
        "decoder_flops": flops,
        "timing": "perf_counter around decode_pieces with a device synchronize (no host copy), median of runs",
        "variants": variants,
        "profiled": f"tiles_per_call_{vae.decode_batch_tiles}",
        "profile": profile,
        "decode_and_mux": mux_runs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_tiny" if args.tiny else ""
    path = (
        args.output_dir / f"video_decode_{device_label(device)}_{datetime.date.today():%Y%m%d}{suffix}.json"
    )
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
