"""The engine half of both front-ends' command lines (app.py and h3engine.cli), declared once.

`add_engine_flags` declares the flags: the worker group's layout (`--dit-sp`, `--dit-tp`, `--encoder-tp`,
`--vae-ranks`; left out: the profile of the group's size, h3engine.models.parallel.groups; `--stage-layout` colocated or
split, with `--encoder-devices` / `--vae-devices`), `--dtype`, the memory budget (`--memory-profile`, `--gpu-memory`,
`--host-memory`, `--weights`: h3engine.memory) and `--fp8-linear`; `EngineOptions.from_args` reads them back.
`check_dtype` needs no torch;
`check_engine_options` checks the rest for an engine of a given number of ranks and returns its worker-group
layout; `resolve_device` and `check_fp8_device` check the device of an engine in this process; `load_engine` builds
that engine. Which devices each engine runs on is the front-end's own flag (the CLI runs one engine, the app one
per device or per group of devices; h3engine.runtime.workers turns those flags into rank devices), and so is
starting a worker group (`ProcessReplica` with the layout). Every error is a RequestError whose message starts with
the flag. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from h3engine.errors import RequestError
from h3engine.memory.disk import default_cache_folder

__all__ = [
    "EngineOptions",
    "add_engine_flags",
    "cannot_write",
    "default_cache_folder",
    "load_engine",
]

if TYPE_CHECKING:
    import torch

    from h3engine.checkpoint.layout import CheckpointLayout
    from h3engine.engine.engine import Engine
    from h3engine.engine.model_store import LoadEvent
    from h3engine.models.parallel.groups import RuntimeLayout

# --dtype name -> the torch dtype's attribute name (kept as text so that the name is checked without torch).
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# FP8 GEMMs (`torch._scaled_mm`) exist from compute capability 8.9 (Ada) on; elsewhere h3engine.models.quantization emulates
# them in fp32, which is slower than bf16 and only adds quantization noise.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class EngineOptions:
    """How each engine runs; None: the default (the layout profile of the group's size, bfloat16)."""

    dit_sp: int | None = None
    dit_tp: int | None = None
    encoder_tp: int | None = None
    vae_ranks: int | None = None
    dtype: str | None = None
    memory_profile: str = "auto"
    gpu_memory: str | None = (
        None  # GiB per GPU, as given (None: H3_GPU_MEMORY, else the free memory less a margin)
    )
    host_memory: str | None = (
        None  # GiB of host memory per engine rank (None: H3_HOST_MEMORY, else MemAvailable less a margin)
    )
    weights: str = "bf16"  # how the large linears' weights are stored: bf16 (released) or fp8
    # Where AdaLN tables are kept between runs: a folder, "off", or None (H3_ADALN_CACHE, else the cache folder's).
    adaln_cache: str | None = None
    disk_read_gbps: str | None = (
        None  # the checkpoint disk's read rate in GB/s (None: measured once and kept)
    )
    activation_chunks: str | None = None  # the DiT's activation chunks: auto (None), off or a count
    fp8_linear: bool = False
    stage_layout: str = "colocated"
    encoder_devices: str | None = None  # split layout: the text-encoder group's GPUs (e.g. "4,5")
    vae_devices: str | None = None  # split layout: the VAE group's GPUs
    # --dit values as given: [PARTITION=]FILE, a single DiT file replacing a partition's weights
    dit: tuple[str, ...] = ()
    # Single files replacing the shared components' weights (every partition's): --video-vae, --audio-vae, --text-encoder
    video_vae: str | None = None
    audio_vae: str | None = None
    text_encoder: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options of a command line parsed with `add_engine_flags`."""
        values = {option.name: getattr(args, option.name) for option in fields(cls)}
        return cls(**{**values, "dit": tuple(values["dit"] or ())})


def add_engine_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The engine flags, with their help and defaults; `environ` (the app's) supplies H3_MEMORY_PROFILE,
    H3_GPU_MEMORY and H3_HOST_MEMORY (without it, the budgets read those two when the engine plans)."""
    _add_layout_flags(parser, environ)
    _add_precision_and_memory_flags(parser, environ)
    add_component_file_flags(parser)


def _add_layout_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None) -> None:
    """The worker group's parallel degrees and the stage layout with its devices (a group of their own)."""
    layout = parser.add_argument_group("worker group layout (default: the profile of the group's size)")
    layout.add_argument("--dit-sp", type=int, default=None, help="DiT Ulysses sequence-parallel degree")
    layout.add_argument("--dit-tp", type=int, default=None, help="DiT tensor-parallel degree")
    layout.add_argument("--encoder-tp", type=int, default=None, help="text-encoder tensor-parallel degree")
    layout.add_argument("--vae-ranks", type=int, default=None, help="ranks sharing the video decode")
    environ_note = "" if environ is None else "; env H3_STAGE_LAYOUT"
    layout.add_argument(
        "--stage-layout",
        default=(environ or {}).get("H3_STAGE_LAYOUT") or "colocated",
        metavar="{colocated,split}",
        help="colocated (default): every rank holds a share of every model; split: the text encoder (--encoder-tp "
        "ranks), the DiT and the VAE (--vae-ranks ranks) run as three resident groups handing tensors over CUDA "
        f"IPC, so that consecutive requests overlap{environ_note}",
    )
    layout.add_argument(
        "--encoder-devices",
        default=None,
        help="split layout: the text encoder's GPUs, e.g. 4,5 (default: the first --encoder-tp of the DiT's)",
    )
    layout.add_argument(
        "--vae-devices",
        default=None,
        help="split layout: the VAE's GPUs, e.g. 6,7 (default: the first --vae-ranks of the DiT's)",
    )


def add_component_file_flags(parser: argparse.ArgumentParser) -> None:
    """`--dit [PARTITION=]FILE`, `--video-vae`, `--audio-vae`, `--text-encoder FILE`: community files replacing a
    partition's DiT weights or the shared components' (the engines, `plan-memory` and `check-checkpoint` take them;
    `component_file_options` reads them back)."""
    parser.add_argument(
        "--dit",
        action="append",
        default=None,
        metavar="[PARTITION=]FILE",
        help="a community DiT file that replaces the weights of the checkpoint's DiT: GGUF (F32, F16, BF16, Q8_0, "
        "Q6_K, Q5_K, Q5_0, Q4_K, Q4_0, Q3_K, Q2_K) or a ComfyUI single .safetensors file (bf16, fp16, FP8 scaled, "
        "INT8, INT8 ConvRot, mixed; exact or pruned AdaLN); its quantized layers stay quantized in memory and are "
        "dequantized on the GPU as they compute. Name the partition (fl2va or ref2va) when the checkpoint has both; "
        "repeat the flag for each",
    )
    for flag, component in (("--video-vae", "video VAE"), ("--audio-vae", "audio VAE")):
        parser.add_argument(
            flag,
            default=None,
            metavar="FILE",
            help=f"a ComfyUI single .safetensors {component} file (fp32, fp16, bf16; FP8 scaled, INT8, INT8 ConvRot "
            "dequantized at load) that replaces the checkpoint's, in every partition",
        )
    parser.add_argument(
        "--text-encoder",
        default=None,
        metavar="FILE",
        help="a Qwen3-VL text encoder file that replaces the checkpoint's, in every partition: a ComfyUI single "
        ".safetensors file (bf16, fp16, FP8 scaled, INT8, INT8 ConvRot) or a llama.cpp GGUF (F32, F16, BF16, Q8_0, "
        "Q6_K, Q5_K, Q5_0, Q4_K, Q4_0, Q3_K, Q2_K) with its mmproj GGUF beside it; its quantized linears stay so on "
        "one rank (dequantized at load under --encoder-tp)",
    )


def _add_precision_and_memory_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None
) -> None:
    """The compute dtype, the weight format, the memory profile and budgets, and the caches and rates they use."""
    parser.add_argument("--dtype", default=None, help="bfloat16 (released precision, default) or float32")
    memory_profile_help = (
        "auto (default): the plan that fits the GPU and host budgets fastest; resident: every model stays on the "
        "GPU; streamed: the DiT, text-encoder and video-decoder layers visit the GPU a few at a time from host memory; "
        "low-memory: models wait in host memory and each phase moves onto the GPU only the ones it runs"
    )
    parser.add_argument(
        "--memory-profile",
        default=(environ or {}).get("H3_MEMORY_PROFILE") or "auto",
        metavar="{auto,resident,streamed,low-memory}",
        help=memory_profile_help if environ is None else f"{memory_profile_help}; env H3_MEMORY_PROFILE",
    )
    parser.add_argument(
        "--gpu-memory",
        default=(environ or {}).get("H3_GPU_MEMORY"),
        metavar="GIB",
        help="GPU memory each engine rank may use, in GiB (default: env H3_GPU_MEMORY, else the GPU's free memory "
        "less 2 GiB); `python -m h3engine plan-memory` shows the plan a budget gives",
    )
    parser.add_argument(
        "--host-memory",
        default=(environ or {}).get("H3_HOST_MEMORY"),
        metavar="GIB",
        help="host memory each engine rank may pin, in GiB (default: env H3_HOST_MEMORY, else the available memory "
        "less 4 GiB); what does not fit is streamed from the memory-mapped checkpoint files (slower)",
    )
    parser.add_argument(
        "--weights",
        default="bf16",
        metavar="{bf16,fp8}",
        help="bf16 (default): the released weights; fp8: the large linears stored as e4m3 with per-row scales "
        "(half the host memory and PCIe bytes, not the released precision)",
    )
    parser.add_argument(
        "--adaln-cache",
        default=(environ or {}).get("H3_ADALN_CACHE"),
        metavar="DIR|off",
        help="where the DiT's AdaLN tables are kept between runs (exact; a repeated step schedule then reads none of "
        "the 13 B AdaLN parameters): a folder, or off (default: env H3_ADALN_CACHE, else adaln-tables in the cache "
        "folder, ~/.cache/h3engine or H3_CACHE_DIR)",
    )
    parser.add_argument(
        "--disk-read-gbps",
        default=(environ or {}).get("H3_DISK_READ_GBPS"),
        metavar="GBPS",
        help="the read rate of the checkpoint's disk in GB/s, which the memory plan weighs layers read from the files "
        "by (default: measured once per disk, past the page cache, and kept in the cache folder)",
    )
    parser.add_argument(
        "--activation-chunks",
        default=(environ or {}).get("H3_ACTIVATION_CHUNKS"),
        metavar="auto|off|N",
        help="compute the DiT's attention over head groups and its row-wise layers over row chunks, so that a "
        "768p / 5 s request's activations need ~2.7 GiB instead of ~5 (auto, the default: the memory plan decides; "
        "chunked results are equal to the unchunked ones within the rounding of GEMMs over fewer rows)",
    )
    parser.add_argument(
        "--fp8-linear",
        action="store_true",
        help="quantize the DiT blocks' linear layers to FP8 (faster on Hopper, not the released precision; one "
        "GPU per engine, no worker group)",
    )


def check_memory_options(options: EngineOptions) -> None:
    """The profile, the weight format and the budgets' numbers (their environment variables included)."""
    from h3engine.memory.budget import resolve_budget
    from h3engine.memory.placement import check_memory_profile, check_weights

    check_memory_profile(options.memory_profile)
    check_weights(options.weights)
    resolve_budget("cpu", options.gpu_memory, options.host_memory)
    check_adaln_cache(options.adaln_cache)
    from h3engine.memory.disk import parse_gbps
    from h3engine.memory.engine_plan import parse_activation_chunks

    parse_activation_chunks(options.activation_chunks)
    if options.disk_read_gbps is not None:
        parse_gbps(options.disk_read_gbps)


def component_file_options(args: argparse.Namespace) -> EngineOptions:
    """The options of a command line's `add_component_file_flags` (the rest left at their defaults)."""
    files = {name: getattr(args, name) for name in ("video_vae", "audio_vae", "text_encoder")}
    return EngineOptions(dit=tuple(args.dit or ()), **files)


def engine_layout(checkpoint: str | Path, options: EngineOptions) -> CheckpointLayout:
    """The checkpoint an engine under `options` serves: the folder's layout, with the DiT files `--dit` gives and
    the component files `--video-vae`, `--audio-vae`, `--text-encoder` give."""
    from h3engine.checkpoint.layout import (
        detect_layout,
        parse_dit_files,
        with_component_files,
        with_dit_files,
    )

    layout = detect_layout(checkpoint)
    if options.dit:
        layout = with_dit_files(layout, parse_dit_files(options.dit, tuple(layout.partitions)))
    components = {
        "video_vae": options.video_vae,
        "audio_vae": options.audio_vae,
        "text_encoder": options.text_encoder,
    }
    if not any(components.values()):
        return layout
    return with_component_files(
        layout, {name: Path(file) for name, file in components.items() if file is not None}
    )


def check_adaln_cache(setting: str | None) -> None:
    """`--adaln-cache`: "off" or a folder that can be made and written (None, the default folder, is checked when
    the engine opens it: one that cannot be written only turns the cache off)."""
    if setting is None or setting.strip().lower() == "off":
        return
    if not setting.strip():
        raise RequestError("--adaln-cache", "expected a folder or off, got an empty value")
    folder = Path(setting).expanduser()
    problem = cannot_write(folder)
    if problem is not None:
        raise RequestError("--adaln-cache", f"cannot write to {folder} ({problem})")


def cannot_write(folder: Path) -> str | None:
    """Why `folder` cannot be made or written to, or None (it exists afterwards)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return str(error.strerror or error)
    return None


def check_dtype(name: str | None) -> str:
    """The torch dtype's name for `--dtype` (None: bfloat16, the released precision; float32 is for parity
    checks)."""
    if name is None:
        return "bfloat16"
    if name not in DTYPES:
        raise RequestError("--dtype", f"expected bfloat16 or float32, got '{name}'")
    return DTYPES[name]


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The DiT's compute dtype for `--dtype`."""
    import torch

    return getattr(torch, check_dtype(name))


def resolve_device(name: str | None, flag: str = "--device") -> torch.device:
    """A device name (None: cuda when a GPU is visible, else cpu) checked against what this machine has."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RequestError(flag, f"unknown device '{name}'") from None
    if device.type not in ("cpu", "cuda"):
        raise RequestError(flag, f"only cpu and cuda are supported, got '{name}'")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise RequestError(flag, "CUDA was asked for but no GPU is available")
        if (device.index or 0) >= visible:
            raise RequestError(
                flag, f"{name} asked for, but {visible} {'GPU is' if visible == 1 else 'GPUs are'} visible"
            )
    return device


def check_engine_options(options: EngineOptions, world_size: int) -> RuntimeLayout:
    """Dtype, memory profile and the layout of an engine of `world_size` ranks (a worker group when more than
    one, or split stage groups); FP8 linear layers only for an engine of one rank.

    Split: `--encoder-devices` / `--vae-devices` give those groups' sizes when `--encoder-tp` / `--vae-ranks` are
    left out (and must agree with them when not); the devices themselves are checked by the front-end
    (h3engine.runtime.workers.stage_devices)."""
    check_dtype(options.dtype)
    check_memory_options(options)
    # After the checks that need no torch: an app or CLI refuses a wrong dtype or memory profile in a fraction of a
    # second.
    from h3engine.models.parallel.groups import STAGE_LAYOUTS, RuntimeLayout

    if options.stage_layout not in STAGE_LAYOUTS:
        raise RequestError("--stage-layout", f"expected colocated or split, got '{options.stage_layout}'")
    split = options.stage_layout == "split"
    group_sizes = {"--encoder-tp": options.encoder_tp, "--vae-ranks": options.vae_ranks}
    for devices_flag, size_flag, devices in (
        ("--encoder-devices", "--encoder-tp", options.encoder_devices),
        ("--vae-devices", "--vae-ranks", options.vae_devices),
    ):
        if devices is None:
            continue
        if not split:
            raise RequestError(devices_flag, "only with --stage-layout split (its groups' own GPUs)")
        count = len(devices.split(","))
        if group_sizes[size_flag] not in (None, count):
            raise RequestError(
                devices_flag,
                f"{count} GPUs given, but {size_flag} {group_sizes[size_flag]} asks for "
                f"{group_sizes[size_flag]} (the group has one rank per GPU)",
            )
        group_sizes[size_flag] = count
    try:
        layout = RuntimeLayout.choose(
            world_size,
            options.dit_sp,
            options.dit_tp,
            group_sizes["--encoder-tp"],
            group_sizes["--vae-ranks"],
            options.stage_layout,
        )
    except ValueError as error:  # names the flags, which only together make no layout
        raise RequestError("", str(error)) from None
    if options.fp8_linear and (world_size > 1 or split):
        raise RequestError("--fp8-linear", "FP8 linear layers run on one GPU only (no worker group)")
    return layout


def check_fp8_device(device: torch.device) -> None:
    """`--fp8-linear` only where FP8 GEMMs run natively (otherwise they would be emulated: slower and noisier)."""
    import torch

    if device.type != "cuda":
        raise RequestError(
            "--fp8-linear",
            f"FP8 linear layers need a CUDA GPU of compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer; on {device.type} they would only emulate "
            "FP8 (slower, and not the released precision): drop the flag",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise RequestError(
            "--fp8-linear",
            f"FP8 linear layers need compute capability {FP8_MIN_CAPABILITY[0]}."
            f"{FP8_MIN_CAPABILITY[1]} or newer, {device} has {capability[0]}.{capability[1]} (they would only be "
            "emulated): drop the flag",
        )


def load_engine(
    checkpoint: str | Path,
    device: torch.device,
    options: EngineOptions,
    on_load: Callable[[LoadEvent], None] | None = None,
) -> Engine:
    """An engine of one rank in this process, on a device checked by `resolve_device`; `on_load` hears each
    component load (h3engine.engine.model_store.LoadEvent)."""
    from h3engine.engine.engine import Engine

    return Engine.from_checkpoint(
        engine_layout(checkpoint, options),
        device=device,
        dtype=resolve_dtype(options.dtype, device),
        memory_profile=options.memory_profile,
        fp8_linear=options.fp8_linear,
        on_load=on_load,
        gpu_memory=options.gpu_memory,
        host_memory=options.host_memory,
        weights=options.weights,
        adaln_cache=options.adaln_cache,
        disk_read_gbps=options.disk_read_gbps,
        activation_chunks=options.activation_chunks,
    )
