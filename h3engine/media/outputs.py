"""Files a finished request leaves behind: the MP4, its JSON sidecar and optional tensor dumps.

Contract:
* `output_paths(out_mp4)`: the sidecar is the MP4's path with `.json` instead of `.mp4`, so either finds the other.
* Every writer here (and `media.mux.write_mp4`) goes through `atomic_output`: the bytes go to a hidden temporary
  file in the destination folder, are flushed, and only then renamed over the final name; a reader sees the old
  or the new complete file, never a partial one, and an error leaves the old file untouched.
* `write_sidecar` writes sorted, indented UTF-8 JSON without NaN/Infinity (the browser cannot parse them);
  `sidecar_record` composes it; `save_tensors` writes contiguous CPU float32 safetensors.
* `staged(OutputFiles)`: a request's files appear together or not at all; `commit()` renames them into place with
  the sidecar last, and leaving the block without it removes every staging file.

Danger: the temporary file lives in the destination folder on purpose (`os.replace` is atomic within one file
system only). Its name, `.NAME.PID-TOKEN.partial`, hides it from a history scan and tells a dead writer's
leftovers (h3engine.media.leftovers) from a live one's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from h3engine.errors import RequestError

if (
    TYPE_CHECKING
):  # torch is imported by `save_tensors` alone: the CLI checks output names before importing it
    import torch

    from h3engine.request.geometry import Geometry
    from h3engine.request.model import GenerationRequest

logger = logging.getLogger(__name__)

MP4_SUFFIX = ".mp4"
SIDECAR_SUFFIX = ".json"
TENSORS_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
_UNLINK_IN_FOLDER = os.unlink in os.supports_dir_fd  # POSIX: unlink a name through an open folder


def output_paths(out_mp4: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Return `(mp4_path, sidecar_path)` for an output MP4 path: same folder and stem, `.json` suffix."""
    mp4_path = Path(out_mp4)
    if mp4_path.suffix.lower() != MP4_SUFFIX:
        raise ValueError(f"output video path must end in {MP4_SUFFIX!r}, got {str(mp4_path)!r}")
    return mp4_path, mp4_path.with_suffix(SIDECAR_SUFFIX)


def _new_partial_path(final_path: Path) -> Path:
    """Create (exclusively) an empty hidden temp file next to `final_path` and return its path."""
    for _attempt in range(16):
        candidate = final_path.with_name(
            f".{final_path.name}.{os.getpid()}-{secrets.token_hex(6)}{PARTIAL_SUFFIX}"
        )
        try:
            # O_EXCL: never adopt a file someone else is writing. Mode 0o666 lets the process umask decide
            # the final permissions, as a plain open() would (mkstemp would force 0o600 on the result).
            descriptor = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(descriptor)
        return candidate
    raise FileExistsError(f"could not create a unique temporary file next to {str(final_path)!r}")


def _flush_to_disk(file_path: Path) -> None:
    """fsync a finished file so the rename cannot reach the disk before its contents do."""
    with open(file_path, "rb") as handle:
        os.fsync(handle.fileno())


def _flush_folder_entry(folder: Path) -> None:
    """fsync the folder so the rename itself survives a crash; best effort where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_output(final_path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write to; on success it replaces `final_path` atomically, on error it is removed.

    The temporary file already exists (empty) when yielded; the writer may overwrite or truncate it.
    """
    final_path = Path(final_path)
    partial_path = _new_partial_path(final_path)
    try:
        yield partial_path
        _flush_to_disk(partial_path)
        os.replace(partial_path, final_path)
    except BaseException:
        # BaseException too: a Ctrl-C or a cancelled worker must not leave a stray .partial behind.
        try:
            partial_path.unlink(missing_ok=True)
        except OSError as error:  # the folder went away: the writer's own error is the one to raise
            logger.warning("could not remove the staging file %s: %s", partial_path, error)
        raise
    _flush_folder_entry(final_path.parent)


@dataclass(frozen=True)
class OutputFiles:
    """The files one request leaves behind: its MP4, its JSON sidecar and, when asked for, its tensors."""

    video: Path
    sidecar: Path
    tensors: Path | None = None

    @classmethod
    def beside(
        cls, out_mp4: str | os.PathLike[str], tensors: str | os.PathLike[str] | None = None
    ) -> OutputFiles:
        video, sidecar = output_paths(out_mp4)
        return cls(video, sidecar, None if tensors is None else Path(tensors))

    def in_commit_order(self) -> list[Path]:
        """The sidecar last: once it is visible, everything it names is complete."""
        return [self.video, *([self.tensors] if self.tensors is not None else []), self.sidecar]

    def problem(self) -> tuple[Literal["video", "tensors"], str] | None:
        """What cannot be written, checked before any work: ("video" or "tensors", why), or None. The sidecar's
        problems are the video's (its name follows from the video's)."""
        if self.tensors is not None:
            if self.tensors.suffix.lower() != TENSORS_SUFFIX:
                return "tensors", f"must be a {TENSORS_SUFFIX} path, got '{self.tensors}'"
            if self.tensors.is_dir():
                return "tensors", f"'{self.tensors}' is a folder; give the path of a file"
            # With its own suffix it can only meet the others through a link.
            if self.tensors.resolve() in (self.video.resolve(), self.sidecar.resolve()):
                return "tensors", f"'{self.tensors}' is the video or its sidecar; give a path of its own"
        if self.video.is_dir():
            return "video", f"'{self.video}' is a folder; give the path of an {MP4_SUFFIX} file"
        if self.sidecar.is_dir():
            return "video", f"its sidecar '{self.sidecar}' is a folder; choose another name"
        for role, path in (("video", self.video), ("tensors", self.tensors)):
            if path is None:
                continue
            if not path.parent.is_dir():
                return role, f"folder '{path.parent}' does not exist"
            if not os.access(path.parent, os.W_OK | os.X_OK):
                return role, f"folder '{path.parent}' is not writable"
        return None


def checked_output_files(out_path: Path | str, save_tensors_path: Path | str | None = None) -> OutputFiles:
    """The request's output files, or RequestError naming the argument, before any work is done."""
    try:
        files = OutputFiles.beside(out_path, save_tensors_path)
    except ValueError as error:
        raise RequestError("out_path", str(error)) from None
    problem = files.problem()
    if problem is not None:
        role, message = problem
        raise RequestError("out_path" if role == "video" else "save_tensors_path", message)
    return files


class StagedOutputs:
    """Hidden staging files for one request's `OutputFiles`; see `staged`.

    Each staging folder is held open while the files stage: `discard` unlinks through it, so the files go even when
    the folder was moved or replaced meanwhile, and a failure there is logged, never raised over the job's own error.
    """

    def __init__(self, final: OutputFiles) -> None:
        self.final = final
        created: list[Path] = []
        self._folders: dict[Path, int] = {}
        try:
            for path in final.in_commit_order():
                if _UNLINK_IN_FOLDER and path.parent not in self._folders:
                    self._folders[path.parent] = os.open(
                        path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                    )
                created.append(_new_partial_path(path))
        except BaseException:
            for path in created:
                path.unlink(missing_ok=True)
            self._close_folders()
            raise
        self._staging = created
        self.files = OutputFiles(created[0], created[-1], created[1] if final.tensors is not None else None)
        self._committed = False

    def commit(self) -> OutputFiles:
        """Flush every staging file and rename each into place, the sidecar last; returns the final files."""
        for path in self._staging:
            _flush_to_disk(path)
        for path, final_path in zip(self._staging, self.final.in_commit_order(), strict=True):
            os.replace(path, final_path)
        self._committed = True
        self._close_folders()
        for folder in {path.parent for path in self.final.in_commit_order()}:
            _flush_folder_entry(folder)
        return self.final

    def discard(self) -> None:
        if not self._committed:
            for path in self._staging:
                folder = self._folders.get(path.parent)
                try:
                    if folder is None:
                        path.unlink(missing_ok=True)
                    else:
                        os.unlink(path.name, dir_fd=folder)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    logger.warning("could not remove the staging file %s: %s", path, error)
        self._close_folders()

    def _close_folders(self) -> None:
        for descriptor in self._folders.values():
            os.close(descriptor)
        self._folders.clear()


@contextlib.contextmanager
def staged(final: OutputFiles) -> Iterator[StagedOutputs]:
    """Write a request's files into `StagedOutputs.files`, then `commit()`; without a commit nothing appears."""
    staging = StagedOutputs(final)
    try:
        yield staging
    finally:
        staging.discard()


def write_sidecar(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write `payload` as JSON (sorted keys, indent 2, UTF-8, trailing newline) atomically to `path`.

    Serialization happens before anything touches the disk, so an unserializable payload (TypeError) or a
    NaN/Infinity value (ValueError) leaves no file at all.
    """
    text = json.dumps(payload, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    final_path = Path(path)
    with atomic_output(final_path) as partial_path:
        partial_path.write_text(text, encoding="utf-8")
    return final_path


def input_records(request: GenerationRequest) -> list[dict[str, Any]]:
    """What the sidecar records about each input file: its field, role, path and the sha256 of its bytes.

    Taken before generating, so that the sidecar names the bytes the conditioning was read from.
    """
    records: list[dict[str, Any]] = [
        {"field": f"keyframes[{index}]", "position": keyframe.position, "path": keyframe.path}
        for index, keyframe in enumerate(request.keyframes)
    ]
    records += [
        {
            "field": f"references[{index}]",
            "kind": reference.kind,
            "path": reference.path,
            "start_seconds": reference.start_seconds,
        }
        for index, reference in enumerate(request.references)
    ]
    remix = request.remix
    if remix is not None:
        records += [
            {"field": f"remix.{name}", "mode": remix.mode, "path": getattr(remix, name)}
            for name in ("source_video", "source_audio", "video_mask_image")
            if getattr(remix, name) is not None
        ]
    for record in records:
        try:
            record["sha256"] = _sha256(record["path"])
        except OSError as error:
            raise RequestError(record["field"], f"cannot read {record['path']}: {error.strerror}") from None
    return records


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sidecar_record(
    request: GenerationRequest,
    inputs: list[dict[str, Any]],
    engine: Mapping[str, Any],
    geometry: Geometry,
    timings: Mapping[str, float],
    video_name: str,
    step_cache: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The sidecar of one video: the request, its `input_records`, the `engine` that made it (checkpoint, device,
    precision, kernels: its keys go to the top level), the geometry, the timings and the video's file name; with a
    step cache (request `cache` other than "off"), its preset and forwards computed and skipped."""
    cache = {} if step_cache is None else {"step_cache": dict(step_cache)}
    # The denoise loop names the seconds its AdaLN tables took by where they came from
    # (h3engine.engine.sampling.denoise_steps.ADALN_TIMING).
    if "adaln_tables_computed_s" in timings:
        cache["adaln_tables"] = "computed"
    elif "adaln_tables_cached_s" in timings:
        cache["adaln_tables"] = "cache"
    return {
        "request": request.to_dict(),
        "inputs": inputs,
        "seed": request.seed,
        "recipe": request.recipe,
        **engine,
        "geometry": {
            "width": geometry.width,
            "height": geometry.height,
            "frames": geometry.frames,
            "fps": 24,
            "latent_frames": geometry.latent_frames,
            "audio_latents": geometry.audio_latents,
        },
        "timings_s": dict(timings),
        **cache,
        "video": video_name,
    }


def save_tensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Save floating-point tensors atomically as safetensors, each converted to a contiguous CPU float32 copy.

    Non-floating tensors are refused (ValueError) rather than silently converted, because float32 cannot hold
    every int64/int32 value exactly. The copies also break any storage sharing between entries, which
    safetensors would otherwise reject.
    """
    import torch
    from safetensors.torch import save_file

    prepared: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, expected torch.Tensor")
        if not tensor.is_floating_point():
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}; only floating-point tensors are saved"
            )
        prepared[name] = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()

    final_path = Path(path)
    with atomic_output(final_path) as partial_path:
        save_file(prepared, str(partial_path))
    return final_path
