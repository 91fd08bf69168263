"""Command line: `generate ...`, `make-tiny-checkpoint DIR`, `make-placeholder-checkpoint DIR`, `plan-memory ...`.

Task inputs: `--first-frame` / `--last-frame` (FL2VA) and repeatable `--ref KIND:PATH[@START_SECONDS]` (Ref2VA, in
prompt label order); without `--task` the inputs pick it. Adapters: repeatable `--lora PATH[:STRENGTH]`, on the DiT
`--lora-target` names (default: as diffusers); `--turbo` sets the steps, shifts and `--rungs` they run with.
Devices: `--device` (default cuda when present) runs the engine here; `--gpus N`, `--devices 0,1,...` or
`--world-size N` (`--device cpu`: CPU ranks over gloo) run a resident worker group (h3engine.runtime.workers). The
engine flags (layout, `--dtype`, the memory budget, `--fp8-linear`) are the app's too (h3engine.engine.options).

Checks: the output flags, the request and its files (headers) and `--dtype` before torch is imported; the device,
memory and layout flags; the request on the checkpoint's facts as the engine decides (h3engine.request.resolved;
`--steps` defaults to a step-distilled checkpoint's count); then models load.
Exit codes: 0 success; 2 a bad request, input file, output, flag, LoRA or checkpoint (one line on stderr naming it);
1 an internal error (one line; `--debug` adds the traceback); 130 Ctrl-C, 143 SIGTERM: a running generation is
cancelled and every worker process ends. Nothing is written under the output name unless all of it succeeded.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn

from h3engine.checkpoint.layout import detect_layout, distilled_step_count, require_empty_folder
from h3engine.cli.convert import add_convert_parser, run_convert
from h3engine.cli.plan_memory import add_plan_memory_parser, run_plan_memory
from h3engine.cli.progress import PROGRESS_MODES, Progress, make_progress
from h3engine.cli.remix import add_remix_flags, remix_payload
from h3engine.cli.specs import parse_dmd_steps, parse_lora_spec, parse_reference_spec
from h3engine.cli.validation.command import (
    VALIDATION_COMMANDS,
    add_capture_flags,
    add_validation_parsers,
    capturing_generation,
    run_validation,
)
from h3engine.engine.options import (
    EngineOptions,
    add_engine_flags,
    check_dtype,
    check_engine_options,
    check_fp8_device,
    load_engine,
    resolve_device,
)
from h3engine.errors import H3Error, RequestError
from h3engine.media.formats import accepted_text
from h3engine.request.model import LORA_TARGETS, MAX_LORA_STRENGTH, MAX_LORAS, GenerationRequest
from h3engine.request.shapes import from_dict

if TYPE_CHECKING:  # torch is imported only once a generation really starts
    import torch

    from h3engine.checkpoint.facts import CheckpointFacts
    from h3engine.models.parallel.groups import RuntimeLayout
    from h3engine.request.resolved import ResolvedRequest
    from h3engine.runtime.supervision import StallPolicy

EXIT_TERMINATED = 143


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so that `finally` blocks stop the workers (like Ctrl-C)."""


class EngineFailed(Exception):
    """A worker group's job failed inside the engine (exit code 1; its message is one line)."""


class JobRefused(Exception):
    """A worker group refused the job's request or an input file when it ran (exit code 2; its message is one
    line naming the field)."""


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
        help="t2va, fl2va or ref2va (default: ref2va with --ref, fl2va with a first/last frame, else t2va); "
        "remix: v2a, a2v or extend (h3engine.cli.remix)",
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
        f"video or audio ({accepted_text()}); @START_SECONDS (videos only) skips the start of the clip",
    )
    generate.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:STRENGTH]",
        help=f"LoRA adapter (.safetensors), repeatable (at most {MAX_LORAS}); STRENGTH from "
        f"{-MAX_LORA_STRENGTH:g} to {MAX_LORA_STRENGTH:g}, default 1",
    )
    generate.add_argument(
        "--lora-target",
        choices=LORA_TARGETS,
        default=None,
        help="the DiT every --lora applies to: transformer (T2VA / FL2VA) or transformer_ref (Ref2VA); default: "
        "the file's transformer. / transformer_ref. key prefixes, else transformer (as diffusers)",
    )
    add_remix_flags(generate)
    generate.add_argument("--duration", type=float, default=None, help="seconds, 4 to 15 (default 5)")
    generate.add_argument("--aspect-ratio", default="auto", help="21:9, 16:9, 4:3, 1:1, 3:4, 9:16 or auto")
    generate.add_argument(
        "--short-edge", type=int, default=None, help="canvas short edge (checkpoint default)"
    )
    generate.add_argument("--width", type=int, default=None, help="explicit canvas width (with --height)")
    generate.add_argument("--height", type=int, default=None, help="explicit canvas height (with --width)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument(
        "--steps",
        type=int,
        help="denoising steps (default: 50, or the count a step-distilled checkpoint runs, which accepts no other)",
    )
    generate.add_argument("--flow-shift", type=float, default=None, help="video sigma shift (checkpoint: 12)")
    generate.add_argument(
        "--audio-flow-shift", type=float, default=None, help="audio sigma shift (checkpoint: 3)"
    )
    generate.add_argument(
        "--rungs",
        default=None,
        metavar="T1,T2,...",
        help="step-distilled rungs, e.g. 999,750,500,250 (timesteps in (0, 1000], decreasing), one forward each "
        "instead of the grid of --steps (which then defaults to their count)",
    )
    generate.add_argument(
        "--turbo",
        action="store_true",
        help="the Turbo preset for step-distilled adapters: steps, flow shifts and rungs from the first --lora "
        "whose metadata declares them, else 8 steps with shifts 6 / 3; flags given explicitly win",
    )
    generate.add_argument("--recipe", default="sglang", help="sglang (default) or diffusers")
    generate.add_argument(
        "--cache",
        default="off",
        help="step caching for full-step runs: off (default, every block of every step), high (the peers' "
        "conservative MiniMax-H3 setting) or fast (more aggressive); lossy, refused with --rungs / --turbo",
    )
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
    ranks.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the job and restart the worker group when its ranks report nothing for this long (default: "
        "derived from the step time, at least 5 minutes; see README)",
    )
    add_engine_flags(generate)
    add_capture_flags(generate)
    generate.add_argument(
        "--out", required=True, help="output .mp4 path (a .json sidecar is written beside it)"
    )
    generate.add_argument(
        "--save-tensors", default=None, help="also write float32 tensors to this .safetensors"
    )
    shown = generate.add_argument_group("progress")
    shown.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="auto (default): a bar on a terminal, else plain lines, on stderr; bar or plain forces one; json: one "
        "JSON event a line on stdout (stderr keeps the errors)",
    )
    shown.add_argument(
        "--quiet", "-q", action="store_true", help="print only warnings, errors and the output path"
    )

    tiny = commands.add_parser("make-tiny-checkpoint", help="write a tiny random-weight checkpoint")
    tiny.add_argument("folder")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layout", choices=("native", "diffusers"), default="native")
    tiny.add_argument(
        "--dmd-steps",
        metavar="RUNGS",
        help="write a step-distilled checkpoint running these rungs, e.g. 999,750,500,250 (native layout only)",
    )
    placeholder = commands.add_parser(
        "make-placeholder-checkpoint",
        help="write a checkpoint of the released shapes whose weights are drawn at load (benchmarks; outputs are "
        "noise): about 1 MB on disk",
    )
    placeholder.add_argument("folder")
    placeholder.add_argument("--seed", type=int, default=0)
    placeholder.add_argument(
        "--tiny", action="store_true", help="the tiny shapes instead of the released ones"
    )
    placeholder.add_argument(
        "--real-bytes",
        default="",
        metavar="COMPONENTS",
        help="components whose files hold their drawn values as real bytes, e.g. dit,text_encoder (of dit, "
        "text_encoder, video_vae, audio_vae): reading them measures the disk (the released DiT is ~66 GB a "
        "partition)",
    )
    placeholder.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="fp8: the large linears as a converted checkpoint stores them (python -m h3engine convert --weights fp8)",
    )
    placeholder.add_argument(
        "--partitions",
        default="fl2va,ref2va",
        metavar="PARTITIONS",
        help="the partitions to write, e.g. fl2va (default both)",
    )
    add_plan_memory_parser(commands)
    add_convert_parser(commands)
    add_validation_parsers(commands)
    return parser


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
    remix = remix_payload(args, _task(args))
    payload = {
        "task": "t2va" if remix is not None else _task(args),
        "remix": remix,
        "prompt": args.prompt,
        "aspect_ratio": args.aspect_ratio,
        "seed": args.seed,
        "recipe": args.recipe,
        "cache": args.cache,
        "keyframes": keyframes,
        "references": [parse_reference_spec(spec) for spec in args.ref],
        "loras": [parse_lora_spec(spec, args.lora_target) for spec in args.lora],
    }
    if args.lora_target is not None and not args.lora:
        raise RequestError("--lora-target", "given without --lora (it sets the target of each --lora)")
    rungs = parse_dmd_steps(args.rungs, "--rungs")
    steps = args.steps
    if rungs is not None and steps is None:
        steps = distilled_step_count(rungs, args.recipe)
    optional = {
        "rungs": rungs,
        "steps": steps,
        "duration_seconds": args.duration,
        "short_edge": args.short_edge,
        "width": args.width,
        "height": args.height,
        "flow_shift": args.flow_shift,
        "audio_flow_shift": args.audio_flow_shift,
    }
    payload.update({key: value for key, value in optional.items() if value is not None})
    return payload


def _generate(args: argparse.Namespace, progress: Progress) -> int:
    # PyAV and Pillow (which read the input files' headers) are imported by the first command that needs them.
    from h3engine.request.resolved import new_media_facts, resolve_request

    out_path, save_tensors_path = _checked_outputs(args.out, args.save_tensors)
    _check_utf8_flag("--checkpoint", args.checkpoint)
    request = from_dict(_request_payload(args))
    # The rules no checkpoint decides, each input file probed once (PyAV and Pillow read the headers): a mistake in
    # the request, its files, the output flags or the dtype is refused before torch is imported.
    media = new_media_facts()
    resolve_request(request, None, media)
    if args.turbo:
        request = _with_turbo(args, request)
        resolve_request(request, None, media)  # the steps, shifts and rungs it set
    options = EngineOptions.from_args(args)
    check_dtype(options.dtype)

    # Imported here: it needs torch (GPU counts), which `--help` and the checks above never pay for. Without the
    # cyclic collector, which would walk the millions of long-lived objects the imports make again and again (0.4 to
    # 0.5 s of CPU of a 6 s run on the tiny checkpoint).
    collecting = gc.isenabled()
    gc.disable()
    try:
        from h3engine.checkpoint.facts import CheckpointFacts
        from h3engine.runtime.supervision import StallPolicy, checked_stall_timeout
        from h3engine.runtime.workers import rank_devices
    finally:
        if collecting:
            gc.enable()

    devices = rank_devices(args.device, args.world_size, args.gpus, args.devices)
    stall = StallPolicy(checked_stall_timeout(args.stall_timeout))
    layout = check_engine_options(options, len(devices))
    device = resolve_device(devices[0]) if len(devices) == 1 and not layout.split else None
    if options.fp8_linear and device is not None:
        check_fp8_device(device)
    # The checkpoint's own rules, from its headers (the engine and its front decide with the same function and
    # facts); the models load after this.
    facts = CheckpointFacts.from_layout(detect_layout(args.checkpoint))
    request = _checkpoint_steps(facts, request, explicit=args.steps is not None)
    resolved = resolve_request(request, facts, media)
    for warning in resolved.warnings:
        progress.warning(warning)
    with capturing_generation(args, request, on_workers=device is None) as capture:
        if device is not None:
            return _generate_in_process(
                args.checkpoint, options, resolved, device, out_path, save_tensors_path, progress
            )
        return _generate_on_workers(
            args.checkpoint,
            options,
            request,
            devices,
            layout,
            out_path,
            save_tensors_path,
            progress,
            stall,
            capture,
        )


def _make_checkpoint(args: argparse.Namespace) -> int:
    """`make-tiny-checkpoint` / `make-placeholder-checkpoint`: a folder that is not empty is refused before the
    writer (and torch) is imported."""
    try:
        require_empty_folder(Path(args.folder))
        if args.command == "make-tiny-checkpoint":
            from h3engine.checkpoint.tiny import make_tiny_checkpoint

            dmd_steps = parse_dmd_steps(args.dmd_steps)
            try:
                print(
                    make_tiny_checkpoint(args.folder, seed=args.seed, layout=args.layout, dmd_steps=dmd_steps)
                )
            except ValueError as error:  # the rungs themselves (only "dmd_steps: ..." can reach here)
                raise RequestError("--dmd-steps", str(error).removeprefix("dmd_steps: ")) from None
        else:
            from h3engine.checkpoint.placeholder import make_placeholder_checkpoint, parse_components

            try:
                real_bytes = parse_components(args.real_bytes)
            except ValueError as error:
                raise RequestError("--real-bytes", str(error)) from None
            partitions = [name.strip() for name in args.partitions.split(",") if name.strip()]
            try:
                folder = make_placeholder_checkpoint(
                    args.folder,
                    seed=args.seed,
                    tiny=args.tiny,
                    real_bytes=real_bytes,
                    weights=args.weights,
                    partitions=partitions,
                )
            except ValueError as error:
                raise RequestError("--partitions", str(error)) from None
            print(folder)
    except FileExistsError:
        raise RequestError("folder", f"{args.folder} is not empty") from None
    return 0


def _with_turbo(args: argparse.Namespace, request: GenerationRequest) -> GenerationRequest:
    """`--turbo`: the preset's steps, flow shifts and rungs (h3engine.engine.lora.library), except where a flag set one."""
    from h3engine.engine.lora.library import file_turbo, turbo_settings

    if not request.loras:
        raise RequestError("--turbo", "needs a --lora (the preset is for step-distilled adapters)")
    turbo = turbo_settings([file_turbo(lora.path) for lora in request.loras], request.recipe)
    rungs = request.rungs if args.rungs is not None else turbo.rungs
    preset = {
        "rungs": rungs,
        "steps": turbo.steps if args.steps is None and args.rungs is None else request.steps,
        "flow_shift": turbo.flow_shift if args.flow_shift is None else request.flow_shift,
        "audio_flow_shift": turbo.audio_flow_shift
        if args.audio_flow_shift is None
        else request.audio_flow_shift,
    }
    return replace(request, **preset)


def _check_utf8_flag(flag: str, value: str) -> None:
    """A path Python decoded from bytes that are not UTF-8 opens, but the sidecar that records it (and the MP4 muxer)
    cannot take it; refuse it before any work."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            flag,
            f"must be valid UTF-8 text; character {error.start} of the path is {value[error.start]!r}, "
            "a byte that is not UTF-8",
        ) from None


def _checked_outputs(out: str, save_tensors: str | None) -> tuple[Path, Path | None]:
    """`--out` and `--save-tensors` as paths, checked before any work: nothing is written until the end, so a path
    that cannot be written would otherwise fail after the whole generation."""
    from h3engine.media.outputs import OutputFiles

    _check_utf8_flag("--out", out)
    if save_tensors is not None:
        _check_utf8_flag("--save-tensors", save_tensors)
    if Path(out).suffix.lower() != ".mp4":
        raise RequestError("--out", f"the output must be an .mp4 path, got '{out}'")
    files = OutputFiles.beside(out, save_tensors)
    problem = files.problem()
    if problem is not None:
        role, message = problem
        raise RequestError("--out" if role == "video" else "--save-tensors", message)
    return files.video, files.tensors


def _checkpoint_steps(
    facts: CheckpointFacts, request: GenerationRequest, explicit: bool
) -> GenerationRequest:
    """The request with a step-distilled checkpoint's own step count where `--steps` was left out (the checker
    refuses an explicit other count)."""
    from h3engine.request.resolved import effective_rungs

    rungs = effective_rungs(request.rungs, facts.dmd_steps.get(request.task))
    if rungs is not None and not explicit:
        request = replace(request, steps=distilled_step_count(rungs, request.recipe))
    return request


def _generate_in_process(
    checkpoint: str,
    options: EngineOptions,
    resolved: ResolvedRequest,
    device: torch.device,
    out_path: Path,
    save_tensors_path: Path | None,
    progress: Progress,
) -> int:
    engine = load_engine(checkpoint, device, options, on_load=progress.load_event)
    progress.memory_plan(engine.placement.plan_lines())
    # The engine's own check (its facts, its memory plan) on the files' facts already probed.
    resolved = engine.resolve(resolved.request, resolved.media)
    request = resolved.request
    progress.prepare(request.task, request.steps)
    written = engine.generate_to_file(
        resolved,
        out_path,
        save_tensors_path=save_tensors_path,
        on_step=lambda event: progress.step(event.step, event.total, event.elapsed_s),
    )
    timings = json.loads(written.sidecar.read_text(encoding="utf-8"))["timings_s"]
    progress.finished(written.video, written.sidecar, timings)
    return 0


def _generate_on_workers(
    checkpoint: str,
    options: EngineOptions,
    request: GenerationRequest,
    devices: tuple[str, ...],
    layout: RuntimeLayout,
    out_path: Path,
    save_tensors_path: Path | None,
    progress: Progress,
    stall: StallPolicy,
    capture: Any = None,
) -> int:
    """The app's path: a worker group behind an engine front, one job, its messages shown as they come (the group
    loads in its own processes: its loading is one component, `worker_group`)."""
    from h3engine.runtime.front import EngineFront
    from h3engine.runtime.split import start_replica

    progress.group_loading(devices, layout.describe())
    started = time.perf_counter()
    replica = start_replica(checkpoint, devices, layout, options, stall)
    progress.group_loaded(devices, layout.describe(), time.perf_counter() - started)
    front = EngineFront([replica], out_path.parent)
    try:
        if request.remix is not None and request.remix.windows > 1:
            # Chained windows: each one a job of the group (worker or split stage groups), window k extending window
            # k-1's MP4.
            from h3engine.engine.conditioning.remix import chain_windows

            def window_job(single: GenerationRequest, video: Path, tensors: Path | None, *_: object) -> Any:
                last_window = video == out_path  # the one a capture records (one request's boundaries)
                finished = _run_job(front, single, video, tensors, progress, capture if last_window else None)
                return SimpleNamespace(video=Path(finished.video_path), finished=finished)

            outputs = SimpleNamespace(video=out_path, tensors=save_tensors_path)
            last = chain_windows(window_job, request, outputs, None, None)
            finished = last.finished
        else:
            finished = _run_job(front, request, out_path, save_tensors_path, progress, capture)
        progress.finished(Path(finished.video_path), Path(finished.sidecar_path), finished.timings_s)
        return 0
    finally:
        front.shutdown()


def _run_job(
    front: Any,
    request: GenerationRequest,
    out_path: Path,
    save_tensors_path: Path | None,
    progress: Progress,
    capture: Any = None,
) -> Any:
    """One job through the front, its steps shown as they come (`capture`: a CaptureSpec its rank 0 records into):
    its JobFinished (JobRefused / EngineFailed else)."""
    from h3engine.runtime.messages import JobFailed, JobFinished, StepProgress

    progress.prepare(request.task, request.steps)
    handle = front.submit(request, out_path, save_tensors_path, capture)
    while True:
        event = handle.next_event(timeout=1.0)
        if isinstance(event, StepProgress):
            progress.step(event.step, event.total, event.elapsed_s, event.eta_s)
        elif isinstance(event, JobFinished):
            return event
        elif isinstance(event, JobFailed):
            if event.kind == "request":
                raise JobRefused(event.message)
            raise EngineFailed(event.message)


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
    progress: Progress | None = None
    try:
        if args.command in ("make-tiny-checkpoint", "make-placeholder-checkpoint"):
            return _make_checkpoint(args)
        if args.command == "plan-memory":
            return run_plan_memory(args)
        if args.command == "convert":
            return run_convert(args)
        if args.command in VALIDATION_COMMANDS:
            return run_validation(args)
        if args.quiet and args.progress != "auto":
            raise RequestError(
                "--quiet", f"shows no progress, so it cannot go with --progress {args.progress}"
            )
        progress = make_progress(args.progress, args.quiet)
        try:
            return _generate(args, progress)
        finally:
            progress.close()
    except (H3Error, JobRefused) as error:
        code, line = 2, f"error: {error}"
    except EngineFailed as error:
        code, line = 1, f"error: {error}"
    except KeyboardInterrupt:
        code, line = 130, "interrupted"
    except Terminated:
        code, line = EXIT_TERMINATED, "terminated"
    except Exception as error:  # the last line of defence: one line, no traceback unless asked
        if args.debug:
            traceback.print_exc()
        code, line = 1, f"internal error: {type(error).__name__}: {error}"
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    if progress is not None:
        progress.failed(line, code)
    print(line, file=sys.stderr)
    return code
