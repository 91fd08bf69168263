"""Command line: `python -m h3engine generate ...` and `python -m h3engine make-tiny-checkpoint DIR`.

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
    generate.add_argument("--task", default="t2va", help="t2va, fl2va or ref2va")
    generate.add_argument("--prompt", required=True)
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


def _request_payload(args: argparse.Namespace) -> dict:
    payload = {
        "task": args.task,
        "prompt": args.prompt,
        "aspect_ratio": args.aspect_ratio,
        "seed": args.seed,
        "steps": args.steps,
        "recipe": args.recipe,
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

    out_path = Path(args.out)
    if out_path.suffix.lower() != ".mp4":
        raise RequestError(f"--out: the output must be an .mp4 path, got '{args.out}'")
    if not out_path.parent.is_dir():
        raise RequestError(f"--out: folder '{out_path.parent}' does not exist")
    device = resolve_device(args.device)
    engine = Engine.from_checkpoint(args.checkpoint, device=device, dtype=resolve_dtype(args.dtype, device))
    request = engine.parse_request(_request_payload(args))
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
