"""Strict, lazy reading of (sharded) safetensors weight folders.

Contract: a `WeightFiles` is opened from a single `.safetensors` file or a `*.safetensors.index.json`; opening
reads only the JSON headers, and checks that every shard the index names exists, that each header parses and
that each file is as long as its header says (a truncated download fails here, naming the file). Tensors are read
one at a time through `safe_open`, whole (`tensor`) or as a slice (`row_slice`, for a tensor-parallel rank that
needs only its rows), so nothing is loaded before it is asked for.

Danger: a released checkpoint is 66 GB per DiT partition; never materialize the whole state dict on the host when
the target is a GPU — read tensor by tensor straight to the device.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from h3engine.errors import CheckpointError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def placed(tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`, always as a new contiguous allocation of its own.

    A tensor read from a file can start at any 8-byte offset of a read buffer, and `.to()` keeps it there when device
    and dtype already match. CPU GEMM libraries choose kernels by alignment, so such a weight can round differently
    from the same values loaded another way (another layout, another rank plan); a fresh allocation makes every
    loaded weight's memory layout the same whatever its path from the file.
    """
    return torch.empty(tensor.shape, dtype=dtype, device=device).copy_(tensor)


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds all the bytes it promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors header")
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")

    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{key}'") from None
        infos[key] = TensorInfo(path, dtype, shape)
        data_end = max(data_end, end)
        if end < begin:
            raise CheckpointError(f"{path}: corrupt offsets for tensor '{key}'")
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path}: truncated file ({size} bytes on disk, header describes {8 + header_len + data_end})"
        )
    return infos


class WeightFiles:
    """The tensors of one component, spread over one or several safetensors files."""

    def __init__(self, infos: dict[str, TensorInfo], description: str) -> None:
        self.infos = infos
        self.description = description
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, path: Path) -> WeightFiles:
        """Open `model.safetensors`, an index json, or a folder holding exactly one of the two."""
        path = Path(path)
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            singles = sorted(path.glob("*.safetensors"))
            if len(indexes) == 1:
                path = indexes[0]
            elif len(singles) == 1:
                path = singles[0]
            else:
                raise CheckpointError(
                    f"{path}: expected one safetensors file or one index, found none or several"
                )
        if path.name.endswith(".index.json"):
            return cls._open_index(path)
        return cls(read_header(path), str(path))

    @classmethod
    def _open_index(cls, index_path: Path) -> WeightFiles:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except FileNotFoundError:
            raise CheckpointError(f"{index_path}: file is missing") from None
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: unreadable index ({error})") from None
        headers: dict[str, dict[str, TensorInfo]] = {}
        infos: dict[str, TensorInfo] = {}
        for key, shard_name in weight_map.items():
            if (
                not isinstance(shard_name, str)
                or Path(shard_name).name != shard_name
                or shard_name in ("", "..", ".")
            ):
                raise CheckpointError(
                    f"{index_path}: tensor '{key}' points to an invalid shard name {shard_name!r}"
                )
            if shard_name not in headers:
                try:
                    headers[shard_name] = read_header(index_path.parent / shard_name)
                except CheckpointError as error:
                    raise CheckpointError(f"{error} (the index places tensor '{key}' in it)") from None
            shard = headers[shard_name]
            if key not in shard:
                raise CheckpointError(
                    f"{index_path.parent / shard_name}: missing tensor '{key}' named by the index"
                )
            infos[key] = shard[key]
        for shard_name, shard in headers.items():
            for key in shard:
                if key not in weight_map:
                    raise CheckpointError(
                        f"{index_path.parent / shard_name}: tensor '{key}' is not listed in {index_path.name}"
                    )
        return cls(infos, str(index_path))

    def check(
        self,
        expected_shapes: Mapping[str, tuple[int, ...]],
        ignored: Iterable[str] = (),
    ) -> None:
        """Fail unless the files hold exactly the expected tensors (plus `ignored` ones) with the expected shapes."""
        ignored = set(ignored)
        for key, shape in expected_shapes.items():
            info = self.infos.get(key)
            if info is None:
                raise CheckpointError(f"{self.description}: missing tensor '{key}'")
            if info.shape != tuple(shape):
                raise CheckpointError(
                    f"{info.file}: tensor '{key}' has shape {list(info.shape)}, expected {list(shape)}"
                )
        for key, info in self.infos.items():
            if key not in expected_shapes and key not in ignored:
                raise CheckpointError(f"{info.file}: unexpected tensor '{key}'")

    def _handle(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"{file}: unreadable safetensors file ({error})") from None
            self._handles[file] = handle
        return handle

    def tensor(self, key: str) -> torch.Tensor:
        """Read one whole tensor (on the CPU, in its stored dtype)."""
        info = self.infos.get(key)
        if info is None:
            raise CheckpointError(f"{self.description}: missing tensor '{key}'")
        return self._handle(info.file).get_tensor(key)

    def row_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Read rows [start, stop) of a tensor without reading the rest of it."""
        info = self.infos[key]
        return self._handle(info.file).get_slice(key)[start:stop]

    def column_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Read columns [start, stop) of a 2-D tensor: each row's contiguous run of bytes, nothing else."""
        info = self.infos[key]
        return self._handle(info.file).get_slice(key)[:, start:stop]

    def close(self) -> None:
        self._handles.clear()
