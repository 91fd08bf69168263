"""The command line's arguments: `build_parser()`, argparse with the CLI's one-line errors (`CliParser`).

Each command's flags are declared here (the engine's in h3engine.engine.options, shared with app.py; remix's,
plan-memory's, convert's and the validation kit's beside their commands); `h3engine.cli.main` runs them.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from h3engine.checkpoint.layout import GGUF_KINDS
from h3engine.cli.convert import add_convert_parser
from h3engine.cli.plan_memory import add_plan_memory_parser
from h3engine.cli.progress import PROGRESS_MODES
from h3engine.cli.remix import add_remix_flags
from h3engine.cli.validation.command import (
    add_capture_flags,
    add_validation_parsers,
)
from h3engine.engine.options import (
    add_engine_flags,
)
from h3engine.media.formats import accepted_text
from h3engine.request.model import LORA_TARGETS, MAX_LORA_STRENGTH, MAX_LORAS


class CliParser(argparse.ArgumentParser):
    """argparse with its errors in the CLI's one-line form (`error: ...`, exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line: `generate`, the checkpoint makers, `plan-memory`, `convert` and the validation kit."""
    parser = CliParser(prog="python -m h3engine", description="MiniMax H3 audio-video generation")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of internal errors")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate one MP4 (video + stereo audio)")
    _add_request_flags(generate)
    _add_run_flags(generate)
    _add_checkpoint_makers(commands)
    add_plan_memory_parser(commands)
    add_convert_parser(commands)
    add_validation_parsers(commands)
    return parser


def _add_request_flags(generate: argparse.ArgumentParser) -> None:
    """`generate`'s request: the task, prompt, inputs, canvas and sampling settings."""
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
    _add_preset_flags(generate)
    generate.add_argument("--recipe", default="sglang", help="sglang (default) or diffusers")
    generate.add_argument(
        "--cache",
        default="off",
        help="step caching for full-step runs: off (default, every block of every step), high (the peers' "
        "conservative MiniMax-H3 setting) or fast (more aggressive); lossy, refused with --rungs / --turbo",
    )


def _add_preset_flags(generate: argparse.ArgumentParser) -> None:
    """`generate`'s presets for few-step adapters: Turbo and PDD."""
    generate.add_argument(
        "--turbo",
        action="store_true",
        help="the Turbo preset for step-distilled adapters: steps, flow shifts and rungs from the first --lora "
        "whose metadata declares them, else 8 steps with shifts 6 / 3; flags given explicitly win",
    )
    generate.add_argument(
        "--pdd",
        default=None,
        metavar="PATH",
        help="a PDD acceleration adapter (alibaba-pai's MiniMax-H3-*-Acc-8Step.safetensors) with its preset: the "
        "adapter on the task's DiT, its backbone LoRA and interval heads, 8 Euler steps at flow shifts 12 / 3; "
        "flags given explicitly win, a schedule off its grid is refused",
    )


def _add_run_flags(generate: argparse.ArgumentParser) -> None:
    """`generate`'s run: the devices and ranks, the engine, capture, outputs and progress."""
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


def _add_checkpoint_makers(commands: Any) -> None:
    """`make-tiny-checkpoint` and `make-placeholder-checkpoint`."""
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
        choices=("bf16", "fp8", *GGUF_KINDS, "int8", "fp8_scaled", "nvfp4"),
        default="bf16",
        help="fp8: the large linears as a converted checkpoint stores them (python -m h3engine convert --weights fp8); "
        "a GGUF type: each DiT a GGUF file of that type, its data a hole of zeros (planning and layout checks); "
        "int8 / fp8_scaled / nvfp4: each DiT a ComfyUI INT8 ConvRot / FP8 scaled / NVFP4 single safetensors file, "
        "likewise a hole",
    )
    placeholder.add_argument(
        "--pruned-adaln",
        action="store_true",
        help="the DiTs in the community's pruned form (an adaln_t_table of 1025 x 8 and 8-wide AdaLN projections)",
    )
    placeholder.add_argument(
        "--partitions",
        default="fl2va,ref2va",
        metavar="PARTITIONS",
        help="the partitions to write, e.g. fl2va (default both)",
    )
