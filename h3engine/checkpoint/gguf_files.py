"""Reading one GGUF weight file (the community's quantized H3 files): its tensor records, and each tensor as float32.

Contract: `GGUFFile.open(path)` parses the header with gguf-py's `GGUFReader` over a memory map of the file (no
tensor data is read or copied at open) and lists every tensor as a `GGUFTensor` record: its name, ggml type (id
and name), torch shape (the reverse of the `ne` dims GGUF stores), byte offset and size in the file, and `raw`, a
zero-copy uint8 view of its bytes in the map. Quantized data stays quantized until `tensor(name)` dequantizes it
to float32 (h3engine.checkpoint.gguf_blocks). Single-file community layouts prefix every DiT key with
`model.diffusion_model.`; names are given without it. The file's `general.architecture` is `architecture`.

Refusals are CheckpointErrors naming the file: not a GGUF file (magic), a truncated or corrupt header or data
section, a big-endian file, a tensor name not in the file, and, when read (`tensor`, `check_supported`), a
ggml type gguf_blocks does not decode, by name ('IQ2_XS') with the tensor's name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from h3engine.checkpoint import gguf_blocks
from h3engine.checkpoint.safetensors_io import read_only_tensor
from h3engine.errors import CheckpointError

if TYPE_CHECKING:  # gguf-py is imported when a file is opened
    from gguf import GGUFReader, ReaderTensor

# The key prefix of the single-file (ComfyUI) layout, stripped from tensor names.
DIFFUSION_MODEL_PREFIX = "model.diffusion_model."
ARCHITECTURE_KEY = "general.architecture"
# Set (to "hole") in a placeholder's header (h3engine.checkpoint.gguf_write.write_gguf_placeholder): its data reads as zeros.
PLACEHOLDER_KEY = "h3.placeholder"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as stored: `raw` is the uint8 view of its `nbytes` bytes at `offset` of the file."""

    name: str  # without DIFFUSION_MODEL_PREFIX
    stored_name: str  # as the file spells it
    ggml_type: int
    type_name: str  # 'Q8_0', 'IQ2_XS', ...
    shape: tuple[int, ...]  # torch's: reversed GGUF dims
    offset: int  # absolute byte offset in the file
    nbytes: int
    raw: Tensor

    @property
    def supported(self) -> bool:
        """Whether gguf_blocks decodes this tensor's type."""
        return gguf_blocks.supported_type(self.ggml_type) is not None


class GGUFFile:
    """The tensors of one GGUF file, read lazily from its memory map."""

    def __init__(
        self, path: Path, tensors: dict[str, GGUFTensor], architecture: str | None, placeholder: bool = False
    ) -> None:
        self.path = path
        self.tensors = tensors
        self.architecture = architecture
        self.placeholder = placeholder  # a placeholder's hole of zeros, not weights

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        """Parse `path`'s header and list its tensors; nothing of their data is read."""
        path = Path(path)
        size = _checked_magic(path)
        reader = _reader(path, size)
        if reader.byte_order != "I":
            raise CheckpointError(f"{path}: GGUF file of the other byte order (big-endian) is not supported")
        tensors: dict[str, GGUFTensor] = {}
        for entry in reader.tensors:
            record = _record(path, reader, entry)
            if record.name in tensors:
                raise CheckpointError(
                    f"{path}: tensor {record.name!r} is stored twice ({tensors[record.name].stored_name!r} and "
                    f"{record.stored_name!r})"
                )
            tensors[record.name] = record
        return cls(
            path,
            tensors,
            _string_field(reader, ARCHITECTURE_KEY),
            _string_field(reader, PLACEHOLDER_KEY) is not None,
        )

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def record(self, name: str) -> GGUFTensor:
        """The record of tensor `name` (with or without DIFFUSION_MODEL_PREFIX)."""
        record = self.tensors.get(name.removeprefix(DIFFUSION_MODEL_PREFIX))
        if record is None:
            raise CheckpointError(
                f"{self.path}: missing tensor {name!r} (the file holds {len(self.tensors)})"
            )
        return record

    def check_supported(self) -> None:
        """Refuse the file if any tensor's type is not decoded here (the first one, named with its type)."""
        for record in self.tensors.values():
            if not record.supported:
                self.tensor(record.name)

    def tensor(self, name: str) -> Tensor:
        """Tensor `name` dequantized to float32, on the CPU, in its torch shape."""
        record = self.record(name)
        try:
            return gguf_blocks.dequantize(record.raw, record.ggml_type, record.shape, record.stored_name)
        except CheckpointError as error:
            raise CheckpointError(f"{self.path}: {error}") from None


def _checked_magic(path: Path) -> int:
    """The file's size, once its first 4 bytes are GGUF's magic."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable file ({error})") from None
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    return size


def _reader(path: Path, size: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        # A read-only map commits no memory (a copy-on-write map larger than RAM is refused); loaders copy.
        return GGUFReader(path, mode="r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as error:
        # gguf-py reads past the end as short arrays, which fail to parse or to take their tensor's shape.
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({size} bytes; {error})") from None


def _record(path: Path, reader: GGUFReader, entry: ReaderTensor) -> GGUFTensor:
    stored_name = entry.name
    ggml_type = int(entry.tensor_type)
    shape = tuple(int(size) for size in reversed(entry.shape.tolist()))
    nbytes = int(entry.n_bytes)
    offset = int(entry.data_offset)
    if offset + nbytes > reader.data.shape[0]:
        raise CheckpointError(
            f"{path}: truncated GGUF file: tensor {stored_name!r} ends at byte {offset + nbytes}, the file has "
            f"{reader.data.shape[0]}"
        )
    raw = read_only_tensor(reader.data[offset : offset + nbytes])
    return GGUFTensor(
        name=stored_name.removeprefix(DIFFUSION_MODEL_PREFIX),
        stored_name=stored_name,
        ggml_type=ggml_type,
        type_name=gguf_blocks.ggml_type_name(ggml_type),
        shape=shape,
        offset=offset,
        nbytes=nbytes,
        raw=raw,
    )


def _string_field(reader: GGUFReader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except (ValueError, UnicodeDecodeError, IndexError):
        return None
    return value if isinstance(value, str) else None
