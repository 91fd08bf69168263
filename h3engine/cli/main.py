"""Command line: `generate ...`, `make-tiny-checkpoint DIR`, `make-placeholder-checkpoint DIR`, `plan-memory ...`.

Task inputs: `--first-frame` / `--last-frame` (FL2VA) and repeatable `--ref KIND:PATH[@START_SECONDS]` (Ref2VA, in
prompt label order); without `--task` the inputs pick it. Adapters: repeatable `--lora PATH[:STRENGTH]`, on the DiT
`--lora-target` names (default: as diffusers); `--turbo` / `--pdd` set the steps, shifts and `--rungs` they run with.
Devices: `--device` (default cuda when present) runs the engine here; `--gpus N`, `--devices 0,1,...` or
`--world-size N` (`--device cpu`: CPU ranks over gloo) run a resident worker group (h3engine.runtime.workers). The
engine flags (layout, `--dtype`, the memory budget, `--fp8-linear`) are the app's too (h3engine.engine.options).

Checks: the output flags, the request and its files (headers) and `--dtype` before torch is imported; the device,
memory and layout flags; the request on the checkpoint's facts as the engine decides (h3engine.engine.resolved;
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
from typing import TYPE_CHECKING, Any

from h3engine.checkpoint.layout import require_empty_folder
from h3engine.cli.convert import run_convert
from h3engine.cli.parser import build_parser
from h3engine.cli.plan_memory import run_plan_memory
from h3engine.cli.progress import Progress, make_progress
from h3engine.cli.remix import remix_payload
from h3engine.cli.specs import parse_dmd_steps, parse_lora_spec, parse_reference_spec
from h3engine.cli.validation.command import (
    VALIDATION_COMMANDS,
    capturing_generation,
    run_validation,
)
from h3engine.engine.options import (
    EngineOptions,
    check_dtype,
    check_engine_options,
    check_fp8_device,
    engine_layout,
    load_engine,
    resolve_device,
)
from h3engine.errors import H3Error, RequestError
from h3engine.memory.disk import default_cache_folder, keep_compile_caches_in
from h3engine.request.model import LORA_TARGET_OF_TASK, GenerationRequest
from h3engine.request.shapes import from_dict

if TYPE_CHECKING:  # torch is imported only once a generation really starts
    import torch

    from h3engine.engine.lora.library import TurboSettings
    from h3engine.engine.resolved import ResolvedRequest
    from h3engine.models.parallel.groups import RuntimeLayout
    from h3engine.runtime.supervision import StallPolicy

EXIT_TERMINATED = 143


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so that `finally` blocks stop the workers (like Ctrl-C)."""


class EngineFailed(Exception):
    """A worker group's job failed inside the engine (exit code 1; its message is one line)."""


class JobRefused(Exception):
    """A worker group refused the job's request or an input file when it ran (exit code 2; its message is one
    line naming the field)."""


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
    if args.pdd is not None:
        # Its interval heads are trained for one DiT: the task's, unless --lora-target names another.
        target = args.lora_target or LORA_TARGET_OF_TASK[payload["task"]]
        payload["loras"].append({"path": args.pdd, "strength": 1.0, "target": target})
    if args.lora_target is not None and not args.lora and args.pdd is None:
        raise RequestError("--lora-target", "given without --lora (it sets the target of each --lora)")
    optional = {
        "rungs": parse_dmd_steps(args.rungs, "--rungs"),
        "steps": args.steps,
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
    from h3engine.engine.resolved import new_media_facts, resolve_request
    from h3engine.request.validate import validate

    out_path, save_tensors_path = _checked_outputs(args.out, args.save_tensors)
    _check_utf8_flag("--checkpoint", args.checkpoint)
    request = from_dict(_request_payload(args))
    # The request's own rules, each input file probed once (PyAV and Pillow read the headers): a mistake in the
    # request, its files, the output flags or the dtype is refused before torch is imported. The one resolve below
    # decides on the checkpoint with the files' facts read here.
    media = new_media_facts()
    pdd = None if args.pdd is None else _pdd_preset(args.pdd)
    validate(request, media, canvas_multiple=1)
    if pdd is not None:
        request = _with_preset(args, request, [pdd])
    elif args.turbo:
        request = _with_turbo(args, request)
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
    facts = CheckpointFacts.from_layout(engine_layout(args.checkpoint, options))
    resolved = resolve_request(request, facts, media)
    for warning in resolved.warnings:
        progress.warning(warning)
    with capturing_generation(args, resolved.request, on_workers=device is None) as capture:
        if device is not None:
            return _generate_in_process(
                args.checkpoint, options, resolved, device, out_path, save_tensors_path, progress
            )
        return _generate_on_workers(
            args.checkpoint,
            options,
            resolved,
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
            if "dit" in real_bytes and args.weights not in ("bf16", "fp8"):
                raise RequestError(
                    "--real-bytes",
                    f"the DiT files of --weights {args.weights} are holes; dit takes bf16 or fp8",
                )
            partitions = [name.strip() for name in args.partitions.split(",") if name.strip()]
            try:
                folder = make_placeholder_checkpoint(
                    args.folder,
                    seed=args.seed,
                    tiny=args.tiny,
                    real_bytes=real_bytes,
                    weights=args.weights,
                    partitions=partitions,
                    pruned_adaln=args.pruned_adaln,
                )
            except ValueError as error:
                raise RequestError("--partitions", str(error)) from None
            print(folder)
    except FileExistsError:
        raise RequestError("folder", f"{args.folder} is not empty") from None
    return 0


def _with_turbo(args: argparse.Namespace, request: GenerationRequest) -> GenerationRequest:
    """`--turbo`: the preset's steps, flow shifts and rungs (h3engine.engine.lora.library), except where a flag set one."""
    from h3engine.engine.lora.library import file_turbo

    if not request.loras:
        raise RequestError("--turbo", "needs a --lora (the preset is for step-distilled adapters)")
    return _with_preset(args, request, [file_turbo(lora.path) for lora in request.loras])


def _pdd_preset(path: str) -> TurboSettings:
    """`--pdd`'s preset: the file's own (h3engine.engine.lora.library.pdd_settings); RequestError naming --pdd for a
    file that cannot be read or is not a PDD adapter."""
    from h3engine.engine.lora.library import file_turbo

    try:
        preset = file_turbo(path)
    except RequestError as error:
        raise RequestError("--pdd", error.problem) from None
    if preset is None or not preset.pdd:
        raise RequestError(
            "--pdd",
            f"{Path(path).name!r} is not a PDD adapter: it has no 'proj_out.weight' interval heads (alibaba-pai's "
            "MiniMax-H3-*-Acc-8Step files); give an ordinary or Turbo adapter with --lora",
        )
    return preset


def _with_preset(
    args: argparse.Namespace, request: GenerationRequest, declared: Sequence[TurboSettings | None]
) -> GenerationRequest:
    """The preset of the `declared` settings (h3engine.engine.lora.library.turbo_settings: a PDD adapter's, or the
    Turbo preset of the request's adapters): its steps, flow shifts and rungs, except where a flag set one."""
    from h3engine.engine.lora.library import turbo_settings

    turbo = turbo_settings(declared, request.recipe)
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
    # Resolved before the engine loaded: the engine adds its memory plan's check.
    progress.prepare(resolved.request.task, resolved.request.steps)
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
    resolved: ResolvedRequest,
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
        # A chained extend runs as one job a window (the front chains them).
        finished = _run_job(front, resolved, out_path, save_tensors_path, progress, capture)
        progress.finished(Path(finished.video_path), Path(finished.sidecar_path), finished.timings_s)
        return 0
    finally:
        front.shutdown()


def _run_job(
    front: Any,
    resolved: ResolvedRequest,
    out_path: Path,
    save_tensors_path: Path | None,
    progress: Progress,
    capture: Any = None,
) -> Any:
    """One job through the front, its steps shown as they come (`capture`: a CaptureSpec its rank 0 records into):
    its JobFinished (JobRefused / EngineFailed else)."""
    from h3engine.runtime.messages import JobFailed, JobFinished, StepProgress

    progress.prepare(resolved.request.task, resolved.request.steps)
    handle = front.submit(resolved, out_path, save_tensors_path, capture)
    while True:
        event = handle.next_event(timeout=1.0)
        if isinstance(event, StepProgress):
            progress.step(event.step, event.total, event.elapsed_s, event.eta_s)
        elif isinstance(event, JobFinished):
            return event
        elif isinstance(event, JobFailed):
            if event.error is not None:  # the whole error: on the CLI the paths are the user's own
                raise JobRefused(str(event.error))
            raise EngineFailed(event.message)


def _raise_terminated(signal_number: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    keep_compile_caches_in(default_cache_folder())
    try:
        args = build_parser().parse_args(argv)
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
