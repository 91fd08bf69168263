"""Command line: `python -m h3engine generate ...` and `python -m h3engine make-tiny-checkpoint DIR`.

Task inputs: `--first-frame` / `--last-frame` (FL2VA) and repeatable `--ref KIND:PATH[@START_SECONDS]` (Ref2VA, in
the order the prompt's <Picture i> / <Video k> / <Audio j> labels count them); without `--task` the inputs pick it.

Exit codes: 0 success; 2 a bad request, input file or checkpoint (one line on stderr naming the field or file);
1 an internal error (one line on stderr; `--debug` adds the traceback). Nothing is written under the output name
unless the whole generation succeeded.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from h3engine.errors import H3Error, RequestError
from h3engine.request import REFERENCE_KINDS, from_dict, validate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m h3engine", description="MiniMax H3 audio-video generation"
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks of internal errors")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate one MP4 (video + stereo audio)")
    generate.add_argument(
        "--checkpoint", required=True, help="checkpoint folder (native or diffusers layout)"
    )
    generate.add_argument(
        "--task",
        default=None,
        help="t2va, fl2va or ref2va (default: ref2va with --ref, fl2va with a first/last frame, else t2va)",
    )
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--first-frame", default=None, help="FL2VA: image the video starts on")
    generate.add_argument("--last-frame", default=None, help="FL2VA: image the video ends on")
    generate.add_argument(
        "--ref",
        action="append",
        default=[],
        metavar="KIND:PATH[@START_SECONDS]",
        help="Ref2VA reference, repeatable, in prompt order (<Picture i>, <Video k>, <Audio j>): KIND is image, "
        "video or audio; @START_SECONDS (videos only) skips the start of the clip",
    )
    generate.add_argument("--duration", type=float, default=None, help="seconds, 4 to 15 (default 5)")
    generate.add_argument("--aspect-ratio", default="auto", help="21:9, 16:9, 4:3, 1:1, 3:4, 9:16 or auto")
    generate.add_argument(
        "--short-edge", type=int, default=None, help="canvas short edge (checkpoint default)"
    )
    generate.add_argument("--width", type=int, default=None, help="explicit canvas width (with --height)")
    generate.add_argument("--height", type=int, default=None, help="explicit canvas height (with --width)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--steps", type=int, default=50)
    generate.add_argument("--flow-shift", type=float, default=None, help="video sigma shift (checkpoint: 12)")
    generate.add_argument(
        "--audio-flow-shift", type=float, default=None, help="audio sigma shift (checkpoint: 3)"
    )
    generate.add_argument("--recipe", default="sglang", help="sglang (default) or diffusers")
    generate.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    generate.add_argument("--dtype", default=None, help="bfloat16 (released precision) or float32")
    generate.add_argument(
        "--out", required=True, help="output .mp4 path (a .json sidecar is written beside it)"
    )
    generate.add_argument(
        "--save-tensors", default=None, help="also write float32 tensors to this .safetensors"
    )

    tiny = commands.add_parser("make-tiny-checkpoint", help="write a tiny random-weight checkpoint")
    tiny.add_argument("folder")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layout", choices=("native", "diffusers"), default="native")
    return parser


def parse_reference_spec(spec: str) -> dict[str, object]:
    """`KIND:PATH[@START_SECONDS]` -> a reference entry of our request shape.

    Only a video takes a start time: the text after its last `@` when that reads as a number. Otherwise (and for
    images and audio) an `@` belongs to the path.
    """
    kind, separator, rest = spec.partition(":")
    if not separator or kind not in REFERENCE_KINDS or not rest:
        raise RequestError(
            f"--ref: expected KIND:PATH[@START_SECONDS] with KIND one of {', '.join(REFERENCE_KINDS)}, got '{spec}'"
        )
    path, at, start_text = rest.rpartition("@")
    if kind == "video" and at and path:
        try:
            return {"kind": kind, "path": path, "start_seconds": float(start_text)}
        except ValueError:
            pass
    return {"kind": kind, "path": rest}


def _task(args: argparse.Namespace) -> str:
    if args.task is not None:
        return args.task
    if args.ref:
        return "ref2va"
    if args.first_frame is not None or args.last_frame is not None:
        return "fl2va"
    return "t2va"


def _request_payload(args: argparse.Namespace) -> dict:
    keyframes = [
        {"path": path, "position": position}
        for position, path in (("first", args.first_frame), ("last", args.last_frame))
        if path is not None
    ]
    payload = {
        "task": _task(args),
        "prompt": args.prompt,
        "aspect_ratio": args.aspect_ratio,
        "seed": args.seed,
        "steps": args.steps,
        "recipe": args.recipe,
        "keyframes": keyframes,
        "references": [parse_reference_spec(spec) for spec in args.ref],
    }
    optional = {
        "duration_seconds": args.duration,
        "short_edge": args.short_edge,
        "width": args.width,
        "height": args.height,
        "flow_shift": args.flow_shift,
        "audio_flow_shift": args.audio_flow_shift,
    }
    payload.update({key: value for key, value in optional.items() if value is not None})
    return payload


def _generate(args: argparse.Namespace) -> int:
    # Imported here so that `--help` and argument errors never pay for importing torch.
    from h3engine.engine import Engine, resolve_device, resolve_dtype
    from h3engine.media.inputs import probe_media

    out_path = Path(args.out)
    if out_path.suffix.lower() != ".mp4":
        raise RequestError(f"--out: the output must be an .mp4 path, got '{args.out}'")
    if not out_path.parent.is_dir():
        raise RequestError(f"--out: folder '{out_path.parent}' does not exist")
    request = from_dict(_request_payload(args))
    # The request and its files are checked before the checkpoint loads (minutes at the released size); the canvas
    # multiple of explicit width/height depends on the checkpoint and is checked once it is known.
    validate(request, probe_media, canvas_multiple=1)
    device = resolve_device(args.device)
    engine = Engine.from_checkpoint(args.checkpoint, device=device, dtype=resolve_dtype(args.dtype, device))
    for warning in engine.validate(request):
        print(f"warning: {warning}", file=sys.stderr)
    written = engine.generate_to_file(
        request,
        out_path,
        save_tensors_path=Path(args.save_tensors) if args.save_tensors else None,
        on_step=lambda event: print(
            f"step {event.step}/{event.total} ({event.elapsed_s:.1f} s)", file=sys.stderr
        ),
    )
    print(written.video)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "make-tiny-checkpoint":
            from h3engine.checkpoint.tiny import make_tiny_checkpoint

            try:
                print(make_tiny_checkpoint(args.folder, seed=args.seed, layout=args.layout))
            except FileExistsError as error:
                raise RequestError(str(error)) from None
            return 0
        return _generate(args)
    except H3Error as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # the last line of defence: one line, no traceback unless asked
        if args.debug:
            traceback.print_exc()
        print(f"internal error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
