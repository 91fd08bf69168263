"""How far apart two exact bf16 implementations of a deep random-weight H3 DiT land, against their distance from fp32.

The released-size benchmark (dit_forward.py) finds that any change of bf16 rounding (our fused ops, or
FlashAttention-4 instead of cuDNN) moves the velocities by the same ~1.7e-2 relative L2 against diffusers. This
script asks, on the CPU and a narrower model with the released depth (50 blocks), whether that distance is the bf16
error itself: it runs one packed request through the fp32 model (the truth) and through the bf16 model twice, with
torch's fused SDPA kernel and with its math kernel (two exact attentions that round differently), and reports the
three distances.

    python benchmarks/bf16_noise_floor.py --output-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))
sys.path.insert(0, str(REPOSITORY_ROOT / "tests"))

from _dit_helpers import build_packed_request, relative_l2  # noqa: E402

from h3engine.checkpoint.dit_format import config_to_native, native_to_module  # noqa: E402
from h3engine.checkpoint.dit_keys import random_native_state  # noqa: E402
from h3engine.models.dit import DiTConfig, H3DiT  # noqa: E402

# The released depth and block structure, narrower (hidden 256, 4 heads of 64, 48 rotated channels).
CONFIG = DiTConfig(
    hidden_size=256,
    num_layers=50,
    num_refiner_layers=2,
    num_heads=4,
    head_dim=64,
    ffn_dim=704,
    video_in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=256,
    timestep_dim=256,
    time_hidden_dim=256,
    time_embed_dim=128,
    rope_freq_dim=8,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    state = random_native_state(CONFIG, args.seed)
    request = build_packed_request(
        text_rows=96,
        vision_rows_in_text=0,
        condition_frames=0,
        latent_frames=7,
        latent_height=24,
        latent_width=40,
        audio_latents_per_channel=40,
        video_channels=CONFIG.video_in_channels,
        audio_channels=CONFIG.audio_in_channels,
        text_dim=CONFIG.text_dim,
        text_dtype=torch.bfloat16,
        video_timestep=0.5,
        audio_timestep=0.7,
        seed=args.seed,
    )
    outputs = {}
    with torch.no_grad():
        for name, dtype, backend in (
            ("fp32", torch.float32, SDPBackend.MATH),
            ("bf16_fused_sdpa", torch.bfloat16, SDPBackend.FLASH_ATTENTION),
            ("bf16_math_sdpa", torch.bfloat16, SDPBackend.MATH),
        ):
            model = H3DiT(CONFIG, dtype=dtype)
            model.load_state_dict(native_to_module(state, CONFIG))
            with sdpa_kernel([backend]):
                outputs[name] = model(*request.as_h3_arguments())
            print(f"{name} done", flush=True)
    distances = {
        f"{a}_vs_{b}": {
            "video": relative_l2(outputs[a][0], outputs[b][0]),
            "audio": relative_l2(outputs[a][1], outputs[b][1]),
        }
        for a, b in (
            ("bf16_fused_sdpa", "fp32"),
            ("bf16_math_sdpa", "fp32"),
            ("bf16_math_sdpa", "bf16_fused_sdpa"),
        )
    }
    result = {
        "benchmark": "bf16_noise_floor",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "config": config_to_native(CONFIG),
        "sequence": request.tags.numel(),
        "relative_l2": distances,
    }
    print(json.dumps(distances, indent=2))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"bf16_noise_floor_cpu_{datetime.date.today():%Y%m%d}.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
