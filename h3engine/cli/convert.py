"""`python -m h3engine convert`: a released checkpoint written once as smaller files that load memory-mapped.

    python -m h3engine convert --checkpoint DIR [--prune-adaln] --weights fp8|int8|q8_0|...|q2_k --out DIR2

`--weights fp8`: the large linears as e4m3 with one fp32 scale per output row, what `--weights fp8` makes at load, in
the released layout (h3engine.checkpoint.fp8_files). `--prune-adaln` (native layout): each DiT's AdaLN projections
against a rank-`--adaln-rank` basis of its SiLU(temb) curve (h3engine.checkpoint.prune_adaln), printing each DiT's size
before and after and its pruned tables' error over t in [0, 1] and at a 50-step schedule's timesteps. `int8` / a GGUF
type: each DiT as one file beside the linked rest, a ComfyUI INT8 ConvRot safetensors (h3engine.checkpoint.
int8_convert) or a community-style GGUF (h3engine.checkpoint.gguf_convert), listed in gguf_files.json so the folder
loads as it is; with `--prune-adaln` the pruned checkpoint is staged in `<out>.pruning-staging` (removed always) and
converted from there. Prints each component's size and the total. Exit 2 with one line naming the flag or the file
for a bad flag, a checkpoint that does not load, or an output folder that is not empty.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from h3engine.checkpoint.layout import GGUF_KINDS, require_empty_folder
from h3engine.errors import RequestError

# fp8: our row-scaled e4m3 files; int8 and the GGUF types: each DiT as one file (INT8 ConvRot safetensors or a
# community-style GGUF file), the rest linked.
GGUF_FORMATS = GGUF_KINDS
INT8 = "int8"
SINGLE_FILE_FORMATS = (INT8, *GGUF_FORMATS)
CONVERT_FORMATS = ("fp8", *SINGLE_FILE_FORMATS)
# Beside --out: where --prune-adaln writes the pruned checkpoint that int8 or a GGUF type then converts.
STAGING_SUFFIX = ".pruning-staging"
# The schedule whose timesteps the pruned tables are fitted and checked on: the default request's.
CHECK_STEPS = 50


def add_convert_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Declare the `convert` subcommand on the CLI's subparsers."""
    convert = commands.add_parser(
        "convert",
        help="write a released checkpoint as smaller files once (--weights fp8: e4m3 with row scales; int8: INT8 "
        "ConvRot DiT files; q8_0 ... q2_k: GGUF DiT files; --prune-adaln: low-rank AdaLN)",
    )
    convert.add_argument("--checkpoint", required=True, help="the released checkpoint folder (either layout)")
    convert.add_argument(
        "--weights",
        default=None,
        help="fp8: the large linears as e4m3 with one fp32 scale per output row (the values --weights fp8 makes); "
        "int8: each DiT as a ComfyUI INT8 ConvRot single file; "
        f"{', '.join(GGUF_FORMATS)}: each DiT as a GGUF file of that type (the community's format); the folder "
        "loads as it is, its DiTs quantized in memory too",
    )
    convert.add_argument(
        "--prune-adaln",
        action="store_true",
        help="each DiT's AdaLN projections against a low-rank basis of its timestep curve (native layout)",
    )
    convert.add_argument(
        "--adaln-rank", type=int, default=8, help="with --prune-adaln: the basis' rank (default 8)"
    )
    convert.add_argument(
        "--out", required=True, help="an empty or missing folder for the converted checkpoint"
    )
    return convert


def _size(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.2f} MiB"


def schedule_timesteps(checkpoint: str) -> list[float]:
    """The DiT timesteps of a default request's schedule on `checkpoint` (video, audio, the condition levels; a
    step-distilled partition's rungs too)."""
    from h3engine.checkpoint.layout import detect_layout
    from h3engine.engine.sampling.packing import VISUAL_CONDITION_LEVEL
    from h3engine.engine.sampling.schedule import Schedule

    layout = detect_layout(checkpoint)
    shifts = {"video_shift": layout.video_shift, "audio_shift": layout.audio_shift}
    schedules = [Schedule.build(CHECK_STEPS, recipe="sglang", **shifts)]
    rungs = {paths.dmd_steps for paths in layout.partitions.values() if paths.dmd_steps is not None}
    schedules += [Schedule.from_rungs(tuple(steps), **shifts) for steps in sorted(rungs)]
    timesteps = [t for s in schedules for t in s.video_timesteps.tolist() + s.audio_timesteps.tolist()]
    return [*timesteps, VISUAL_CONDITION_LEVEL, 1.0]


def _prune(args: argparse.Namespace, out: str | Path) -> dict[str, int]:
    from h3engine.checkpoint.prune_adaln import prune_checkpoint

    if args.adaln_rank < 1:
        raise RequestError("--adaln-rank", f"expected a positive integer, got {args.adaln_rank}")
    reports, sizes = prune_checkpoint(
        args.checkpoint,
        out,
        rank=args.adaln_rank,
        timesteps=schedule_timesteps(args.checkpoint),
        fp8=args.weights == "fp8",
    )
    for report in reports:
        print(
            f"{report.folder}: pruned AdaLN to rank {report.rank} ({report.captured:.8%} of the centred curve's "
            f"energy over {report.samples} timesteps); DiT {_size(report.bytes_before)} -> "
            f"{_size(report.bytes_after)}"
        )
        print(
            f"{report.folder}: AdaLN table error (max relative L2 vs exact): {report.grid_error:.3e} over t in "
            f"[0, 1], {report.check_error:.3e} at the {CHECK_STEPS}-step schedule's timesteps (the exact engine's "
            f"own bf16 rounding: {report.bf16_error:.3e})"
        )
    return sizes


def _to_single_files(args: argparse.Namespace, source: str | Path) -> dict[str, int]:
    """`source` into --out with each DiT as one file of --weights (int8 or a GGUF type), printing each's size and
    error."""
    if args.weights == INT8:
        from h3engine.checkpoint.int8_convert import convert_checkpoint_to_int8

        conversions = convert_checkpoint_to_int8(source, args.out)
    else:
        from h3engine.checkpoint.gguf_convert import convert_checkpoint_to_gguf

        conversions = convert_checkpoint_to_gguf(source, args.out, args.weights)
    for partition, conversion in conversions.items():
        worst = max(conversion.errors.values(), default=0.0)
        print(
            f"{partition} DiT: {_size(conversion.bytes_before)} -> {_size(conversion.bytes_after)} "
            f"({conversion.path.name}; largest relative RMS error of a tensor {worst:.2e})"
        )
    return {f"{partition} DiT": conversion.bytes_after for partition, conversion in conversions.items()}


def _prune_to_single_files(args: argparse.Namespace) -> dict[str, int]:
    """--prune-adaln with int8 or a GGUF type in one step: the pruned checkpoint is written to a staging folder
    beside --out, converted into --out, and the staging folder removed whatever happens (Ctrl-C included)."""
    out = Path(args.out).expanduser().resolve()
    require_empty_folder(out)  # before the pruning's minutes
    staging = out.with_name(out.name + STAGING_SUFFIX)
    if staging.exists() or staging.is_symlink():
        raise RequestError(
            "--out",
            f"{staging}: the staging folder of --prune-adaln is in the way (left by a run that was killed?); "
            "remove it",
        )
    made = out  # the outermost folder missing now (None: --out is there), removed on failure
    while not made.parent.exists():
        made = made.parent
    made = None if out.exists() else made
    try:
        _prune(args, staging)
        return _to_single_files(args, staging)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run_convert(args: argparse.Namespace) -> int:
    """Convert (RequestError / CheckpointError for what cannot be: exit 2 by the CLI)."""
    if args.weights is not None and args.weights not in CONVERT_FORMATS:
        raise RequestError("--weights", f"expected one of {', '.join(CONVERT_FORMATS)}, got '{args.weights}'")
    if args.weights is None and not args.prune_adaln:
        raise RequestError("--weights", "give --weights fp8, --prune-adaln, or both")
    from h3engine.checkpoint.fp8_files import convert_checkpoint

    started = time.perf_counter()
    try:
        if args.weights in SINGLE_FILE_FORMATS:
            sizes = (
                _prune_to_single_files(args) if args.prune_adaln else _to_single_files(args, args.checkpoint)
            )
        elif args.prune_adaln:
            sizes = _prune(args, args.out)
        else:
            sizes = convert_checkpoint(args.checkpoint, args.out)
    except FileExistsError as error:
        raise RequestError("--out", str(error)) from None
    for component, size in sizes.items():
        print(f"{component}: {size / (1 << 30):.2f} GiB")
    total = sum(sizes.values())
    print(
        f"converted in {time.perf_counter() - started:.1f} s: {total / (1 << 30):.2f} GiB of weights in {args.out}"
    )
    return 0
