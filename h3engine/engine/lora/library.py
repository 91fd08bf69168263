"""A folder of LoRA adapters as the app lists them, and the Turbo preset of step-distilled adapters.

* `LoraLibrary(folder)` finds every `*.safetensors` below the folder (sorted by name) from the files' headers alone
  (no tensor is read): each `LibraryEntry` has its name (the path below the folder, which is all an API client may
  name), the DiTs its key prefixes route it to (as diffusers does: `transformer_ref.` keys go to the Ref2VA DiT,
  any other key to the FL2VA / T2VA DiT) and its Turbo settings, if any. A file whose header cannot be read is
  listed with its problem instead. `entry(name)` looks a name up (RequestError naming `field` if there is none).
* `turbo_settings(entries)` is the Turbo preset: the first adapter whose `__metadata__` has a `minimax_h3` JSON object
  (`num_inference_steps`, `flow_shift`, `audio_flow_shift`, `dmd_denoising_steps` rungs) gives what it says, and
  `TURBO_TABLE` the rest (8 steps, shifts 6 / 3: how published H3 Turbo LoRAs are used); a PDD adapter's preset is
  its own grid (`pdd_settings`: N / L forwards, shifts 12 / 3; h3engine.engine.sampling.pdd).

Danger: names come from API clients; only names found by the scan resolve to files, so no client text becomes a path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from h3engine.checkpoint.layout import distilled_step_count, valid_dmd_steps
from h3engine.checkpoint.lora_format import PARTITIONS, LoraError, Partition, read_lora_header
from h3engine.checkpoint.pdd_format import is_pdd_header, read_grid
from h3engine.engine.sampling.pdd import PDD_AUDIO_SHIFT, PDD_VIDEO_SHIFT
from h3engine.errors import RequestError
from h3engine.request.model import LORA_TARGET_OF_TASK, MAX_STEPS, LoraChoice

TURBO_METADATA_KEY = "minimax_h3"
_TURBO_FIELDS = ("num_inference_steps", "flow_shift", "audio_flow_shift", "dmd_denoising_steps")
# Files larger than this are not adapters of H3 (a rank-256 LoRA on every linear is about 4 GB in fp32).
MAX_LISTED_BYTES = 16 << 30


@dataclass(frozen=True)
class TurboSettings:
    """The steps, flow shifts and rungs (empty: the usual grid) a Turbo preset sets, and where they come from."""

    steps: int
    flow_shift: float
    audio_flow_shift: float
    rungs: tuple[int, ...] = ()
    source: str = "the Turbo table"
    # A PDD adapter's own recipe: `steps` are its forwards (h3engine.engine.sampling.pdd holds a request to them).
    pdd: bool = False

    def describe(self) -> str:
        rungs = f", rungs {', '.join(map(str, self.rungs))}" if self.rungs else ""
        return (
            f"{self.steps} steps, flow shifts {self.flow_shift:g} / {self.audio_flow_shift:g}{rungs} "
            f"(from {self.source})"
        )


# How step-distilled ("Turbo") H3 LoRAs are published to be used: 4 to 8 steps, video / audio shifts 6 / 3.
TURBO_TABLE = TurboSettings(steps=8, flow_shift=6.0, audio_flow_shift=3.0)


@dataclass(frozen=True)
class LibraryEntry:
    name: str  # the path below the library folder, "/"-separated
    path: Path
    size_bytes: int
    targets: tuple[Partition, ...] = ()
    turbo: TurboSettings | None = None  # what its metadata says (the rest from TURBO_TABLE)
    problem: str | None = None  # why it cannot be used (then nothing else is known)

    def fits(self, target: Partition) -> bool:
        """Whether the adapter can run on the DiT `target`: it names that partition, or names none."""
        return self.problem is None and (not self.targets or target in self.targets)

    def label(self) -> str:
        if self.problem is not None:
            return f"{self.name} (unusable: {self.problem})"
        turbo = "" if self.turbo is None else " · PDD" if self.turbo.pdd else " · Turbo"
        size = (
            f"{self.size_bytes / 2**20:.1f} MiB"
            if self.size_bytes >= 2**20
            else f"{self.size_bytes // 1024} KiB"
        )
        return f"{self.name} ({size}{turbo})"


class LoraLibrary:
    def __init__(self, folder: Path | str | None) -> None:
        self.folder = None if folder is None else Path(folder)
        self.entries: tuple[LibraryEntry, ...] = ()
        self.rescan()

    def rescan(self) -> tuple[LibraryEntry, ...]:
        """Read the folder again (adapters added or removed since); the entries, sorted by name."""
        if self.folder is None:
            self.entries = ()
            return self.entries
        files = sorted(
            (path for path in self.folder.rglob("*.safetensors") if path.is_file()),
            key=lambda path: path.relative_to(self.folder).as_posix(),
        )
        self.entries = tuple(_entry(self.folder, path) for path in files)
        return self.entries

    def usable(self, target: Partition) -> list[LibraryEntry]:
        return [entry for entry in self.entries if entry.fits(target)]

    def entry(self, name: Any, field: str) -> LibraryEntry:
        for entry in self.entries:
            if entry.name == name:
                if entry.problem is not None:
                    raise RequestError(field, f"{name!r} cannot be used: {entry.problem}")
                return entry
        names = ", ".join(entry.name for entry in self.entries if entry.problem is None) or "none"
        where = "no LoRA folder was given (--lora-dir)" if self.folder is None else f"available: {names}"
        raise RequestError(field, f"no adapter named {str(name)[:120]!r}; {where}")

    def name_of(self, path: str | os.PathLike[str]) -> str | None:
        """The library name of a file (as a request or a sidecar names it), None when it is not in the library."""
        resolved = os.path.realpath(path)
        for entry in self.entries:
            if os.path.realpath(entry.path) == resolved:
                return entry.name
        return None


def _entry(folder: Path, path: Path) -> LibraryEntry:
    name = path.relative_to(folder).as_posix()
    try:
        size = path.stat().st_size
        if size > MAX_LISTED_BYTES:
            return LibraryEntry(
                name, path, size, problem=f"{size / 2**30:.0f} GiB is too large for an adapter"
            )
        keys, metadata = read_lora_header(path, name)
        pdd = pdd_settings(keys, metadata, name)
    except (OSError, LoraError) as error:
        return LibraryEntry(name, path, 0, problem=_problem(error, name))
    if not keys:
        return LibraryEntry(name, path, size, problem="it holds no tensors")
    prefixes = {key.split(".", 1)[0] for key in keys}
    named = prefixes & set(PARTITIONS)
    # Unprefixed keys beside prefixed ones go to the FL2VA / T2VA DiT (diffusers' default); a file with no prefix at
    # all names no DiT (targets empty) and runs on either.
    targets = named | {"transformer"} if named and prefixes - named else named
    try:
        turbo = pdd or read_turbo_metadata(metadata, name)
    except RequestError as error:
        return LibraryEntry(name, path, size, problem=str(error).split(": ", 1)[-1])
    return LibraryEntry(name, path, size, tuple(sorted(targets)), turbo)


def _problem(error: BaseException, name: str) -> str:
    """An error as the listing shows it beside the file's name: without the name, one line."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    return text.removeprefix(f"LoRA file {name!r} ").removeprefix("is ")[:200]


def read_turbo_metadata(metadata: dict[str, str], name: str) -> TurboSettings | None:
    """The Turbo settings a file's `__metadata__` declares under `minimax_h3` (None: none), the table filling the
    rest; RequestError naming the file and the entry for anything malformed."""
    if TURBO_METADATA_KEY not in metadata:
        return None
    where = f"{name!r}: __metadata__ {TURBO_METADATA_KEY!r}"
    try:
        declared = json.loads(metadata[TURBO_METADATA_KEY])
    except json.JSONDecodeError:
        raise RequestError("loras", f"{where} is not JSON") from None
    if not isinstance(declared, dict) or not set(declared) & set(_TURBO_FIELDS):
        raise RequestError("loras", f"{where} must be a JSON object with any of {', '.join(_TURBO_FIELDS)}")
    settings = replace(TURBO_TABLE, source=f"{name}'s metadata")
    if "dmd_denoising_steps" in declared:
        rungs = declared["dmd_denoising_steps"]
        if not valid_dmd_steps(rungs):
            raise RequestError(
                "loras", f"{where}: dmd_denoising_steps must be strictly decreasing integers in (0, 1000]"
            )
        settings = replace(settings, rungs=tuple(rungs), steps=len(rungs))
    if "num_inference_steps" in declared:
        steps = declared["num_inference_steps"]
        if type(steps) is not int or not 1 <= steps <= MAX_STEPS:
            raise RequestError(
                "loras", f"{where}: num_inference_steps must be an integer in [1, {MAX_STEPS}]"
            )
        if settings.rungs and steps != len(settings.rungs):
            raise RequestError(
                "loras", f"{where}: num_inference_steps {steps} but {len(settings.rungs)} rungs"
            )
        settings = replace(settings, steps=steps)
    for field in ("flow_shift", "audio_flow_shift"):
        if field in declared:
            value = declared[field]
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise RequestError("loras", f"{where}: {field} must be a positive number")
            settings = replace(settings, **{field: float(value)})
    return settings


def pdd_settings(keys: Sequence[str], metadata: dict[str, str], name: str) -> TurboSettings | None:
    """A PDD adapter's preset from its header (None: not one): N / L forwards on its grid, flow shifts 12 / 3."""
    if not is_pdd_header(keys):
        return None
    num_intervals, block_size, _ = read_grid(metadata, name)
    forwards = num_intervals // block_size
    source = f"{name}, a PDD adapter"
    return TurboSettings(forwards, PDD_VIDEO_SHIFT, PDD_AUDIO_SHIFT, source=source, pdd=True)


def file_turbo(path: str | os.PathLike[str]) -> TurboSettings | None:
    """What an adapter file says of its Turbo settings: a PDD adapter's preset, else its metadata's (header only;
    RequestError naming the file)."""
    name = Path(path).name
    try:
        keys, metadata = read_lora_header(path, name)
        pdd = pdd_settings(keys, metadata, name)
    except LoraError as error:
        raise RequestError("loras", str(error)) from None
    return pdd or read_turbo_metadata(metadata, name)


def turbo_settings(declared: Sequence[TurboSettings | None], recipe: str = "sglang") -> TurboSettings:
    """The Turbo preset for the chosen adapters (what each one's metadata declares, in order): the first
    declaration, else `TURBO_TABLE`; with rungs, the step count they need under `recipe`; a PDD adapter's forwards
    as `recipe` counts them (the diffusers recipe counts the terminal grid point too)."""
    settings = next((turbo for turbo in declared if turbo is not None), TURBO_TABLE)
    if settings.rungs:
        settings = replace(settings, steps=distilled_step_count(settings.rungs, recipe))
    if settings.pdd and recipe == "diffusers":
        settings = replace(settings, steps=settings.steps + 1)
    return settings


LORA_ENTRY_KEYS = ("name", "strength")


def lora_choices(value: Any, task: str, library: LoraLibrary) -> tuple[LoraChoice, ...]:
    """`loras` as the page and the API take it, `[{"name": adapter in --lora-dir, "strength": 0.8}, ...]` (a bare
    name, or one object, is a list of one), as the request's entries on the task's DiT; RequestError naming
    `loras[i]` for an entry that is not an object of these keys, an adapter not in the folder, or one made for the
    other DiT. The request rules judge the count and the strengths."""
    if value in (None, "", []):
        return ()
    if isinstance(value, str | dict):
        value = [value]
    if not isinstance(value, list):
        raise RequestError(
            "loras",
            f'must be a list such as [{{"name": "style.safetensors", "strength": 0.8}}], got {value!r:.80}',
        )
    target = LORA_TARGET_OF_TASK[task]
    choices = []
    for index, item in enumerate(value):
        field = f"loras[{index}]"
        item = {"name": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or "name" not in item or set(item) - set(LORA_ENTRY_KEYS):
            raise RequestError(field, f'must be an object {{"name": ..., "strength": ...}}, got {item!r:.80}')
        entry = library.entry(item["name"], f"{field}.name")
        if not entry.fits(target):
            raise RequestError(
                f"{field}.name",
                f"{entry.name!r} is for the {' and '.join(entry.targets)} DiT; this task runs {target}",
            )
        choices.append(LoraChoice(path=str(entry.path), strength=item.get("strength", 1.0), target=target))
    return tuple(choices)
