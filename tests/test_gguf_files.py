"""GGUF weight files: h3engine.checkpoint.gguf_write writes them, h3engine.checkpoint.gguf_files reads them back.

Data: the tiny checkpoint's FL2VA DiT tensors (read from its safetensors), plus one probe tensor whose blocks the
DiT lacks (all zeros, one outlier, values so small the fp16 scale is subnormal). Each is written in every writable
type, with and without the single-file `model.diffusion_model.` prefix, and must read back under its own name and
shape: F32 / F16 / BF16 exactly (the same cast as torch's), quantized types exactly as gguf-py's
`gguf.quants.dequantize` decodes the same bytes, and within the type's rounding of the original. Q4_1 / Q5_1 are
written (gguf-py quantizes them) but not read: reading refuses them by name. Refusals name the file, and the tensor
and its type where one is at fault.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file
from torch import Tensor

from h3engine.checkpoint.gguf_files import DIFFUSION_MODEL_PREFIX, GGUFFile
from h3engine.checkpoint.gguf_write import KEPT_TYPE, WRITABLE_TYPES, stored_type, write_gguf
from h3engine.errors import CheckpointError

READ_QUANTIZED = ("Q8_0", "Q5_0", "Q4_0")
UNREAD = ("Q4_1", "Q5_1")
PREFIXES = ("", DIFFUSION_MODEL_PREFIX)

# Rounding of a block of 32 values with amax = max |x| (gguf-py's quantizers, as ggml's reference ones):
# * Q8_0: d = amax / 127, q = round(x / d): |q| <= 127, so no clipping, |x - d q| <= d / 2.
# * Q5_0 / Q4_0: d = -m / 16 (or / 8), m the block's value of largest magnitude, q = trunc(x / d + 16.5) clipped to
#   [0, 31] (Q4_0: + 8.5, [0, 15]): x / d lies in [-16, 16]; only x = -m (x / d = 16) clips, to 15, one step off;
#   every other value rounds to nearest, |x - d (q - 16)| <= |d| / 2. So the bound is one step, amax / 16 (amax / 8).
# The scale is stored in fp16, which moves d by at most half an fp16 ulp: d * 2^-11 for normal values, 2^-25 below
# 2^-14 (subnormals); the dequantizer multiplies that error by |q - zero| <= 127 (16, 8). The quantizer's float32
# products (x * (1 / d)) add a relative error of a few 2^-24, covered by a 2^-16 step slack.
# type: (amax divisor giving the step, largest |q - zero|, steps of rounding error)
ROUNDING = {"Q8_0": (127.0, 127.0, 0.5), "Q5_0": (16.0, 16.0, 1.0), "Q4_0": (8.0, 8.0, 1.0)}
BLOCK = 32


@pytest.fixture(scope="module")
def dit_tensors(tiny_native: Path) -> dict[str, Tensor]:
    """The FL2VA DiT's tensors as its safetensors shards hold them, plus the probe tensor."""
    state: dict[str, Tensor] = {}
    for shard in sorted((tiny_native / "FL2VA" / "transformer").glob("*.safetensors")):
        state.update(load_file(shard))
    assert len(state) > 40
    probe = torch.randn(4, 96, generator=torch.Generator().manual_seed(49))
    probe[0] = 0.0
    probe[1, 5] = 40.0
    probe[2] *= 1e-6
    state["probe.weight"] = probe.to(torch.bfloat16)
    return state


def written(path: Path, state: dict[str, Tensor], kind: str, prefix: str) -> tuple[GGUFFile, dict[str, str]]:
    stored = write_gguf(path, {prefix + name: value for name, value in state.items()}, kind)
    return GGUFFile.open(path), {name.removeprefix(prefix): kind for name, kind in stored.items()}


def rounding_bound(original: Tensor, kind: str) -> Tensor:
    """The largest |dequantized - original| each value may show in `kind` (see ROUNDING), per value."""
    divisor, largest_q, steps = ROUNDING[kind]
    blocks = original.float().reshape(-1, BLOCK)
    step = blocks.abs().amax(dim=1, keepdim=True) / divisor
    fp16_error = torch.clamp(step * 2.0**-11, min=2.0**-25)
    bound = steps * step + largest_q * fp16_error + step * 2.0**-16
    return bound.expand_as(blocks).reshape(original.shape)


@pytest.mark.parametrize("prefix", PREFIXES, ids=["plain", "prefixed"])
@pytest.mark.parametrize("kind", WRITABLE_TYPES)
def test_every_tensor_reads_back(
    tmp_path: Path, dit_tensors: dict[str, Tensor], kind: str, prefix: str
) -> None:
    gguf_file, stored = written(tmp_path / "dit.gguf", dit_tensors, kind, prefix)
    assert gguf_file.architecture == "h3"
    assert list(gguf_file) == list(dit_tensors)
    # Some of the DiT's 2-D tensors have whole blocks, so the asked type is really used.
    assert kind in stored.values() and set(stored.values()) <= {kind, KEPT_TYPE}
    for name, original in dit_tensors.items():
        record = gguf_file.record(name)
        assert (record.name, record.stored_name) == (name, prefix + name)
        assert record.shape == tuple(original.shape)
        assert record.type_name == stored[name] == stored_type(original, kind)
        assert gguf_file.record(prefix + name) is record
        if stored[name] in UNREAD:
            continue
        values = gguf_file.tensor(name)
        assert values.dtype == torch.float32 and values.shape == original.shape
        if stored[name] in ("F32", "F16", "BF16"):
            cast = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[stored[name]]
            torch.testing.assert_close(values, original.to(cast).float(), rtol=0, atol=0)
            continue
        oracle = quants.dequantize(record.raw.numpy(), GGMLQuantizationType[stored[name]])
        torch.testing.assert_close(values, torch.from_numpy(oracle).reshape(original.shape), rtol=0, atol=0)
        error = (values - original.float()).abs()
        assert bool((error <= rounding_bound(original, stored[name])).all()), (name, float(error.max()))


def test_records_are_views_of_the_mapped_file(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    path = tmp_path / "dit.gguf"
    gguf_file, _ = written(path, dit_tensors, "Q8_0", DIFFUSION_MODEL_PREFIX)
    data = path.read_bytes()
    records = [gguf_file.record(name) for name in gguf_file]
    first = records[0]
    for record in records:
        assert record.raw.dtype == torch.uint8 and record.raw.numel() == record.nbytes
        assert bytes(record.raw.numpy()) == data[record.offset : record.offset + record.nbytes]
        # One mapping of the whole file: each view sits at its file offset from the others (no copies).
        assert record.raw.data_ptr() - first.raw.data_ptr() == record.offset - first.offset
        assert record.offset % 32 == 0  # GGUF's default data alignment


def test_unread_types_are_refused_by_name(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    path = tmp_path / "q41.gguf"
    gguf_file, stored = written(path, dit_tensors, "Q4_1", "")
    name = next(name for name, kind in stored.items() if kind == "Q4_1")
    for read in (lambda: gguf_file.tensor(name), gguf_file.check_supported):
        with pytest.raises(
            CheckpointError,
            match=rf"q41\.gguf: GGUF tensor '{re.escape(name)}': ggml type Q4_1 \(id 3\) is not",
        ):
            read()
    assert not gguf_file.record(name).supported

    # A type gguf-py cannot quantize, written as raw blocks (IQ2_XS: 74 bytes per 256 values).
    path = tmp_path / "iq2.gguf"
    writer = GGUFWriter(path, "h3")
    writer.add_tensor(
        "model.diffusion_model.blocks.0.attn.qkv_proj.weight",
        np.zeros((2, 74), np.uint8),
        raw_dtype=GGMLQuantizationType.IQ2_XS,
    )
    writer.add_tensor("norm.weight", np.ones(8, np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    gguf_file = GGUFFile.open(path)
    record = gguf_file.record("blocks.0.attn.qkv_proj.weight")
    assert (record.type_name, record.shape, record.nbytes) == ("IQ2_XS", (2, 256), 148)
    assert torch.equal(gguf_file.tensor("norm.weight"), torch.ones(8))
    for read in (lambda: gguf_file.tensor("blocks.0.attn.qkv_proj.weight"), gguf_file.check_supported):
        with pytest.raises(
            CheckpointError,
            match=r"iq2\.gguf: GGUF tensor 'model\.diffusion_model\.blocks\.0\.attn\.qkv_proj\.weight': ggml type IQ2_XS",
        ):
            read()


def test_files_that_are_not_gguf_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("a text file, not weights\n")
    with pytest.raises(CheckpointError, match=r"notes\.gguf: not a GGUF file"):
        GGUFFile.open(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.gguf: not a GGUF file"):
        GGUFFile.open(empty)
    with pytest.raises(CheckpointError, match=r"absent\.gguf: file is missing"):
        GGUFFile.open(tmp_path / "absent.gguf")


def test_truncated_and_corrupt_files_are_refused(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, dit_tensors, "Q8_0")
    data = whole.read_bytes()
    records = GGUFFile.open(whole).tensors.values()
    data_end = max(record.offset + record.nbytes for record in records)
    cut = tmp_path / "cut.gguf"
    # In the fixed header, the metadata, the tensor infos, the data, the last tensor's last byte (the file may go on
    # with alignment padding).
    for length in (8, 30, 120, len(data) // 2, data_end - 1):
        cut.write_bytes(data[:length])
        with pytest.raises(
            CheckpointError, match=rf"cut\.gguf: truncated or corrupt GGUF file \({length} bytes"
        ):
            GGUFFile.open(cut)

    # A type id gguf-py does not know, patched into the first tensor's info: name (u64 length, bytes), n_dims
    # (u32), dims (u64 each), then the type (u32).
    name = next(iter(dit_tensors)).encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    patched = bytearray(data)
    struct.pack_into("<I", patched, at + 4 + 8 * n_dims, 1000)
    corrupt = tmp_path / "patched.gguf"
    corrupt.write_bytes(bytes(patched))
    with pytest.raises(CheckpointError, match=r"patched\.gguf: truncated or corrupt GGUF file .*1000"):
        GGUFFile.open(corrupt)


def test_missing_tensor_names_the_file(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    gguf_file, _ = written(tmp_path / "dit.gguf", dit_tensors, "F16", DIFFUSION_MODEL_PREFIX)
    reads: list[Callable[[], object]] = [
        lambda: gguf_file.tensor("blocks.9.attn.qkv_proj.weight"),
        lambda: gguf_file.record("blocks.9.attn.qkv_proj.weight"),
    ]
    for read in reads:
        with pytest.raises(
            CheckpointError, match=r"dit\.gguf: missing tensor 'blocks\.9\.attn\.qkv_proj\.weight'"
        ):
            read()
    assert "blocks.9.attn.qkv_proj.weight" not in gguf_file and "probe.weight" in gguf_file


def test_writer_refusals(tmp_path: Path) -> None:
    weight = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="'Q4_K' cannot be written"):
        write_gguf(tmp_path / "k.gguf", {"w": weight}, "Q4_K")
    with pytest.raises(ValueError, match=r"types names tensors not given: \['v'\]"):
        write_gguf(tmp_path / "k.gguf", {"w": weight}, {"v": "Q8_0"})
    with pytest.raises(ValueError, match="floating-point"):
        write_gguf(tmp_path / "k.gguf", {"w": torch.zeros(4, 32, dtype=torch.int32)}, "F32")
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    # A per-tensor map: absent names stay F32, 1-D tensors and partial blocks F32 whatever is asked.
    stored = write_gguf(
        tmp_path / "mixed.gguf",
        {"w": weight, "b": torch.zeros(32), "odd": torch.zeros(4, 48), "x": weight},
        {"w": "Q8_0", "b": "BF16", "odd": "Q4_0"},
    )
    assert stored == {"w": "Q8_0", "b": "F32", "odd": "F32", "x": "F32"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mixed.gguf"]
