"""What travels between the app host and a Ray Serve engine replica for one job (h3engine.runtime.ray_serve).

The app host packs a job (`pack_job`): the request with its input files' bytes (keyframes, references, LoRAs), the
output file names and the preview cadence. The replica unpacks the inputs under a folder of its own
(`unpack_inputs`, content-addressed: a LoRA sent twice is one file, so the engine's adapter cache keeps working),
runs the job with the app host's file names, puts the app host's input paths back into the sidecar
(`restore_sidecar_paths`: a result reads as if made locally) and streams the files back as `FileChunk` messages
before the terminal `JobFinished`. `ReceivedFiles` writes them on the app host (staged: all appear or none). Nothing
here imports Ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from h3engine.errors import RequestError
from h3engine.media.outputs import OutputFiles, StagedOutputs
from h3engine.request.model import GenerationRequest
from h3engine.runtime.messages import JobFinished

CHUNK_BYTES = 4 << 20
FileRole = Literal["video", "sidecar", "tensors"]


@dataclass(frozen=True)
class InputFile:
    """An input file of the request: its path on the app host and its bytes."""

    path: str
    sha256: str
    data: bytes = dataclasses.field(repr=False)


@dataclass(frozen=True)
class RayJob:
    job_id: str
    request: GenerationRequest  # its paths are the app host's
    inputs: tuple[InputFile, ...]
    video_name: str  # the MP4's file name on the app host (the sidecar records it)
    tensors_name: str | None
    replica_index: int
    preview_every: int


@dataclass(frozen=True)
class FileChunk:
    """A piece of one of the job's output files, in order."""

    job_id: str
    role: FileRole
    data: bytes = dataclasses.field(repr=False)


def _input_paths(request: GenerationRequest) -> list[tuple[str, str]]:
    """(field, path) of every input file the request names."""
    entries = [(f"keyframes[{i}].path", keyframe.path) for i, keyframe in enumerate(request.keyframes)]
    entries += [(f"references[{i}].path", reference.path) for i, reference in enumerate(request.references)]
    entries += [(f"loras[{i}].path", lora.path) for i, lora in enumerate(request.loras)]
    return entries


def pack_job(
    job_id: str,
    request: GenerationRequest,
    files: OutputFiles,
    replica_index: int,
    preview_every: int,
) -> RayJob:
    """The job as it travels to a replica; RequestError naming the field when an input file cannot be read."""
    inputs: dict[str, InputFile] = {}
    for field, path in _input_paths(request):
        if path in inputs:
            continue
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise RequestError(field, f"cannot read {os.path.basename(path)!r} ({error.strerror})") from None
        inputs[path] = InputFile(path, hashlib.sha256(data).hexdigest(), data)
    return RayJob(
        job_id,
        request,
        tuple(inputs.values()),
        files.video.name,
        files.tensors.name if files.tensors is not None else None,
        replica_index,
        preview_every,
    )


def unpack_inputs(job: RayJob, folder: Path) -> tuple[GenerationRequest, dict[str, str]]:
    """Write the job's inputs under `folder` (one subfolder per content hash, the file's own name kept); the request
    naming them, and each local path -> the app host's path."""
    local: dict[str, str] = {}
    for item in job.inputs:
        target = folder / item.sha256 / os.path.basename(item.path)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            partial.write_bytes(item.data)
            os.replace(partial, target)
        local[item.path] = str(target)
    request = job.request
    request = dataclasses.replace(
        request,
        keyframes=tuple(dataclasses.replace(k, path=local[k.path]) for k in request.keyframes),
        references=tuple(dataclasses.replace(r, path=local[r.path]) for r in request.references),
        loras=tuple(dataclasses.replace(lora, path=local[lora.path]) for lora in request.loras),
    )
    return request, {path: original for original, path in local.items()}


def file_chunks(job_id: str, files: OutputFiles) -> Iterator[FileChunk]:
    """The job's written files as chunks (the video, the tensors, the sidecar last)."""
    roles: list[tuple[FileRole, Path | None]] = [
        ("video", files.video),
        ("tensors", files.tensors),
        ("sidecar", files.sidecar),
    ]
    for role, path in roles:
        if path is None:
            continue
        with open(path, "rb") as handle:
            while block := handle.read(CHUNK_BYTES):
                yield FileChunk(job_id, role, block)


def _with_paths(value: Any, paths: dict[str, str]) -> Any:
    if isinstance(value, str):
        return paths.get(value, value)
    if isinstance(value, list):
        return [_with_paths(item, paths) for item in value]
    if isinstance(value, dict):
        return {key: _with_paths(item, paths) for key, item in value.items()}
    return value


def restore_sidecar_paths(sidecar: bytes, paths: dict[str, str]) -> bytes:
    """The sidecar with every replica-side input path replaced by the app host's (the same JSON layout)."""
    if not paths:
        return sidecar
    restored = _with_paths(json.loads(sidecar), paths)
    return (json.dumps(restored, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


class ReceivedFiles:
    """The app host's side of a job's `FileChunk`s: staging files, committed by `finish` (else discarded)."""

    def __init__(self, files: OutputFiles) -> None:
        self._staging = StagedOutputs(files)
        self._handles: dict[FileRole, Any] = {}

    def write(self, chunk: FileChunk) -> None:
        if chunk.role not in self._handles:
            target = getattr(self._staging.files, chunk.role)
            if target is None:
                raise ValueError("the replica sent tensors that were not asked for")
            self._handles[chunk.role] = open(target, "wb")  # noqa: SIM115 - closed in finish / discard
        self._handles[chunk.role].write(chunk.data)

    def _close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def finish(self, finished: JobFinished) -> JobFinished:
        """Commit every file; `finished` naming them on the app host."""
        self._close()
        final = self._staging.commit()
        return dataclasses.replace(finished, video_path=str(final.video), sidecar_path=str(final.sidecar))

    def discard(self) -> None:
        self._close()
        self._staging.discard()
