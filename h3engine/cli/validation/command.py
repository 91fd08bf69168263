"""The validation kit's commands: `check-checkpoint DIR [--deep]`, `reference --capture DIR ...`, `compare A B`,
and `generate`'s `--capture DIR [--capture-steps SEL]` (h3engine.cli.validation).

Exit codes: check-checkpoint 0 (every check passed) or 2 (a check failed, or no checkpoint); compare 0 (every
boundary within its tolerance) or 1 (one diverged; 2 for a folder that is no capture or a bad --tol); reference 0,
or 2 for a bad flag, a non-diffusers checkpoint or diffusers missing. Errors are one line naming the flag or file.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from h3engine.engine.options import add_component_file_flags, component_file_options, engine_layout
from h3engine.errors import CheckpointError, RequestError

VALIDATION_COMMANDS = ("check-checkpoint", "reference", "compare")


def add_capture_flags(parser: argparse.ArgumentParser) -> None:
    """`--capture DIR` and `--capture-steps SEL` (for `generate` and `reference`)."""
    group = parser.add_argument_group("boundary capture (validation)")
    group.add_argument(
        "--capture",
        default=None,
        metavar="DIR",
        help="write every boundary (tokens, text states, noise, layout, per-step DiT predictions and scheduler "
        "outputs, final latents, frames, waveform) as safetensors plus index.json into this new folder",
    )
    group.add_argument(
        "--capture-steps",
        default="all",
        metavar="SEL",
        help="which steps' boundaries to keep: all (default), none, first, last, or numbers and ranges such as "
        "0,2,-1 or 0-3 (0 is the first forward)",
    )


def add_validation_parsers(commands: Any) -> None:
    """The three validation subcommands on the CLI's subparsers."""
    check = commands.add_parser(
        "check-checkpoint", help="check a checkpoint folder's files, keys, shapes, dtypes"
    )
    check.add_argument("folder")
    check.add_argument(
        "--deep", action="store_true", help="also read every tensor once and print file digests"
    )
    add_component_file_flags(check)

    reference = commands.add_parser(
        "reference",
        help="run a T2VA, FL2VA or Ref2VA request through diffusers' pipeline and capture its boundaries",
    )
    reference.add_argument("--checkpoint", required=True, help="checkpoint folder in the diffusers layout")
    reference.add_argument("--prompt", required=True)
    reference.add_argument("--first-frame", default=None, help="FL2VA: the first keyframe")
    reference.add_argument("--last-frame", default=None, help="FL2VA: the last keyframe")
    reference.add_argument(
        "--ref",
        action="append",
        default=[],
        metavar="KIND:PATH[@START_SECONDS]",
        help="Ref2VA: a reference, in order (repeatable), as generate's --ref",
    )
    reference.add_argument("--seed", type=int, default=0)
    reference.add_argument("--steps", type=int, default=50, help="denoising steps in --recipe's convention")
    reference.add_argument("--recipe", default="sglang", help="sglang (default) or diffusers step convention")
    reference.add_argument("--duration", type=float, default=None)
    reference.add_argument("--aspect-ratio", default="auto")
    reference.add_argument("--width", type=int, default=None)
    reference.add_argument("--height", type=int, default=None)
    reference.add_argument("--flow-shift", type=float, default=None)
    reference.add_argument("--audio-flow-shift", type=float, default=None)
    add_capture_flags(reference)

    compare = commands.add_parser("compare", help="compare two captures boundary by boundary")
    compare.add_argument("a", help="capture folder (e.g. ours)")
    compare.add_argument("b", help="capture folder it is compared against (e.g. the reference)")
    compare.add_argument(
        "--tol",
        action="append",
        default=[],
        metavar="fp32|bf16|BOUNDARY=VALUE",
        help="tolerance preset (fp32, the default; bf16 for runs at the release's precision) or one boundary's "
        "bound on relative L2; repeatable",
    )


def new_capture(args: argparse.Namespace) -> Any:
    """The capture `--capture` asks for, checked and its folder created (None without the flag)."""
    if getattr(args, "capture", None) is None:
        return None
    from h3engine.engine.trace import Capture, parse_steps

    try:
        steps = parse_steps(args.capture_steps)
    except ValueError as error:
        raise RequestError("--capture-steps", str(error)) from None
    capture = Capture(args.capture, steps)
    try:
        capture.prepare()
    except (ValueError, OSError) as error:
        raise RequestError("--capture", str(error)) from None
    return capture


@contextmanager
def capturing_generation(args: argparse.Namespace, request: Any, on_workers: bool) -> Iterator[Any]:
    """`generate --capture`: the block runs with the capture active and its index is written after it. On a
    worker group the block gets the capture's `CaptureSpec` (None without --capture) to put in its jobs (front.submit's
    `capture`): the group's rank 0 records and writes the index (split stage groups: each group's rank 0 records,
    the front writes the index)."""
    capture = new_capture(args)
    if capture is None:
        yield None
        return
    from h3engine.engine import trace

    if on_workers:
        yield trace.CaptureSpec(str(capture.folder.resolve()), args.capture_steps)
        if not (capture.folder / trace.INDEX_NAME).exists():
            print(
                f"warning: --capture: the worker group wrote no index to {capture.folder} (the job ended before "
                "it reached its first boundary)",
                file=sys.stderr,
            )
        return
    record = trace.index_record(request, "h3engine", args.capture_steps)
    try:
        with trace.capturing(capture):
            yield
    except BaseException as error:  # the boundaries reached so far stay readable, the index says why they end
        capture.finish({**record, "failed": f"{type(error).__name__}: {error}"})
        raise
    capture.finish(record)


def run_validation(args: argparse.Namespace) -> int:
    """Run one of `VALIDATION_COMMANDS`; bad input raises an H3Error (the CLI prints one line, exit 2)."""
    if args.command == "check-checkpoint":
        return _check_checkpoint(args)
    if args.command == "compare":
        return _compare(args)
    return _reference(args)


def _check_checkpoint(args: argparse.Namespace) -> int:
    from h3engine.cli.validation.checkpoint_probe import format_report, probe_checkpoint

    started = time.perf_counter()
    layout = engine_layout(args.folder, component_file_options(args))
    kind, reports = probe_checkpoint(layout, deep=args.deep)
    print(format_report(args.folder, kind, reports, args.deep))
    print(f"checked in {time.perf_counter() - started:.1f} s")
    return 0 if all(report.ok for report in reports) else 2


def _compare(args: argparse.Namespace) -> int:
    from h3engine.cli.validation.compare import (
        CaptureError,
        compare_captures,
        format_table,
        parse_tolerances,
        request_differences,
    )

    try:
        bounds = parse_tolerances(args.tol)
    except ValueError as error:
        raise RequestError("--tol", str(error)) from None
    runs: list[str] = []
    try:
        rows, first = compare_captures(Path(args.a), Path(args.b), bounds, runs)
        differences = request_differences(Path(args.a), Path(args.b))
    except CaptureError as error:
        raise CheckpointError(str(error)) from None
    print(f"A: {args.a} ({runs[0]})\nB: {args.b} ({runs[1]})")
    if differences:
        print(f"note: the two requests differ in {', '.join(differences)}: a divergence is expected")
    print(format_table(rows, first))
    return 0 if first is None else 1


def _reference(args: argparse.Namespace) -> int:
    from h3engine.cli.specs import parse_reference_spec
    from h3engine.cli.validation.reference import ReferenceUnavailable, check_reference, run_reference
    from h3engine.request.model import GenerationRequest

    if args.capture is None:
        raise RequestError("--capture", "the reference runner needs a capture folder")
    keyframes = [
        {"path": path, "position": position}
        for position, path in (("first", args.first_frame), ("last", args.last_frame))
        if path is not None
    ]
    payload = {
        "width": args.width,
        "height": args.height,
        "duration_seconds": args.duration,
        "flow_shift": args.flow_shift,
        "audio_flow_shift": args.audio_flow_shift,
    }
    from h3engine.request.shapes import from_dict

    references = [parse_reference_spec(spec) for spec in args.ref]
    request = from_dict(
        {
            "task": "ref2va" if references else "fl2va" if keyframes else "t2va",
            "keyframes": keyframes,
            "references": references,
            "prompt": args.prompt,
            "seed": args.seed,
            "steps": args.steps,
            "recipe": args.recipe,
            "aspect_ratio": args.aspect_ratio,
            **{key: value for key, value in payload.items() if value is not None},
        }
    )
    assert isinstance(request, GenerationRequest)
    try:
        check_reference(Path(args.checkpoint), request)  # before the capture folder is made
        capture = new_capture(args)
        run = run_reference(Path(args.checkpoint), request, capture)
    except ReferenceUnavailable as error:
        raise RequestError("reference", str(error)) from None
    from h3engine.engine.trace import index_record

    record = index_record(request, "diffusers", args.capture_steps)
    index = capture.finish({**record, **run})
    print(index, file=sys.stdout)
    return 0
