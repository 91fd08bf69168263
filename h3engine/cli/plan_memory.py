"""`python -m h3engine plan-memory`: a checkpoint's memory plan under a budget, before anything loads.

    python -m h3engine plan-memory --checkpoint DIR --gpu-memory 24 [--host-memory 120] [--task t2va|fl2va|ref2va]
        [--duration S] [--aspect-ratio R] [--short-edge E] [--weights bf16|fp8] [--memory-profile auto|...]
        [--references image:4:1,video:5,audio:5] [--prompt-tokens N] [--json]

Reads configs and headers only; prints, for the design request the flags describe (what they leave open takes the
worst case the request limits allow), each component's placement and bytes, the peak GPU memory per phase and in
all, the pinned host memory, and the bytes moved per DiT step and per request; `--json`: one object instead. Also
the plan's log lines (`summary_lines`). Exit 0 when the plan fits; 2 with one line on stderr for a bad flag (checked
before torch loads), a checkpoint problem, a GPU budget below the request's smallest plan (nothing on stdout), or a
plan that does not fit (printed first).

Danger: the peaks rest on estimated activations (h3engine.memory.working); they are not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from h3engine.checkpoint.layout import TASKS
from h3engine.engine.options import add_component_file_flags, component_file_options, engine_layout
from h3engine.errors import RequestError
from h3engine.memory.budget import GPU_MEMORY_ENV, parse_gib, resolve_budget
from h3engine.memory.plan import plan_for_shape
from h3engine.memory.report import gpu_budget_words, plan_json, plan_table
from h3engine.memory.shapes import ReferenceSpec, request_shape
from h3engine.memory.types import GIB, MEMORY_PROFILES, WEIGHT_FORMATS
from h3engine.request.geometry import MAX_ASPECT_RATIO, MIN_ASPECT_RATIO, parse_aspect_ratio
from h3engine.request.limits import (
    MAX_CLIP_SECONDS,
    MAX_DURATION_SECONDS,
    MAX_PROMPT_TOKENS,
    MAX_REFERENCES,
    MAX_SHORT_EDGE,
    MIN_DURATION_SECONDS,
)


def add_plan_memory_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Declare the `plan-memory` subcommand on the CLI's subparsers."""
    plan = commands.add_parser(
        "plan-memory",
        help="show where each model would live under a GPU / host memory budget (reads headers only)",
    )
    plan.add_argument("--checkpoint", required=True, help="checkpoint folder (native or diffusers layout)")
    add_component_file_flags(plan)
    plan.add_argument(
        "--gpu-memory",
        default=None,
        metavar="GIB",
        help=f"GPU budget in GiB (env {GPU_MEMORY_ENV}; default: free)",
    )
    plan.add_argument(
        "--host-memory",
        default=None,
        metavar="GIB",
        help="host budget in GiB (env H3_HOST_MEMORY; default: free)",
    )
    plan.add_argument("--task", choices=TASKS, default="t2va")
    plan.add_argument("--duration", type=float, default=5.0, help="seconds, 4 to 15 (default 5)")
    plan.add_argument("--aspect-ratio", default="16:9", help="W:H (default 16:9)")
    plan.add_argument("--short-edge", type=int, default=None, help="canvas short edge (checkpoint default)")
    plan.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16")
    plan.add_argument("--memory-profile", choices=MEMORY_PROFILES, default="auto")
    plan.add_argument(
        "--references",
        default=None,
        metavar="KIND[:VALUE],...",
        help="ref2va: the references, e.g. image:4:1,video:5,audio:3 (image: W:H, default 16:9; video / audio: "
        "seconds, default the duration); default: the worst case the request limits allow",
    )
    plan.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt tokens (default: the bound, 8,192)"
    )
    plan.add_argument(
        "--adaln-cache",
        default=None,
        metavar="DIR|off",
        help="AdaLN tables kept on disk (the default, in the cache folder): the 13 B AdaLN parameters then wait in the "
        "files and are read only for a schedule the cache lacks; off: they wait in host memory",
    )
    plan.add_argument(
        "--disk-read-gbps",
        default=None,
        metavar="GBPS",
        help="the checkpoint disk's read rate in GB/s (default: measured once, past the page cache, and kept)",
    )
    plan.add_argument(
        "--activation-chunks",
        default=None,
        metavar="auto|off|N",
        help="the DiT's activation chunks (default auto)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Flags (no torch)


def _check_flags(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """RequestError naming the flag for a value the planner cannot use; returns the parsed GiB values."""
    gpu = None if args.gpu_memory is None else parse_gib(args.gpu_memory, "--gpu-memory")
    host = None if args.host_memory is None else parse_gib(args.host_memory, "--host-memory")
    if not MIN_DURATION_SECONDS <= args.duration <= MAX_DURATION_SECONDS:
        raise RequestError(
            "--duration",
            f"must be within [{MIN_DURATION_SECONDS:g}, {MAX_DURATION_SECONDS:g}] s, got {args.duration:g}",
        )
    try:
        width, height = parse_aspect_ratio(args.aspect_ratio)
    except ValueError as error:
        raise RequestError("--aspect-ratio", str(error)) from None
    if not MIN_ASPECT_RATIO <= width / height <= MAX_ASPECT_RATIO:
        raise RequestError("--aspect-ratio", f"must be within 1:4 to 4:1, got {args.aspect_ratio}")
    if args.short_edge is not None and not 1 <= args.short_edge <= MAX_SHORT_EDGE:
        raise RequestError("--short-edge", f"must be within [1, {MAX_SHORT_EDGE}], got {args.short_edge}")
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= MAX_PROMPT_TOKENS:
        raise RequestError(
            "--prompt-tokens", f"must be within [1, {MAX_PROMPT_TOKENS:,}], got {args.prompt_tokens}"
        )
    if args.references is not None and args.task != "ref2va":
        raise RequestError("--references", f"only for --task ref2va, got --task {args.task}")
    return gpu, host


def parse_references(text: str) -> tuple[Any, ...]:
    """ "image:4:1,video:5,audio" -> ReferenceSpecs (RequestError naming --references)."""
    references = []
    for entry in (part.strip() for part in text.split(",")):
        kind, _, value = entry.partition(":")
        try:
            if kind == "image":
                aspect = parse_aspect_ratio(value) if value else (16.0, 9.0)
                references.append(ReferenceSpec("image", aspect=aspect))
            elif kind in ("video", "audio"):
                seconds = float(value) if value else None
                if seconds is not None and not 0 < seconds <= MAX_CLIP_SECONDS:
                    raise ValueError(f"seconds must be within (0, {MAX_CLIP_SECONDS:g}]")
                references.append(ReferenceSpec(kind, seconds=seconds))
            else:
                raise ValueError("a reference is image[:W:H], video[:SECONDS] or audio[:SECONDS]")
        except ValueError as error:
            raise RequestError("--references", f"{entry!r}: {error}") from None
    if not references or len(references) > MAX_REFERENCES:
        raise RequestError("--references", f"1 to {MAX_REFERENCES} references, got {len(references)}")
    return tuple(references)


# ----------------------------------------------------------------------------------------------------------------
# The run


def run_plan_memory(args: argparse.Namespace) -> int:
    """Print the plan (or its JSON); RequestError / CheckpointError (exit 2 by the CLI) for what cannot be planned."""
    gpu_flag, host_flag = _check_flags(args)
    references = parse_references(args.references) if args.references is not None else None
    # Torch from here on. A GPU budget given (flag or environment) plans for a GPU on any machine.
    from h3engine.memory.disk import default_cache_folder
    from h3engine.memory.engine_plan import MemoryRequest, plan_context
    from h3engine.memory.sizes import checkpoint_sizes

    explicit_gpu = gpu_flag is not None or os.environ.get(GPU_MEMORY_ENV, "").strip()
    device = "cuda" if explicit_gpu else _default_device()
    budget = resolve_budget(device, args.gpu_memory, args.host_memory)
    layout = engine_layout(args.checkpoint, component_file_options(args))
    sizes = checkpoint_sizes(layout, weights=args.weights)
    try:
        shape = request_shape(
            sizes,
            args.task,
            duration_seconds=args.duration,
            aspect_ratio=args.aspect_ratio,
            short_edge=args.short_edge,
            text_tokens=args.prompt_tokens,
            references=references,
        )
    except ValueError as error:
        raise RequestError("--short-edge / --aspect-ratio", str(error)) from None
    device_type = "cpu" if device == "cpu" else "cuda"
    memory = MemoryRequest(
        args.memory_profile,
        weights=args.weights,
        adaln_cache=args.adaln_cache,
        disk_read_gbps=args.disk_read_gbps,
        activation_chunks=args.activation_chunks,
    ).checked()
    context = plan_context(sizes.root, memory, default_cache_folder(), device_type)
    plan = plan_for_shape(sizes, budget, shape, args.memory_profile, device_type, context)
    if budget.gpu_bytes is not None and device_type != "cpu" and budget.gpu_bytes < plan.minimum_gpu_bytes:
        raise RequestError(
            "--gpu-memory",
            f"{gpu_budget_words(budget).removeprefix('--gpu-memory ')} cannot hold even the smallest plan for this request ({shape.label}): it "
            f"needs {plan.minimum_gpu_bytes / GIB:.1f} GiB; raise --gpu-memory, or plan a shorter or smaller request "
            f"(--duration, --short-edge{', --references' if args.task == 'ref2va' else ''})",
        )
    print(json.dumps(plan_json(plan), indent=2) if args.json else "\n".join(plan_table(plan)))
    sys.stdout.flush()
    if not plan.gpu_fits:
        raise RequestError(
            "--memory-profile",
            f"{plan.profile} peaks at {plan.peak_gpu_bytes / GIB:.1f} GiB, over "
            f"{gpu_budget_words(budget)}; use --memory-profile auto (needs at least "
            f"{plan.minimum_gpu_bytes / GIB:.1f} GiB)",
        )
    if not plan.host_fits:
        raise RequestError(
            "--host-memory",
            f"the plan pins at least {plan.minimum_host_bytes / GIB:.1f} GiB of host memory even with "
            f"every home mapped, over the {budget.host_bytes / GIB:.1f} GiB budget ({budget.host_source}); raise "
            "--host-memory",
        )
    return 0


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"
