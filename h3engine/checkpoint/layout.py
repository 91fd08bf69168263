"""Finding the components of a MiniMax H3 checkpoint on disk.

Two released layouts (docs/CHECKPOINT.md §1):
* native: one self-contained folder per partition (`FL2VA/` serves t2va and fl2va, `Ref2VA/` serves ref2va), each
  with a `model_index.json` carrying the `_minimax_h3` block; the DiT is `transformer/`, the video VAE
  `video_vae/` (weights under `video_vae/source/`), the audio VAE `audio_vae/`.
* diffusers: one root with `modular_model_index.json` (or a modular `model_index.json`); the partitions differ only
  in the DiT (`transformer/` for t2va/fl2va, `transformer_ref/` for ref2va), every other component is shared.

Detection only looks at index files and folder names; it reads no weights. Everything a request needs from the
index (sigma shifts, canvas rules, a step-distilled partition's `_minimax_h3.dmd_denoising_steps` rungs) is read
here, strictly: a missing or malformed field is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from h3engine.errors import CheckpointError, RequestError

# The three tasks of MiniMax H3 and the DiT partition each runs on (remix modes ride on t2va: h3engine.request.remix).
PARTITION_OF_TASK = {"t2va": "fl2va", "fl2va": "fl2va", "ref2va": "ref2va"}
TASKS = tuple(PARTITION_OF_TASK)
NATIVE_PARTITION_FOLDERS = {"fl2va": "FL2VA", "ref2va": "Ref2VA"}
DIFFUSERS_DIT_FOLDERS = {"fl2va": "transformer", "ref2va": "transformer_ref"}
DIFFUSERS_PIPELINE_CLASS = "MiniMaxH3ModularPipeline"
# A converted checkpoint's list of the DiT files that replace its partitions' weights ({partition: file name}).
DIT_FILES_JSON = "gguf_files.json"
# The GGUF types `convert --weights` and `make-placeholder-checkpoint --weights` write DiT files in.
GGUF_KINDS = ("q8_0", "q6_k", "q5_k", "q4_k", "q3_k", "q2_k")

DEFAULT_CANVAS_SHORT_EDGE = 768
DEFAULT_CANVAS_MAX_PIXELS = 768 * 1344
DEFAULT_REFERENCE_IMAGE_SHORT_EDGE = 2048


@dataclass(frozen=True)
class PartitionPaths:
    """Where the components serving one partition live."""

    partition: str
    tasks: tuple[str, ...]
    dit: Path
    video_vae: Path
    audio_vae: Path
    text_encoder: Path
    tokenizer: Path
    processor: Path
    # The DMD rungs of a step-distilled DiT (`_minimax_h3.dmd_denoising_steps`), None for an undistilled one.
    dmd_steps: tuple[int, ...] | None = None
    # A single file (a community GGUF) whose weights replace those of `dit`; `dit`'s config.json still describes it.
    dit_weights: Path | None = None
    # Single files (community ComfyUI files) whose weights replace those of the shared components' folders (the
    # folders' configs still describe them): `--video-vae`, `--audio-vae`, `--text-encoder`.
    video_vae_weights: Path | None = None
    audio_vae_weights: Path | None = None
    text_encoder_weights: Path | None = None

    @property
    def dit_home(self) -> Path:
        """What holds this partition's DiT weights (the file that replaces the folder's, else the folder): what tells
        one loaded DiT from another."""
        return self.dit_weights or self.dit

    @property
    def video_vae_home(self) -> Path:
        """What holds the video VAE's weights (the replacing file, else the folder)."""
        return self.video_vae_weights or self.video_vae

    @property
    def audio_vae_home(self) -> Path:
        """What holds the audio VAE's weights (the replacing file, else the folder)."""
        return self.audio_vae_weights or self.audio_vae

    @property
    def text_encoder_home(self) -> Path:
        """What holds the text encoder's weights (the replacing file, else the folder)."""
        return self.text_encoder_weights or self.text_encoder


@dataclass(frozen=True)
class CanvasRules:
    short_edge: int = DEFAULT_CANVAS_SHORT_EDGE
    max_pixels: int = DEFAULT_CANVAS_MAX_PIXELS
    reference_image_short_edge: int = DEFAULT_REFERENCE_IMAGE_SHORT_EDGE


@dataclass(frozen=True)
class CheckpointLayout:
    kind: Literal["native", "diffusers"]
    root: Path
    partitions: dict[str, PartitionPaths]
    video_shift: float
    audio_shift: float
    canvas: CanvasRules = field(default_factory=CanvasRules)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(task for task in TASKS if PARTITION_OF_TASK[task] in self.partitions)

    def for_task(self, task: str) -> PartitionPaths:
        if task not in PARTITION_OF_TASK:
            raise CheckpointError(f"unknown task '{task}'; supported: {', '.join(TASKS)}")
        partition = self.partitions.get(PARTITION_OF_TASK[task])
        if partition is None:
            raise CheckpointError(
                f"{self.root}: this checkpoint has no {PARTITION_OF_TASK[task]} partition, so it cannot serve "
                f"task '{task}' (it serves: {', '.join(self.tasks) or 'nothing'})"
            )
        return partition

    def dmd_steps_for(self, task: str) -> tuple[int, ...] | None:
        """The DMD rungs the DiT serving `task` was distilled on, None where it runs any step count."""
        return self.for_task(task).dmd_steps


def parse_dit_files(values: Sequence[str], partitions: Sequence[str]) -> dict[str, Path]:
    """`--dit` values by partition: PARTITION=FILE, or a bare FILE for a checkpoint of one partition."""
    files: dict[str, Path] = {}
    for value in values:
        partition, separator, file = value.partition("=")
        if not separator or partition not in partitions:  # a bare FILE (which may hold a "=")
            if len(partitions) != 1:
                raise RequestError(
                    "--dit",
                    f"the checkpoint has partitions {' and '.join(partitions)}: name the one {value!r} replaces, "
                    f"e.g. --dit {partitions[0]}={value}",
                )
            partition, file = partitions[0], value
        if partition in files:
            raise RequestError("--dit", f"partition {partition} is given two files")
        if not Path(file).is_file():
            raise RequestError("--dit", f"{file!r} is not a file")
        files[partition] = Path(file)
    return files


def with_dit_files(layout: CheckpointLayout, files: Mapping[str, Path]) -> CheckpointLayout:
    """`layout` with the DiT weights of the partitions `files` names replaced by those files (each must exist)."""
    partitions = dict(layout.partitions)
    for partition, file in files.items():
        if partition not in partitions:
            raise CheckpointError(
                f"{layout.root}: no {partition} partition to take the DiT file {file} (it has: "
                f"{', '.join(partitions)})"
            )
        if not Path(file).is_file():
            raise CheckpointError(f"{file}: file is missing")
        partitions[partition] = replace(partitions[partition], dit_weights=Path(file))
    return replace(layout, partitions=partitions)


# The shared components a single file may replace: the flag that gives it and the PartitionPaths field it fills.
COMPONENT_FILE_FLAGS = {
    "video_vae": "--video-vae",
    "audio_vae": "--audio-vae",
    "text_encoder": "--text-encoder",
}


def with_component_files(layout: CheckpointLayout, files: Mapping[str, Path | None]) -> CheckpointLayout:
    """`layout` with the weights of the shared components `files` names ({video_vae, audio_vae, text_encoder: file})
    replaced, in every partition, by those files (each must be a file)."""
    replaced = {}
    for component, file in files.items():
        if file is None:
            continue
        if component not in COMPONENT_FILE_FLAGS:
            raise ValueError(f"{component!r} is no component a single file replaces")
        if not Path(file).is_file():
            raise RequestError(COMPONENT_FILE_FLAGS[component], f"{str(file)!r} is not a file")
        replaced[f"{component}_weights"] = Path(file)
    partitions = {name: replace(paths, **replaced) for name, paths in layout.partitions.items()}
    return replace(layout, partitions=partitions)


def valid_dmd_steps(rungs: Any) -> bool:
    """Whether `rungs` is a non-empty list of strictly decreasing integers in (0, 1000] (bool is not an integer)."""
    return (
        isinstance(rungs, list)
        and bool(rungs)
        and all(type(rung) is int and 0 < rung <= 1000 for rung in rungs)
        and all(left > right for left, right in pairwise(rungs))
    )


def distilled_step_count(rungs: Sequence[int], recipe: str) -> int:
    """The step count (`num_inference_steps`) that runs `rungs` under `recipe`: one forward per rung, and the
    diffusers recipe counts the terminal grid point too."""
    return len(rungs) + 1 if recipe == "diffusers" else len(rungs)


def read_dmd_steps(release: dict[str, Any], index_path: Path) -> tuple[int, ...] | None:
    """`_minimax_h3.dmd_denoising_steps`: strictly decreasing integers in (0, 1000], or absent (None)."""
    if "dmd_denoising_steps" not in release:
        return None
    rungs = release["dmd_denoising_steps"]
    if not valid_dmd_steps(rungs):
        raise CheckpointError(
            f"{index_path}: _minimax_h3.dmd_denoising_steps must be a non-empty list of strictly decreasing "
            f"integers in (0, 1000], got {json.dumps(rungs)}"
        )
    return tuple(rungs)


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable JSON ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def require(config: dict[str, Any], key: str, path: Path) -> Any:
    if key not in config:
        raise CheckpointError(f"{path}: missing field '{key}'")
    return config[key]


def _require_dir(path: Path) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"{path}: folder is missing")
    return path


def require_empty_folder(folder: Path) -> None:
    """A checkpoint writer's target: a missing or empty folder (FileExistsError otherwise); needs no torch, so the CLI
    refuses a full folder at once."""
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder}: folder is not empty")


def detect_layout(path: str | Path) -> CheckpointLayout:
    """Detect the layout of a checkpoint folder (a native repo root, one native partition, or a diffusers root),
    with the DiT files its `DIT_FILES_JSON` names (a folder `convert --weights q4_k` wrote) in their partitions."""
    layout = _folder_layout(Path(path).expanduser())
    listed = layout.root / DIT_FILES_JSON
    if not listed.is_file():
        return layout
    names = read_json(listed)
    if not all(isinstance(name, str) and Path(name).name == name for name in names.values()):
        raise CheckpointError(
            f"{listed}: expected {{partition: file name beside it}}, got {json.dumps(names)}"
        )
    return with_dit_files(layout, {partition: layout.root / name for partition, name in names.items()})


def _folder_layout(root: Path) -> CheckpointLayout:
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint folder does not exist")
    native_partitions = [root / name for name in NATIVE_PARTITION_FOLDERS.values() if (root / name).is_dir()]
    if native_partitions:
        return _native_layout(root, native_partitions)
    index_path = root / "model_index.json"
    modular_path = root / "modular_model_index.json"
    if index_path.is_file():
        index = read_json(index_path)
        if "_minimax_h3" in index:
            return _native_layout(root, [root])
        if index.get("_class_name") == DIFFUSERS_PIPELINE_CLASS or modular_path.is_file():
            return _diffusers_layout(root)
    elif modular_path.is_file():
        return _diffusers_layout(root)
    raise CheckpointError(
        f"{root}: not a MiniMax H3 checkpoint (expected FL2VA/ and Ref2VA/ partition folders, a model_index.json "
        "with a _minimax_h3 block, or a diffusers modular_model_index.json)"
    )


def _native_layout(root: Path, partition_dirs: list[Path]) -> CheckpointLayout:
    partitions: dict[str, PartitionPaths] = {}
    shifts: set[tuple[float, float]] = set()
    canvases: set[CanvasRules] = set()
    for folder in partition_dirs:
        index_path = folder / "model_index.json"
        release = require(read_json(index_path), "_minimax_h3", index_path)
        partition = require(release, "partition", index_path)
        if partition not in NATIVE_PARTITION_FOLDERS:
            raise CheckpointError(f"{index_path}: unknown partition '{partition}'")
        tasks = tuple(require(release, "tasks", index_path))
        for task in tasks:
            if PARTITION_OF_TASK.get(task) != partition:
                raise CheckpointError(
                    f"{index_path}: task '{task}' does not belong to partition '{partition}'"
                )
        scales = require(release, "sigma_shift_scales", index_path)
        shifts.add((float(require(scales, "video", index_path)), float(require(scales, "audio", index_path))))
        # Canvas rules are not in the release; our tiny checkpoints carry them here so that their canvases stay tiny.
        canvases.add(
            CanvasRules(
                int(release.get("canvas_short_edge", DEFAULT_CANVAS_SHORT_EDGE)),
                int(release.get("canvas_max_pixels", DEFAULT_CANVAS_MAX_PIXELS)),
                int(release.get("reference_image_short_edge", DEFAULT_REFERENCE_IMAGE_SHORT_EDGE)),
            )
        )
        partitions[partition] = PartitionPaths(
            partition=partition,
            tasks=tasks,
            dit=_require_dir(folder / "transformer"),
            video_vae=_require_dir(folder / "video_vae"),
            audio_vae=_require_dir(folder / "audio_vae"),
            text_encoder=_require_dir(folder / "text_encoder"),
            tokenizer=_require_dir(folder / "tokenizer"),
            processor=_require_dir(folder / "processor"),
            dmd_steps=read_dmd_steps(release, index_path),
        )
    if len(shifts) != 1 or len(canvases) != 1:
        raise CheckpointError(f"{root}: the partitions disagree on sigma shifts or canvas rules")
    (video_shift, audio_shift), canvas = shifts.pop(), canvases.pop()
    return CheckpointLayout("native", root, partitions, video_shift, audio_shift, canvas)


def _diffusers_layout(root: Path) -> CheckpointLayout:
    modular_path = root / "modular_model_index.json"
    index_path = modular_path if modular_path.is_file() else root / "model_index.json"
    index = read_json(index_path)
    canvas = CanvasRules(
        int(index.get("canvas_short_edge", DEFAULT_CANVAS_SHORT_EDGE)),
        int(index.get("canvas_max_pixels", DEFAULT_CANVAS_MAX_PIXELS)),
        int(index.get("reference_image_short_edge", DEFAULT_REFERENCE_IMAGE_SHORT_EDGE)),
    )
    shifts = []
    for name in ("scheduler", "audio_scheduler"):
        config_path = root / name / "scheduler_config.json"
        shifts.append(float(require(read_json(config_path), "shift", config_path)))
    partitions = {}
    for partition, dit_folder in DIFFUSERS_DIT_FOLDERS.items():
        if not (root / dit_folder).is_dir():
            continue
        partitions[partition] = PartitionPaths(
            partition=partition,
            tasks=tuple(task for task in TASKS if PARTITION_OF_TASK[task] == partition),
            dit=root / dit_folder,
            video_vae=_require_dir(root / "vae"),
            audio_vae=_require_dir(root / "audio_vae"),
            text_encoder=_require_dir(root / "text_encoder"),
            tokenizer=_require_dir(root / "tokenizer"),
            processor=_require_dir(root / "processor"),
        )
    if not partitions:
        raise CheckpointError(f"{root}: neither transformer/ nor transformer_ref/ is present")
    return CheckpointLayout("diffusers", root, partitions, shifts[0], shifts[1], canvas)


# A safetensors file's fingerprint reads its header and this many evenly spaced samples of this many bytes.
FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 1 << 16


def folder_fingerprint(folder: Path) -> str:
    """A digest that tells two component folders apart (the native layout's partitions each carry a copy of the text
    encoder, tokenizer, processor and VAEs, byte-identical in the release): every file's relative path and size;
    small files whole; a safetensors file's header and `FINGERPRINT_SAMPLES` samples spread over its data (a GGUF
    file's samples, the first of which holds its header), so that
    two 60 GB copies compare in milliseconds. Copies differing only between samples would compare equal: a risk
    taken knowingly, since the release ships identical copies and the alternative is reading both whole."""
    digest = hashlib.sha256()
    files = [folder] if folder.is_file() else sorted(path for path in folder.rglob("*") if path.is_file())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder) if path != folder else path.name}:{size}\n".encode())
        with open(path, "rb") as handle:
            if path.suffix not in (".safetensors", ".gguf"):
                digest.update(handle.read())
                continue
            if path.suffix == ".safetensors":
                header_length = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(min(header_length, size)))
            for sample in range(FINGERPRINT_SAMPLES):
                handle.seek(
                    sample * max(0, size - FINGERPRINT_SAMPLE_BYTES) // max(1, FINGERPRINT_SAMPLES - 1)
                )
                digest.update(handle.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()
