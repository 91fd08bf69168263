"""Strict, lazy reading of (sharded) safetensors weight folders.

Contract: a `WeightFiles` is opened from a single `.safetensors` file or a `*.safetensors.index.json`; opening
reads only the JSON headers, and checks that every shard the index names exists, that each header parses and
that each file is as long as its header says (a truncated download fails here, naming the file). Tensors are read
one at a time through `safe_open`, whole (`tensor`) or as a slice (`row_slice`, for a tensor-parallel rank that
needs only its rows), so nothing is loaded before it is asked for. A placeholder file (header only, its data a hole)
hands out drawn values instead (`placeholder_values`): h3engine.checkpoint.placeholder writes them; one whose drawn
values were written as real bytes is read like any file, and still counts as a placeholder (`WeightFiles.placeholder`).

Danger: a released checkpoint is 66 GB per DiT partition; never materialize the whole state dict on the host when
the target is a GPU — read tensor by tensor straight to the device.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from h3engine.checkpoint.fp8_rows import dequantize_rows, quantize_rows
from h3engine.errors import CheckpointError

# safetensors' dtype names and the torch dtypes they are (DTYPE_NAMES: the other way).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The key of a weight's FP8 row scales beside it (h3engine.checkpoint.fp8_files.SCALE_SUFFIX).
FP8_SCALE_SUFFIX = "_scale"
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def read_only_tensor(array: Any) -> torch.Tensor:
    """A torch view of a read-only numpy array (a file mapped read-only, which commits no memory however large the
    file: a copy-on-write map of a file larger than RAM is refused). Nothing may write to it: loaders copy."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def placed(tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`, always as a new contiguous allocation of its own.

    A tensor read from a file can start at any 8-byte offset of a read buffer, and `.to()` keeps it there when device
    and dtype already match. CPU GEMM libraries choose kernels by alignment, so such a weight can round differently
    from the same values loaded another way (another layout, another rank plan); a fresh allocation makes every
    loaded weight's memory layout the same whatever its path from the file.
    """
    return torch.empty(tensor.shape, dtype=dtype, device=device).copy_(tensor)


def parked(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of `shape` and `dtype` backed by one element (a broadcast NaN for floats, so that a stray read
    shows): what a parameter holds while its values wait elsewhere (a deferred read, a streamed layer between
    visits)."""
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full((), fill, dtype=dtype, device=device).expand(torch.Size(shape))


def is_parked(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a `parked` one (more than one element, all of them the same memory)."""
    return tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())


class DeferredReads:
    """Module keys a loader is asked to leave unread, and how to read each one again.

    For a key it `wants`, a loader installs a `parked` tensor of the module's shape and dtype and `add`s a reader
    that returns the module's tensor (its shard, renamed and reordered as loading would) on the host, from the
    memory-mapped checkpoint file (a placeholder file draws it again): a layer streamed from mapped files reads
    through it at every visit (h3engine.memory.streaming).
    """

    def __init__(self, keys: Iterable[str], remember: Iterable[str] = ()) -> None:
        self.keys = frozenset(keys)
        # Keys a loader reads as usual but also gives a reader for (a resident layer that may stream later).
        self.remembered = frozenset(remember) - self.keys
        self.readers: dict[str, Callable[[], torch.Tensor]] = {}
        # Key -> the file extents that hold its bytes as the module has them (absent: read through the reader).
        self.extents: dict[str, tuple[FileExtent, ...]] = {}
        # Key of a weight the files store in FP8 -> (a reader of its e4m3 values and fp32 row scales in the module's
        # row order, the extents of the values, those of the scales; None where they must go through the reader).
        self.fp8: dict[str, tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Any, Any]] = {}

    def wants(self, key: str) -> bool:
        return key in self.keys

    def remembers(self, key: str) -> bool:
        return key in self.remembered

    def add(
        self,
        key: str,
        reader: Callable[[], torch.Tensor],
        extents: tuple[FileExtent, ...] | None = None,
        fp8: tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Any, Any] | None = None,
    ) -> None:
        self.readers[key] = reader
        if extents is not None:
            self.extents[key] = extents
        if fp8 is not None:
            self.fp8[key] = fp8


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    # A placeholder file's seed: its values are drawn, not read (`placeholder_values`).
    placeholder_seed: int | None = None
    # Where the tensor's bytes start in the file (-1: unknown, e.g. a view that renames another file's tensors).
    offset: int = -1
    # A placeholder's drawn values written as real bytes (PLACEHOLDER_VALUES_KEY): read as stored, outputs noise.
    drawn: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FileExtent:
    """A run of a tensor's bytes in a file: `length` bytes at `offset` of `path`, which go to byte `target` of the
    tensor as the module holds it (a reader thread copies them straight into a buffer, h3engine.memory.streaming)."""

    path: Path
    offset: int
    length: int
    target: int


def row_extents(
    info: TensorInfo, dtype: torch.dtype, blocks: Sequence[tuple[int, int, int]] | None = None
) -> tuple[FileExtent, ...] | None:
    """The extents of a 2-D (or 1-D) tensor read as `dtype` whose rows come from `info`'s rows as `blocks` says
    ((file row, rows, module row) each; None: all rows in order). None where the file's bytes are not the module's:
    another dtype (a cast), an unknown offset, or a placeholder (its values are drawn, not stored)."""
    if info.dtype != dtype or info.offset < 0 or info.placeholder_seed is not None:
        return None
    rows = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // max(1, rows)
    if blocks is None:
        return (FileExtent(info.file, info.offset, info.nbytes, 0),)
    return tuple(
        FileExtent(info.file, info.offset + source * row_bytes, count * row_bytes, target * row_bytes)
        for source, count, target in blocks
    )


def read_raw_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(the header as parsed, the byte where the data starts, the file's size) of one safetensors file; the header
    bytes checked against the file (CheckpointError naming it), the entries not."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header; {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors header ({header_len} bytes announced, the file "
                    f"has {size})"
                )
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + header_len, size


def encoded_header(
    ordered: Sequence[tuple[str, tuple[int, ...], torch.dtype]], metadata: Mapping[str, str]
) -> tuple[bytes, int]:
    """(the length prefix and header of a safetensors file holding `ordered` (key, shape, dtype) in that order,
    padded to 8 bytes; the bytes of its data)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, shape, dtype in ordered:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, offset


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds all the bytes it promises."""
    header, base, size = read_raw_header(path)
    header_len = base - 8

    infos: dict[str, TensorInfo] = {}
    placeholder_seed = _placeholder_seed(path, header.get("__metadata__"))
    drawn = _drawn(header.get("__metadata__"))
    data_end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{key}'") from None
        infos[key] = TensorInfo(path, dtype, shape, placeholder_seed, 8 + header_len + begin, drawn)
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
        # A weight stored in FP8 (h3engine.checkpoint.fp8_files) with its row scales: the scales are no tensor of
        # the module; reading the weight dequantizes it (`tensor`, the slices), `fp8` gives both as stored.
        self.scales = {
            key.removesuffix(FP8_SCALE_SUFFIX): info
            for key, info in infos.items()
            if key.endswith(FP8_SCALE_SUFFIX)
            and key.removesuffix(FP8_SCALE_SUFFIX) in infos
            and infos[key.removesuffix(FP8_SCALE_SUFFIX)].dtype == torch.float8_e4m3fn
        }
        scale_keys = {key + FP8_SCALE_SUFFIX for key in self.scales}
        self.infos = {key: info for key, info in infos.items() if key not in scale_keys}
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
        """Read one whole tensor (on the CPU, in its stored dtype; a weight stored in FP8 dequantized to fp32)."""
        if key not in self.infos:
            raise CheckpointError(f"{self.description}: missing tensor '{key}'")
        return self._read(key)

    def row_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Read rows [start, stop) of a tensor without reading the rest of it."""
        return self._read(key, rows=slice(start, stop))

    def column_slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Read columns [start, stop) of a 2-D tensor: each row's contiguous run of bytes, nothing else."""
        return self._read(key, columns=slice(start, stop))

    def fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(e4m3 values, fp32 row scales [rows, 1]) of a weight stored in FP8, as stored; None for any other."""
        return self._fp8(key) if key in self.scales else None

    def _read(self, key: str, rows: slice | None = None, columns: slice | None = None) -> torch.Tensor:
        if key in self.scales:
            values, scales = self._fp8(key, rows, columns)
            return dequantize_rows(values, scales)
        return self._stored(key, self.infos[key], rows, columns)

    def _stored(
        self, key: str, info: TensorInfo, rows: slice | None = None, columns: slice | None = None
    ) -> torch.Tensor:
        if info.placeholder_seed is not None:
            tensor = placeholder_values(key, info)
        elif rows is None and columns is None:
            return self._handle(info.file).get_tensor(key)
        else:
            tensor = self._handle(info.file).get_slice(key)
        if rows is not None:
            return tensor[rows]
        return tensor[:, columns] if columns is not None else tensor

    def _fp8(
        self, key: str, rows: slice | None = None, columns: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        info = self.infos[key]
        if info.placeholder_seed is None:
            scales = self._stored(key + FP8_SCALE_SUFFIX, self.scales[key], rows)
            return self._stored(key, info, rows, columns), scales.to(torch.float32).view(-1, 1)
        # A placeholder stands for the quantized form of the bf16 placeholder's values.
        drawn = placeholder_values(
            key, TensorInfo(info.file, torch.bfloat16, info.shape, info.placeholder_seed)
        )
        values, scales = quantize_rows(drawn)
        values, scales = (values[rows], scales[rows]) if rows is not None else (values, scales)
        return (values[:, columns] if columns is not None else values), scales

    @property
    def stores_fp8(self) -> bool:
        """Whether some weights are stored in FP8 (h3engine.checkpoint.fp8_files)."""
        return bool(self.scales)

    @property
    def placeholder(self) -> bool:
        """Whether these are placeholder files (h3engine.checkpoint.placeholder): values drawn at load, or drawn
        when the files were written and stored as real bytes."""
        return any(info.placeholder_seed is not None or info.drawn for info in self.infos.values())

    def close(self) -> None:
        self._handles.clear()


# --- placeholder files ------------------------------------------------------------------------------------------
# A placeholder file (h3engine.checkpoint.placeholder) is a real header, `__metadata__[PLACEHOLDER_KEY]` = a seed,
# followed by a data region the file's length covers but nothing was written to (a hole in a sparse file). A
# real-bytes one holds those drawn values as data and says so with `__metadata__[PLACEHOLDER_VALUES_KEY]` = "drawn"
# instead: no seed, so that its bytes are read (and streamed from their extents) as a released file's are.

PLACEHOLDER_KEY = "h3_placeholder_seed"
PLACEHOLDER_VALUES_KEY = "h3_placeholder_values"
PLACEHOLDER_DRAWN = "drawn"
# Drawing 60 GB of normal values on the host would take minutes: each tensor repeats one draw of this (prime) length.
_PLACEHOLDER_PERIOD = 1_000_003


def _placeholder_seed(path: Path, metadata: object) -> int | None:
    if not isinstance(metadata, dict) or PLACEHOLDER_KEY not in metadata:
        return None
    try:
        return int(metadata[PLACEHOLDER_KEY])
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt {PLACEHOLDER_KEY} metadata") from None


def _drawn(metadata: object) -> bool:
    return isinstance(metadata, dict) and metadata.get(PLACEHOLDER_VALUES_KEY) == PLACEHOLDER_DRAWN


def write_tensor_file(
    path: Path,
    specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    values: Callable[[str], torch.Tensor] | None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """A safetensors file of `specs` (key, shape, dtype), written a tensor at a time: the header first, then each
    tensor's bytes as `values(key)` makes it (on the host, that shape and dtype), so that a file of any size is written
    holding one tensor. `values` None leaves the data a hole (a placeholder: h3engine.checkpoint.placeholder). Keys go
    in sorted order, as safetensors writes them."""
    ordered = sorted(specs)
    encoded, data_bytes = encoded_header(ordered, {"format": "pt", **(metadata or {})})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(encoded)
        if values is None:
            handle.truncate(len(encoded) + data_bytes)
            return
        for key, shape, dtype in ordered:
            tensor = values(key)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"{key}: made {tensor.dtype} {list(tensor.shape)}, declared {dtype} {list(shape)}"
                )
            handle.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))


def write_placeholder_file(
    path: Path, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], seed: int
) -> None:
    """A safetensors header for `shapes` (key -> (shape, dtype)) whose data is a hole: no byte of it is written."""
    specs = [(key, tuple(shape), dtype) for key, (shape, dtype) in shapes.items()]
    write_tensor_file(path, specs, None, {PLACEHOLDER_KEY: str(seed)})


def placeholder_values(key: str, info: TensorInfo) -> torch.Tensor:
    """The values a placeholder file stands for, on the CPU like a read tensor (so loading allocates as a real
    checkpoint does): a draw seeded by the file's seed and the key's name (every rank and every slice agrees),
    repeated with a prime period, scaled so activations stay O(1): matrices N(0, 1/fan_in), biases N(0, 0.1^2),
    other vectors 1 + N(0, 0.1^2) (gains); integer tensors are zero."""
    count = math.prod(info.shape)
    values = torch.zeros(count, dtype=info.dtype)
    if not info.dtype.is_floating_point or count == 0:
        return values.view(info.shape)
    # The host generator keeps 32 bits of a seed: the file's seed and the key are hashed together into those.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{info.placeholder_seed}:{key}".encode()))
    period = min(count, _PLACEHOLDER_PERIOD)
    pattern = torch.randn(period, generator=generator)
    if len(info.shape) >= 2:
        pattern /= math.sqrt(math.prod(info.shape[1:]))
    elif key.endswith(".bias"):
        pattern *= 0.1
    else:
        pattern = 1.0 + 0.1 * pattern
    pattern = pattern.to(info.dtype)
    for start in range(0, count, period):
        stop = min(start + period, count)
        values[start:stop] = pattern[: stop - start]
    return values.view(info.shape)
