"""Command line: `python -m h3engine generate ...` and `python -m h3engine make-tiny-checkpoint DIR`.

Task inputs: `--first-frame` / `--last-frame` (FL2VA) and repeatable `--ref KIND:PATH[@START_SECONDS]` (Ref2VA, in
the order the prompt's <Picture i> / <Video k> / <Audio j> labels count them); without `--task` the inputs pick it.

Devices: one device (`--device`, default cuda when present) runs the engine in this process. Several ranks run
through the same engine front as the app, on a resident worker group (h3engine.runtime.workers): `--gpus N`,
`--devices 0,1,...`, or `--world-size N` (with `--device cpu`: N CPU ranks over gloo). `--dit-sp`, `--dit-tp`,
`--encoder-tp` and `--vae-ranks` choose the group's layout (defaults: the profile of its size).
`--memory-profile` (resident or low-memory, see h3engine.placement) applies to the engine and to every rank.

Order of the checks: the output flags, the request and its files (headers only) are checked before torch is even
imported, so a mistake costs well under a second; then the device and layout flags (they need torch to count GPUs)
and the prompt's token bound (the checkpoint's tokenizer alone); only then does any model load.

Exit codes: 0 success; 2 a bad request, input file, output, layout flag or checkpoint (one line on stderr naming the
field, flag or file); 1 an internal error (one line on stderr; `--debug` adds the traceback, for the in-process engine);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): a running generation is cancelled and every worker process
ends. Nothing is written under the output name unless the whole generation succeeded.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from h3engine.errors import H3Error, RequestError
from h3engine.request import REFERENCE_KINDS, GenerationRequest, check_prompt_tokens, from_dict, validate

if TYPE_CHECKING:  # torch is imported only once a generation really starts
    import torch

    from h3engine.parallel.groups import RuntimeLayout

EXIT_TERMINATED = 143
# FP8 GEMMs (`torch._scaled_mm`) exist from compute capability 8.9 (Ada) on; elsewhere h3engine.quantization emulates
# them in fp32, which is slower than bf16 and only adds quantization noise.
FP8_MIN_CAPABILITY = (8, 9)


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so that `finally` blocks stop the workers (like Ctrl-C)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in the CLI's one-line form (`error: ...`, exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m h3engine", description="MiniMax H3 audio-video generation")
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
    ranks = generate.add_argument_group("worker group (several GPUs, or CPU ranks)")
    ranks.add_argument("--gpus", type=int, default=None, help="run on the first N GPUs, one rank each")
    ranks.add_argument("--devices", default=None, help="run on these GPUs, one rank each, e.g. 0,1,2,3")
    ranks.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of ranks on --device (e.g. --device cpu --world-size 2)",
    )
    ranks.add_argument("--dit-sp", type=int, default=None, help="DiT Ulysses sequence-parallel degree")
    ranks.add_argument("--dit-tp", type=int, default=None, help="DiT tensor-parallel degree")
    ranks.add_argument("--encoder-tp", type=int, default=None, help="text-encoder tensor-parallel degree")
    ranks.add_argument("--vae-ranks", type=int, default=None, help="ranks sharing the video decode")
    generate.add_argument("--dtype", default=None, help="bfloat16 (released precision) or float32")
    generate.add_argument(
        "--memory-profile",
        default="resident",
        metavar="{resident,low-memory}",
        help="resident (default): every model stays on the GPU; low-memory: models wait in host memory and each "
        "phase moves onto the GPU only the ones it runs (smaller GPUs; slower)",
    )
    generate.add_argument(
        "--fp8-linear",
        action="store_true",
        help="quantize the DiT blocks' linear layers to FP8 (faster on Hopper, not the released precision; one GPU)",
    )
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
    # Everything below up to the device flags runs without torch (PyAV and Pillow read the file headers), so a
    # mistake in the request, its files or the output flags is refused in well under a second.
    from h3engine.media.inputs import probe_media

    out_path, save_tensors_path = _checked_outputs(args.out, args.save_tensors)
    _check_utf8_flag("--checkpoint", args.checkpoint)
    request = from_dict(_request_payload(args))
    # The canvas multiple of explicit width/height depends on the checkpoint and is checked once it is known.
    validate(request, probe_media, canvas_multiple=1)

    # Imported here: they need torch (GPU counts, layouts), which `--help` and the checks above never pay for.
    from h3engine.engine import resolve_device
    from h3engine.parallel.groups import RuntimeLayout
    from h3engine.placement import check_memory_profile
    from h3engine.runtime.workers import rank_devices

    check_memory_profile(args.memory_profile)
    devices = rank_devices(args.device, args.world_size, args.gpus, args.devices)
    try:
        layout = RuntimeLayout.choose(len(devices), args.dit_sp, args.dit_tp, args.encoder_tp, args.vae_ranks)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if args.fp8_linear and len(devices) > 1:
        raise RequestError("--fp8-linear: FP8 linear layers run on one GPU only (no worker group)")
    device = resolve_device(devices[0]) if len(devices) == 1 else None
    if args.fp8_linear and device is not None:
        _check_fp8_device(device)
    # The checkpoint's tokenizer alone (milliseconds); the checkpoint itself loads after this (minutes at the
    # released size).
    _check_prompt_tokens(args.checkpoint, request)
    if device is not None:
        return _generate_in_process(args, request, device, out_path, save_tensors_path)
    return _generate_on_workers(args, request, devices, layout, out_path, save_tensors_path)


def _check_utf8_flag(flag: str, value: str) -> None:
    """A path Python decoded from bytes that are not UTF-8 opens, but the sidecar that records it (and the MP4 muxer)
    cannot take it; refuse it before any work."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"{flag}: must be valid UTF-8 text; character {error.start} of the path is {value[error.start]!r}, "
            "a byte that is not UTF-8"
        ) from None


def _checked_outputs(out: str, save_tensors: str | None) -> tuple[Path, Path | None]:
    """`--out` and `--save-tensors` as paths, checked before any work: nothing is written until the end, so a path
    that cannot be written would otherwise fail after the whole generation."""
    from h3engine.media.outputs import OutputFiles

    _check_utf8_flag("--out", out)
    if save_tensors is not None:
        _check_utf8_flag("--save-tensors", save_tensors)
    if Path(out).suffix.lower() != ".mp4":
        raise RequestError(f"--out: the output must be an .mp4 path, got '{out}'")
    files = OutputFiles.beside(out, save_tensors)
    problem = files.problem()
    if problem is not None:
        role, message = problem
        raise RequestError(f"{'--out' if role == 'video' else '--save-tensors'}: {message}")
    return files.video, files.tensors


def _check_fp8_device(device: torch.device) -> None:
    import torch

    if device.type != "cuda":
        raise RequestError(
            f"--fp8-linear: FP8 linear layers need a CUDA GPU of compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer; on {device.type} they would only emulate "
            "FP8 (slower, and not the released precision): drop the flag"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise RequestError(
            f"--fp8-linear: FP8 linear layers need compute capability {FP8_MIN_CAPABILITY[0]}."
            f"{FP8_MIN_CAPABILITY[1]} or newer, {device} has {capability[0]}.{capability[1]} (they would only be "
            "emulated): drop the flag"
        )


def _check_prompt_tokens(checkpoint: str, request: GenerationRequest) -> None:
    """The prompt's token bound with the tokenizer of the partition serving the task; no model is loaded."""
    from h3engine.checkpoint.layout import detect_layout
    from h3engine.presentation import prompt_token_counter

    tokenizer_folder = detect_layout(checkpoint).for_task(request.task).tokenizer
    check_prompt_tokens(request.prompt, prompt_token_counter(tokenizer_folder))


def _print_step(step: int, total: int, elapsed_s: float) -> None:
    print(f"step {step}/{total} ({elapsed_s:.1f} s)", file=sys.stderr)


def _generate_in_process(
    args: argparse.Namespace,
    request: GenerationRequest,
    device: torch.device,
    out_path: Path,
    save_tensors_path: Path | None,
) -> int:
    from h3engine.engine import Engine, resolve_dtype

    engine = Engine.from_checkpoint(
        args.checkpoint,
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        memory_profile=args.memory_profile,
        fp8_linear=args.fp8_linear,
    )
    for warning in engine.validate(request):
        print(f"warning: {warning}", file=sys.stderr)
    written = engine.generate_to_file(
        request,
        out_path,
        save_tensors_path=save_tensors_path,
        on_step=lambda event: _print_step(event.step, event.total, event.elapsed_s),
    )
    print(written.video)
    return 0


def _generate_on_workers(
    args: argparse.Namespace,
    request: GenerationRequest,
    devices: tuple[str, ...],
    layout: RuntimeLayout,
    out_path: Path,
    save_tensors_path: Path | None,
) -> int:
    """The app's path: a worker group behind an engine front, one job, its messages printed as they come."""
    from h3engine.runtime.front import EngineFront
    from h3engine.runtime.messages import JobFailed, JobFinished, StepProgress
    from h3engine.runtime.workers import ProcessReplica

    replica = ProcessReplica(args.checkpoint, devices, layout, args.dtype, args.memory_profile)
    print(f"worker group ready on {', '.join(devices)}: {layout.describe()}", file=sys.stderr)
    front = EngineFront([replica], out_path.parent)
    try:
        for warning in front.check(request):
            print(f"warning: {warning}", file=sys.stderr)
        handle = front.submit(request, out_path, save_tensors_path)
        while True:
            event = handle.next_event(timeout=1.0)
            if isinstance(event, StepProgress):
                _print_step(event.step, event.total, event.elapsed_s)
            elif isinstance(event, JobFinished):
                print(event.video_path)
                return 0
            elif isinstance(event, JobFailed):
                if event.kind == "request":
                    raise RequestError(event.message)
                print(f"error: {event.message}", file=sys.stderr)
                return 1
    finally:
        front.shutdown()


def _raise_terminated(signal_number: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or an argument error (2, already printed)
        return 0 if done.code is None else int(done.code)
    # Only the main thread may take signals (main() also runs inside tests and other programs' threads).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
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
    except Terminated:
        print("terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as error:  # the last line of defence: one line, no traceback unless asked
        if args.debug:
            traceback.print_exc()
        print(f"internal error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
