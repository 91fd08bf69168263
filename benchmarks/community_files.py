"""The community's H3 DiT files: their error against bf16 on a small model, and the memory plan each gets on 24 / 16 /
12 / 8 GiB cards (predicted by the planner, not measured), on the CPU.

Error: a DiT of the tiny checkpoint's shape but 256-wide (every linear's rows whole K-quant super-blocks and ConvRot
groups), random weights, written in each format by our writers (GGUF: gguf-py's quantizers for Q8_0 / Q5_0 / Q4_0,
ours for the K-quants; single files: h3engine.checkpoint.single_files_write), loaded through `--dit`'s loader and run
on a packed FL2VA-like request: the relative L2 error of the video and audio velocities against the same DiT in
bf16, and the bits each weight takes on disk.

Memory: a released-size placeholder checkpoint and GGUF placeholders (real headers, data a hole) of the released DiT
and of the pruned one, planned by `plan-memory` for a 5 s 768p T2VA with a 1,536-token prompt, AdaLN tables cached,
a 2 GB/s disk, under each GPU budget with 32 and 64 GiB of host memory (README's "Which PC runs what" settings).

    python -m benchmarks.community_files                   # JSON to benchmarks/results/
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import tempfile
from pathlib import Path

import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

from benchmarks._common import RESULTS_DIR, package_version
from benchmarks._packed_request import build_packed_request
from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import native_state_shapes, random_native_state
from h3engine.checkpoint.gguf_quantize import quantize
from h3engine.checkpoint.gguf_write import placeholder_type, write_gguf_placeholder
from h3engine.checkpoint.layout import PartitionPaths
from h3engine.checkpoint.loader import dit_file_source
from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.cli.main import main as cli
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig

PREFIX = "model.diffusion_model."
WIDE = dataclasses.replace(
    DiTConfig.tiny(),
    hidden_size=256,
    num_heads=2,
    head_dim=128,
    ffn_dim=512,
    text_dim=256,
    timestep_dim=256,
    time_hidden_dim=256,
    time_embed_dim=256,
)
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")
SINGLE_FORMATS = ("f16", "fp8_e4m3_scaled", "int8_rowwise", "int8_convrot")
PLACEHOLDER_TYPES = ("Q8_0", "Q6_K", "Q4_K", "Q2_K")
GPU_BUDGETS = (24, 16, 12, 8)
HOST_BUDGETS = (32, 64)


def write_gguf_dit(path: Path, state: dict[str, torch.Tensor], kind: str) -> None:
    """`state` as a community GGUF: linears in `kind` where their rows are whole blocks (as placeholder_type picks)."""
    writer = GGUFWriter(path, "h3")
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for key, value in state.items():
        stored = placeholder_type(tuple(value.shape), kind)
        if stored in ("F32", "F16"):
            writer.add_tensor(
                PREFIX + key, value.float().numpy().astype("float32" if stored == "F32" else "float16")
            )
        else:
            raw = quantize(value.float(), stored).numpy()
            writer.add_tensor(PREFIX + key, raw, raw_dtype=GGMLQuantizationType[stored])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_file(path: Path, config: DiTConfig, request) -> tuple[torch.Tensor, torch.Tensor]:
    paths = PartitionPaths(
        "fl2va",
        ("t2va",),
        path.parent,
        path.parent,
        path.parent,
        path.parent,
        path.parent,
        path.parent,
        dit_weights=path,
    )
    dit = dit_file_source(paths, config, torch.bfloat16).load(torch.device("cpu"))
    with torch.no_grad():
        return dit(*request.as_h3_arguments())


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


def errors(folder: Path) -> list[dict]:
    state = {
        k: v for k, v in native_to_module(random_native_state(WIDE, 3), WIDE).items() if k != "rope.inv_freq"
    }
    request = build_packed_request(
        text_rows=64,
        vision_rows_in_text=2,
        condition_frames=1,
        latent_frames=4,
        latent_height=16,
        latent_width=20,
        audio_latents_per_channel=25,
        video_channels=WIDE.video_in_channels,
        audio_channels=WIDE.audio_in_channels,
        text_dim=WIDE.text_dim,
        text_dtype=torch.bfloat16,
        video_timestep=0.42,
        audio_timestep=0.67,
        seed=5,
    )
    reference = H3DiT(WIDE, dtype=torch.bfloat16)
    reference.load_state_dict({**state, "rope.inv_freq": reference.rope.inv_freq}, strict=True)
    with torch.no_grad():
        video_ref, audio_ref = reference(*request.as_h3_arguments())
    parameters = sum(value.numel() for value in state.values())
    rows = []
    files = [
        (f"GGUF {kind}", folder / f"{kind}.gguf", lambda p, k=kind: write_gguf_dit(p, state, k))
        for kind in GGUF_TYPES
    ]
    files += [
        (
            f"single file {fmt}",
            folder / f"{fmt}.safetensors",
            lambda p, f=fmt: write_single_file(
                p,
                state,
                f,
                convrot_group=256,
                quantized=lambda name, t: name.endswith(".weight") and t.dim() == 2 and t.shape[1] % 256 == 0,
            ),
        )
        for fmt in SINGLE_FORMATS
    ]
    for name, path, write in files:
        write(path)
        video, audio = run_file(path, WIDE, request)
        rows.append(
            {
                "format": name,
                "bits_per_weight": round(path.stat().st_size * 8 / parameters, 2),
                "video_rel_l2": relative(video, video_ref),
                "audio_rel_l2": relative(audio, audio_ref),
            }
        )
        print(
            f"{name:28} {rows[-1]['bits_per_weight']:5.2f} bits  video {rows[-1]['video_rel_l2']:.2e}  "
            f"audio {rows[-1]['audio_rel_l2']:.2e}"
        )
    return rows


def plans(folder: Path) -> list[dict]:
    released = make_placeholder_checkpoint(folder / "released")
    pruned = dataclasses.replace(DiTConfig.released(), adaln_rank=8, adaln_table_rows=1025)
    candidates: list[tuple[str, Path | None]] = [("bf16 release (folder)", None)]
    for label, config in (("", DiTConfig.released()), ("pruned ", pruned)):
        shapes = {PREFIX + k: v for k, v in native_state_shapes(config).items() if k != "rope.inv_freq"}
        for kind in PLACEHOLDER_TYPES:
            path = folder / f"{label.strip() or 'exact'}-{kind}.gguf"
            write_gguf_placeholder(path, shapes, kind)
            candidates.append((f"{label}GGUF {kind}", path))
    rows = []
    for name, path in candidates:
        for host in HOST_BUDGETS:
            for gpu in GPU_BUDGETS:
                flags = [
                    "plan-memory",
                    "--checkpoint",
                    str(released),
                    "--gpu-memory",
                    str(gpu),
                    "--host-memory",
                    str(host),
                    "--disk-read-gbps",
                    "2",
                    "--prompt-tokens",
                    "1536",
                    "--json",
                ]
                flags += ["--dit", f"fl2va={path}"] if path is not None else []
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = cli(flags)
                plan = json.loads(out.getvalue()) if out.getvalue().strip() else {}
                row = {
                    "file": name,
                    "file_gib": round(path.stat().st_size / 2**30, 2) if path else None,
                    "gpu_gib": gpu,
                    "host_gib": host,
                    "fits": code == 0,
                    "predicted_step_seconds": plan.get("predicted_step_seconds"),
                    "disk_gb_per_step": round(plan["disk_bytes_per_step"] / 1e9, 1) if plan else None,
                    "peak_gpu_gib": round(plan["peak_gpu_bytes"] / 2**30, 1) if plan else None,
                    "refusal": err.getvalue().strip().splitlines()[-1] if code else None,
                }
                rows.append(row)
                print(
                    f"{name:22} gpu {gpu:2} host {host:2}: fits={row['fits']} step={row['predicted_step_seconds']}"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="h3-community-") as folder:
        result = {
            "benchmark": "community_files",
            "date": datetime.date.today().isoformat(),
            "device": "cpu (the plans are predictions for CUDA GPUs)",
            "versions": {name: package_version(name) for name in ("torch", "gguf")},
            "error_model": dataclasses.asdict(WIDE),
            "errors": errors(Path(folder)),
            "plans": plans(Path(folder)),
        }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / f"community_files_cpu_{datetime.date.today().strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
