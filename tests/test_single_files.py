"""ComfyUI-style single safetensors files: h3engine.checkpoint.single_files_write writes them, single_files reads them.

Data: the tiny checkpoint's FL2VA DiT tensors (read from its safetensors) plus probe matrices the DiT lacks: one with a
zero row, an outlier and tiny values, and one of 512 columns for ConvRot's default 256-column groups. Each format is
written with and without the `model.diffusion_model.` prefix and must read back under its own name and shape, equal
(bit for bit, in float32) to the published math computed here from the stored bytes: values * scale for the scaled
fp8 and int8 layouts, and for ConvRot the dequantized rows rotated back by the regular Hadamard built here from its
entries (a product of 4x4 blocks over base-4 digits). The reads are also within each format's rounding of the
original. Refusals name the file, and the tensor and its format where one is at fault.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from h3engine.checkpoint import single_file_formats, single_files_write
from h3engine.checkpoint.single_file_formats import StoredTensor, dequantize_stored, regular_hadamard
from h3engine.checkpoint.single_files import DIFFUSION_MODEL_PREFIX, SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.errors import CheckpointError

PREFIXES = ("", DIFFUSION_MODEL_PREFIX)
TINY_GROUP = 16  # the tiny DiT's 16- and 32-column matrices are whole groups of it
H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


@pytest.fixture(scope="module")
def dit_tensors(tiny_native: Path) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for shard in sorted((tiny_native / "FL2VA" / "transformer").glob("*.safetensors")):
        state.update(load_file(shard))
    assert len(state) > 40
    generator = torch.Generator().manual_seed(7)
    probe = torch.randn(6, 32, generator=generator)
    probe[0] = 0.0
    probe[1, 5] = 40.0
    probe[2] *= 1e-6
    state["probe.weight"] = probe.to(torch.bfloat16)
    state["wide.weight"] = (torch.randn(8, 512, generator=generator) * 0.02).to(torch.bfloat16)
    return state


def hadamard_from_entries(size: int) -> Tensor:
    """The normalized regular Hadamard, entry by entry: the product of H4 over the base-4 digits of (row, column)."""
    digits = round(math.log(size, 4))
    matrix = torch.empty(size, size)
    for row in range(size):
        for column in range(size):
            sign = 1
            for d in range(digits):
                sign *= H4[(row // 4**d) % 4][(column // 4**d) % 4]
            matrix[row, column] = sign
    return matrix / 2**digits


def published(record: StoredTensor) -> Tensor:
    """The format's math, straight from the stored tensors."""
    values = record.values
    assert values is not None
    if record.format in ("f32", "f16", "bf16", "f64", "fp8_e4m3", "fp8_e5m2"):
        return values.float()
    scale = record.scale
    assert scale is not None
    if scale.numel() == 1:
        weight = values.float() * scale.float().reshape(())
    else:
        weight = values.float() * scale.float().reshape(-1, 1)
    if record.format != "int8_convrot":
        return weight
    group = record.convrot_group
    assert group is not None
    rows, columns = weight.shape
    hadamard = hadamard_from_entries(group)
    return (weight.reshape(rows, columns // group, group) @ hadamard.T).reshape(rows, columns)


def within_rounding(record: StoredTensor, read: Tensor, original: Tensor) -> bool:
    """Whether `read` lies within the format's rounding of `original`."""
    original = original.float()
    error = (read - original).abs()
    if record.format in ("fp8_e4m3_scaled", "fp8_e4m3"):
        scale = 1.0 if record.scale is None else float(record.scale)
        # 3 mantissa bits: half a step is 2^-4 of the value; subnormals step 2^-9 (in units of the scale).
        return bool((error <= original.abs() * 2**-4 + scale * 2**-10 + 1e-30).all())
    if record.format in ("int8_tensorwise", "int8_rowwise"):
        assert record.scale is not None
        step = record.scale.float().reshape(-1, 1) if record.scale.numel() > 1 else record.scale.float()
        return bool((error <= step / 2 * (1 + 2**-16) + 1e-37).all())
    if record.format == "int8_convrot":
        # Orthogonal rotation: each row's error norm is the quantized (rotated) row's, at most sqrt(K) half steps.
        assert record.scale is not None
        row_error = torch.linalg.vector_norm(read - original, dim=1)
        bound = record.scale.float().reshape(-1) / 2 * math.sqrt(original.shape[1]) * (1 + 2**-10)
        return bool((row_error <= bound + 1e-6).all())
    cast = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[record.format]
    return torch.equal(read, original.to(cast).float())


def written(path: Path, state: dict[str, Tensor], fmt: str | dict[str, str], prefix: str, **options: object):
    stored = write_single_file(path, state, fmt, prefix=prefix, **options)  # type: ignore[arg-type]
    return SingleFile.open(path), stored


FORMATS = [
    ("bf16", {}),
    ("f16", {}),
    ("f32", {}),
    ("fp8_e4m3", {}),
    ("fp8_e4m3_scaled", {}),
    ("fp8_e4m3_scaled", {"fp8_layout": "legacy", "input_scale": 0.25}),
    ("fp8_e4m3_scaled", {"configs_in": "metadata", "input_scale": 0.5}),
    ("int8_tensorwise", {}),
    ("int8_rowwise", {}),
    ("int8_convrot", {"convrot_group": TINY_GROUP}),
    ("int8_convrot", {}),
    ("int8_convrot", {"convrot_group": TINY_GROUP, "configs_in": "metadata"}),
]


@pytest.mark.parametrize("prefix", PREFIXES, ids=["plain", "prefixed"])
@pytest.mark.parametrize(
    ("fmt", "options"), FORMATS, ids=[f"{f}-{'-'.join(o) or 'default'}" for f, o in FORMATS]
)
def test_every_tensor_reads_back(
    tmp_path: Path, dit_tensors: dict[str, Tensor], fmt: str, options: dict, prefix: str
) -> None:
    single, stored = written(tmp_path / "dit.safetensors", dit_tensors, fmt, prefix, **options)
    assert set(single) == set(dit_tensors) and len(single) == len(dit_tensors)
    # The asked format is really used; the tensors it does not apply to keep their dtype.
    assert fmt in stored.values() and set(stored.values()) <= {fmt, "keep"}
    if fmt == "int8_convrot":
        group = options.get("convrot_group", 256)
        assert {name for name, kind in stored.items() if kind == fmt} == {
            name
            for name, tensor in dit_tensors.items()
            if name.endswith(".weight") and tensor.dim() == 2 and tensor.shape[1] % group == 0
        }
    assert single.marker == ("F8_E4M3" if options.get("fp8_layout") == "legacy" else None)
    for name, original in dit_tensors.items():
        record = single.record(name)
        assert (record.name, record.stored_name) == (name, prefix + name)
        assert single.record(prefix + name) is record and (prefix + name) in single
        assert record.shape == tuple(original.shape) and record.supported
        kept = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[original.dtype]
        assert record.format == (kept if stored[name] == "keep" else stored[name])
        read = single.tensor(name)
        assert read.dtype == torch.float32 and read.shape == original.shape
        torch.testing.assert_close(read, published(record), rtol=0, atol=0)
        assert within_rounding(record, read, original), (name, record.format)
        if record.format in ("fp8_e4m3_scaled",):
            expected_input = options.get("input_scale")
            if expected_input is None:
                assert record.input_scale is None
            else:
                assert float(record.input_scale) == expected_input  # kept, never applied
        if record.format == "int8_convrot":
            assert record.convrot_group == options.get("convrot_group", 256)
            assert record.config == {
                "format": "int8_tensorwise",
                "convrot": True,
                "convrot_groupsize": record.convrot_group,
            }
            assert record.scale is not None and record.scale.shape == (original.shape[0], 1)
    single.check_supported()
    # safetensors' own reader agrees with the stored views (the file is a valid safetensors file).
    raw = load_file(tmp_path / "dit.safetensors")
    for name in dit_tensors:
        record = single.record(name)
        assert torch.equal(raw[prefix + name].view(torch.uint8), record.values.view(torch.uint8))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dit.safetensors"]


def test_hadamard_and_out_dtype(dit_tensors: dict[str, Tensor], tmp_path: Path) -> None:
    for size in (4, 16, 64, 256):
        hadamard = regular_hadamard(size)
        assert torch.equal(hadamard, hadamard_from_entries(size)) and torch.equal(hadamard, hadamard.T)
        assert torch.equal(hadamard @ hadamard.T, torch.eye(size))
    for size in (2, 8, 32, 128, 0, 3):
        with pytest.raises(ValueError, match="power of 4"):
            regular_hadamard(size)
    single, _ = written(tmp_path / "q.safetensors", dit_tensors, "int8_convrot", "", convrot_group=TINY_GROUP)
    for name in ("blocks.0.attn.qkv_proj.weight", "wide.weight", "final_layer.video_out.bias"):
        record = single.record(name)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            # fp32 math, then one rounding.
            assert torch.equal(dequantize_stored(record, dtype), single.tensor(name).to(dtype))
            assert torch.equal(single.tensor(name, dtype), single.tensor(name).to(dtype))


@pytest.mark.cuda
def test_dequantize_on_the_gpu(dit_tensors: dict[str, Tensor], tmp_path: Path) -> None:
    mixed = {"blocks.0.attn.qkv_proj.weight": "int8_convrot", "blocks.0.mlp.fc1.weight": "fp8_e4m3_scaled"}
    single, _ = written(tmp_path / "q.safetensors", dit_tensors, mixed, "", convrot_group=TINY_GROUP)
    for name in (*mixed, "blocks.0.norm1.weight", "wide.weight"):
        record = single.record(name).moved("cuda")
        assert record.values is not None and record.values.is_cuda
        on_gpu = dequantize_stored(record, torch.bfloat16)
        assert on_gpu.is_cuda and on_gpu.dtype == torch.bfloat16
        # The rotation's sums may round in another order on the GPU: within a bf16 rounding.
        torch.testing.assert_close(on_gpu.cpu().float(), single.tensor(name), rtol=2**-7, atol=1e-6)


def test_records_are_views_of_the_mapped_file(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    path = tmp_path / "dit.safetensors"
    single, _ = written(path, dit_tensors, "int8_convrot", DIFFUSION_MODEL_PREFIX, convrot_group=TINY_GROUP)
    data = path.read_bytes()
    base = single.record("blocks.0.attn.qkv_proj.weight")
    assert base.values is not None
    base_pointer = base.values.data_ptr() - base.part("values").offset
    for name in single:
        record = single.record(name)
        for part in record.parts:
            extent = record.extent(part.role)
            assert (extent.path, extent.offset, extent.length) == (path, part.offset, part.nbytes)
            # Safetensors' order keeps every tensor at an offset aligned to its element size.
            assert part.offset % max(1, {"F32": 4, "BF16": 2}.get(part.dtype, 1)) == 0
        for role, tensor in (("values", record.values), ("scale", record.scale)):
            if tensor is None:
                continue
            part = record.part(role)
            assert (
                bytes(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())
                == data[part.offset : part.offset + part.nbytes]
            )
            # One mapping of the whole file: each view sits at its file offset (no copies).
            assert tensor.data_ptr() - base_pointer == part.offset
    # The map is read-only (it commits no memory, however large the file): nothing can write through a view.
    pointer = single._data.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
        if start <= pointer < end:
            assert line.split()[1].startswith("r-"), line  # mapped without write permission
            break
    else:
        raise AssertionError("the file's map is not among the process's mappings")


def test_qkv_rows_are_not_reordered(tmp_path: Path) -> None:
    # Rows told apart by where and how large their one value is come back in the stacked [q; k; v] order stored.
    rows = torch.zeros(48, 16)
    rows[torch.arange(48), torch.arange(48) % 16] = 1.0 + torch.arange(48) // 16
    name = "blocks.0.attn.qkv_proj.weight"
    for fmt in ("bf16", "int8_rowwise", "fp8_e4m3_scaled"):
        single, _ = written(tmp_path / f"{fmt}.safetensors", {name: rows}, fmt, DIFFUSION_MODEL_PREFIX)
        nearest = torch.cdist(single.tensor(name), rows).argmin(dim=1)
        assert torch.equal(nearest, torch.arange(48)), fmt


def test_legacy_scaled_fp8_variants(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 16, generator=generator)
    values = (weight * 20).to(torch.float8_e4m3fn)
    per_row = torch.rand(8, 1, generator=generator) + 0.5
    prefix = DIFFUSION_MODEL_PREFIX
    tensors = {
        f"{prefix}a.weight": values.clone(),
        f"{prefix}a.scale_weight": torch.tensor(0.05),
        f"{prefix}a.scale_input": torch.tensor(2.0),
        f"{prefix}a.bias": torch.zeros(8, dtype=torch.bfloat16),
        f"{prefix}b.weight": values.clone(),
        f"{prefix}b.scale_weight": per_row,  # one per row broadcasts as in ComfyUI's weight * scale_weight
        f"{prefix}c.weight": values.clone(),
        f"{prefix}c.scale_weight": torch.tensor([0.125]),
        f"{prefix}d.weight": values.clone(),  # no scale: a cast (ComfyUI's scale_weight defaults to one)
        f"{prefix}scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),  # 2 elements: full-precision matmul
    }
    path = tmp_path / "legacy.safetensors"
    save_file(tensors, path)
    single = SingleFile.open(path)
    assert single.marker == "F8_E4M3"
    assert sorted(single) == ["a.bias", "a.weight", "b.weight", "c.weight", "d.weight"]
    assert single.formats() == {"bf16": 1, "fp8_e4m3_scaled": 3, "fp8_e4m3": 1}
    assert torch.equal(single.tensor("a.weight"), values.float() * 0.05)
    assert float(single.record("a.weight").input_scale) == 2.0
    assert torch.equal(single.tensor("b.weight"), values.float() * per_row)
    assert torch.equal(single.tensor("c.weight"), values.float() * 0.125)
    assert torch.equal(single.tensor("d.weight"), values.float())
    assert [part.role for part in single.record("a.weight").parts] == ["values", "scale", "input_scale"]


def test_mixed_file(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    formats = {
        "blocks.0.attn.qkv_proj.weight": "int8_convrot",
        "blocks.0.attn.out_proj.weight": "fp8_e4m3_scaled",
        "blocks.0.mlp.fc1.weight": "int8_rowwise",
        "blocks.0.mlp.fc2.weight": "int8_tensorwise",
        "blocks.1.mlp.fc1.weight": "fp8_e4m3",
        "blocks.1.mlp.fc2.weight": "bf16",
        "wide.weight": "int8_convrot",
        "final_layer.video_out.weight": "f16",
    }
    single, stored = written(
        tmp_path / "mixed.safetensors", dit_tensors, formats, DIFFUSION_MODEL_PREFIX, convrot_group=TINY_GROUP
    )
    assert {name: kind for name, kind in stored.items() if kind != "keep"} == formats
    for name, original in dit_tensors.items():
        record = single.record(name)
        if name in formats:
            assert record.format == formats[name]
        read = single.tensor(name)
        torch.testing.assert_close(read, published(record), rtol=0, atol=0)
        assert within_rounding(record, read, original), name
    # Configs per layer: the int8 ones as comfy_quant tensors, the fp8 one too; the rest has none.
    assert single.record("blocks.0.attn.out_proj.weight").config == {"format": "float8_e4m3fn"}
    assert single.record("blocks.0.mlp.fc2.weight").config == {"format": "int8_tensorwise"}
    assert single.record("blocks.1.mlp.fc1.weight").config is None
    assert single.formats()["int8_convrot"] == 2


def _layer(prefix: str, layer: str, config: dict | None, **parts: Tensor) -> dict[str, Tensor]:
    tensors = {f"{prefix}{layer}.{name}": tensor for name, tensor in parts.items()}
    if config is not None:
        encoded = list(json.dumps(config).encode())
        tensors[f"{prefix}{layer}.comfy_quant"] = torch.tensor(encoded, dtype=torch.uint8)
    return tensors


def test_unsupported_formats_are_refused_by_name(tmp_path: Path) -> None:
    p = DIFFUSION_MODEL_PREFIX
    tensors = {
        **_layer(
            p,
            "blocks.0.attn.qkv_proj",
            {"format": "convrot_w4a4"},
            weight=torch.zeros(8, 16, dtype=torch.uint8),
            weight_scale=torch.zeros(8, 2, dtype=torch.float8_e4m3fn),
            weight_scale_2=torch.tensor(1.0),
            input_scale=torch.tensor(1.0),
        ),
        **_layer(
            p,
            "blocks.0.mlp.fc1",
            {"format": "mxfp8"},
            weight=torch.zeros(8, 32, dtype=torch.float8_e4m3fn),
            weight_scale=torch.zeros(8, 1, dtype=torch.uint8),
        ),
        **_layer(
            p,
            "blocks.0.mlp.fc2",
            {"format": "asym_w4a8_int8", "group_size": 16},
            weight=torch.zeros(8, 16, dtype=torch.int8),
            weight_s_rel=torch.zeros(8, 2, dtype=torch.uint8),
            weight_s_channel=torch.ones(8, 1),
        ),
        **_layer(
            p, "blocks.1.mlp.fc1", {"format": "int5_magic"}, weight=torch.zeros(8, 32, dtype=torch.int8)
        ),
        f"{p}blocks.1.mlp.fc2.weight": torch.zeros(8, 16, dtype=torch.int8),  # int8 with no config
        f"{p}blocks.0.norm1.weight": torch.ones(16, dtype=torch.bfloat16),
    }
    path = tmp_path / "refused.safetensors"
    save_file(tensors, path)
    single = SingleFile.open(path)
    # Each layer's parts belong to its weight's record: no scale is listed as a tensor of its own.
    assert sorted(single) == [
        "blocks.0.attn.qkv_proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
        "blocks.0.norm1.weight",
        "blocks.1.mlp.fc1.weight",
        "blocks.1.mlp.fc2.weight",
    ]
    record = single.record("blocks.0.attn.qkv_proj.weight")
    assert not record.supported and record.format == "convrot_w4a4"
    assert {part.role for part in record.parts} >= {"values", "config", "weight_scale_2"}
    refusals = {
        "blocks.0.attn.qkv_proj.weight": "convrot_w4a4",
        "blocks.0.mlp.fc1.weight": "mxfp8",
        "blocks.0.mlp.fc2.weight": "asym_w4a8_int8",
        "blocks.1.mlp.fc1.weight": "int5_magic",
        "blocks.1.mlp.fc2.weight": "dtype I8",
    }
    for name, fmt in refusals.items():
        with pytest.raises(
            CheckpointError,
            match=rf"refused\.safetensors: tensor '{re.escape(p + name)}' is stored as {fmt}: .*; not read",
        ):
            single.tensor(name)
        assert single.record(name).format == fmt
    # The first refused tensor in the file's order.
    with pytest.raises(
        CheckpointError, match=r"refused\.safetensors: tensor '.*' is stored as \w+: .*; not read"
    ):
        single.check_supported()
    assert torch.equal(single.tensor("blocks.0.norm1.weight"), torch.ones(16))


INCONSISTENT = [
    # (tensors, the message)
    (
        {"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "a.scale_weight": torch.tensor(1.0)},
        r"'a\.scale_weight' scales 'a\.weight', which is BF16",
    ),
    (
        {"a.scale_weight": torch.tensor(1.0)},
        r"layer 'a' has a scale_weight or scale_input but no tensor 'a\.weight'",
    ),
    (
        _layer("", "a", {"format": "float8_e4m3fn"}),
        r"layer 'a' has a quantization config but no tensor 'a\.weight'",
    ),
    (
        _layer("", "a", {"format": "int8_tensorwise"}, weight=torch.zeros(4, 4, dtype=torch.float8_e4m3fn)),
        r"'a\.weight' is F8_E4M3; its int8_tensorwise config stores I8",
    ),
    (
        _layer("", "a", {"format": "int8_tensorwise"}, weight=torch.zeros(4, 4, dtype=torch.int8)),
        r"int8_tensorwise layer 'a' has no weight_scale",
    ),
    (
        _layer(
            "",
            "a",
            {"format": "float8_e4m3fn"},
            weight=torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
            weight_scale=torch.ones(4, 1),
        ),
        r"scale 'a\.weight_scale' is F32 of shape \[4, 1\]; the layout stores one value in float32",
    ),
    (
        _layer(
            "",
            "a",
            {"format": "int8_tensorwise"},
            weight=torch.zeros(4, 4, dtype=torch.int8),
            weight_scale=torch.ones(1, 4),
        ),
        r"scale 'a\.weight_scale' is F32 of shape \[1, 4\]; the layout stores one value or one per row",
    ),
    (
        _layer(
            "",
            "a",
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 32},
            weight=torch.zeros(4, 64, dtype=torch.int8),
            weight_scale=torch.ones(4, 1),
        ),
        r"ConvRot layer 'a': group size 32 is not a power of 4",
    ),
    (
        _layer(
            "",
            "a",
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "many"},
            weight=torch.zeros(4, 64, dtype=torch.int8),
            weight_scale=torch.ones(4, 1),
        ),
        r"ConvRot layer 'a': group size 'many' is not a power of 4",
    ),
    (
        _layer(
            "",
            "a",
            {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 16}},
            weight=torch.zeros(4, 24, dtype=torch.int8),
            weight_scale=torch.ones(4, 1),
        ),
        r"ConvRot weight 'a\.weight' of shape \[4, 24\] is not a matrix of whole 16-column groups",
    ),
    (
        {"a.weight": torch.zeros(2), "a.comfy_quant": torch.tensor(list(b"{not json"), dtype=torch.uint8)},
        r"corrupt 'a\.comfy_quant'",
    ),
    (
        {"a.weight": torch.zeros(2), DIFFUSION_MODEL_PREFIX + "a.weight": torch.zeros(2)},
        r"tensor 'a\.weight' is stored twice",
    ),
    (
        {
            **_layer(
                "",
                "a",
                {"format": "float8_e4m3fn"},
                weight=torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
                weight_scale=torch.tensor(1.0),
            ),
            "a.scale_input": torch.tensor(1.0),
        },
        r"layer 'a' has both a quantization config and legacy scaled-fp8 scales",
    ),
]


@pytest.mark.parametrize(("tensors", "message"), INCONSISTENT)
def test_inconsistent_layers_are_refused(tmp_path: Path, tensors: dict[str, Tensor], message: str) -> None:
    path = tmp_path / "odd.safetensors"
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"odd\.safetensors: .*" + message):
        SingleFile.open(path)


def test_configs_in_metadata(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    in_tensors, _ = written(tmp_path / "t.safetensors", dit_tensors, "int8_rowwise", DIFFUSION_MODEL_PREFIX)
    in_metadata, _ = written(
        tmp_path / "m.safetensors", dit_tensors, "int8_rowwise", DIFFUSION_MODEL_PREFIX, configs_in="metadata"
    )
    assert "_quantization_metadata" in in_metadata.metadata
    for name in dit_tensors:
        assert in_metadata.record(name).format == in_tensors.record(name).format
        assert torch.equal(in_metadata.tensor(name), in_tensors.tensor(name))
    # A layer whose two configs disagree, and metadata that is not the layers' object.
    tensors = _layer(
        "",
        "a",
        {"format": "int8_tensorwise"},
        weight=torch.zeros(4, 4, dtype=torch.int8),
        weight_scale=torch.tensor(1.0),
    )
    path = tmp_path / "two.safetensors"
    layers = {"layers": {"a": {"format": "float8_e4m3fn"}}}
    save_file(tensors, path, metadata={"_quantization_metadata": json.dumps(layers)})
    with pytest.raises(CheckpointError, match=r"two\.safetensors: layer 'a' has two different configs"):
        SingleFile.open(path)
    save_file(tensors, path, metadata={"_quantization_metadata": json.dumps({"layers": {"a": "nvfp4"}})})
    with pytest.raises(CheckpointError, match=r"two\.safetensors: corrupt _quantization_metadata metadata"):
        SingleFile.open(path)


def test_convrot_group_size_forms(tmp_path: Path) -> None:
    # The group size read as ComfyUI's int() reads it: at the top level or under "params", a number or its digits.
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(4, 32, generator=generator)
    values, scale = single_file_formats.quantize_int8_convrot(weight, 16)
    expected = single_file_formats.rotate_groups(values.float() * scale, 16)
    for config in (
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16.0},
        {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": "16"}},
    ):
        path = tmp_path / "g.safetensors"
        save_file(_layer("", "a", config, weight=values, weight_scale=scale), path)
        single = SingleFile.open(path)
        assert single.record("a.weight").convrot_group == 16
        assert torch.equal(single.tensor("a.weight"), expected)
    # Without a size, ComfyUI's default of 256 columns.
    values, scale = single_file_formats.quantize_int8_convrot(torch.randn(2, 256, generator=generator), 256)
    save_file(
        _layer("", "a", {"format": "int8_tensorwise", "convrot": True}, weight=values, weight_scale=scale),
        path,
    )
    assert SingleFile.open(path).record("a.weight").convrot_group == 256


def test_unaligned_tensors_read_as_copies(tmp_path: Path) -> None:
    # A header placing an F32 tensor at an odd offset (after 3 uint8 bytes), as a hand-made file could.
    values = torch.tensor([1.5, -2.0, 3.25])
    header = {
        "a.comfy": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b.weight": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
    }
    encoded = json.dumps(header).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"xyz" + values.numpy().tobytes())
    single = SingleFile.open(path)
    assert torch.equal(single.tensor("b.weight"), values)
    assert single.record("b.weight").part("values").offset % 4 != 0
    with pytest.raises(CheckpointError, match=r"tensor 'a\.comfy' is stored as dtype U8"):
        single.tensor("a.comfy")


def test_truncated_and_corrupt_files_are_refused(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    whole = tmp_path / "whole.safetensors"
    write_single_file(whole, dit_tensors, "fp8_e4m3_scaled")
    data = whole.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    cut = tmp_path / "cut.safetensors"
    for length, message in (
        (0, r"truncated safetensors file \(no header; 0 bytes\)"),
        (5, r"truncated safetensors file \(no header; 5 bytes\)"),
        (8 + header_len // 2, r"truncated or corrupt safetensors header"),
        (8 + header_len + 1, r"truncated file: tensor '.*' ends at byte"),
        (len(data) - 1, r"truncated file: tensor '.*' ends at byte"),
    ):
        cut.write_bytes(data[:length])
        with pytest.raises(CheckpointError, match=r"cut\.safetensors: " + message):
            SingleFile.open(cut)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(struct.pack("<Q", 10) + b"{not json}" + b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"corrupt\.safetensors: unreadable safetensors file"):
        SingleFile.open(corrupt)
    sized = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    corrupt.write_bytes(struct.pack("<Q", len(sized)) + sized + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'a' holds 8 bytes, its F32 shape \[4\] needs 16"):
        SingleFile.open(corrupt)
    with pytest.raises(CheckpointError, match=r"absent\.safetensors: file is missing"):
        SingleFile.open(tmp_path / "absent.safetensors")


def test_missing_tensor_names_the_file(tmp_path: Path, dit_tensors: dict[str, Tensor]) -> None:
    single, _ = written(tmp_path / "dit.safetensors", dit_tensors, "bf16", DIFFUSION_MODEL_PREFIX)
    for read in (single.tensor, single.record):
        with pytest.raises(
            CheckpointError, match=r"dit\.safetensors: missing tensor 'blocks\.9\.attn\.qkv_proj\.weight'"
        ):
            read("blocks.9.attn.qkv_proj.weight")
    assert "blocks.9.attn.qkv_proj.weight" not in single and "probe.weight" in single


def test_writer_refusals_leave_nothing(
    tmp_path: Path, dit_tensors: dict[str, Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.zeros(4, 32)
    path = tmp_path / "w.safetensors"
    refusals = [
        (lambda: write_single_file(path, {"w.weight": weight}, "mxfp8"), "'mxfp8' cannot be written"),
        (lambda: write_single_file(path, {"w.weight": weight}, {"v": "bf16"}), r"tensors not given: \['v'\]"),
        (
            lambda: write_single_file(path, {"w.weight": weight}, {"w.weight": "int8_convrot"}),
            "32 columns are not whole ConvRot groups of 256",
        ),
        (
            lambda: write_single_file(path, {"w.bias": torch.zeros(4)}, {"w.bias": "int8_rowwise"}),
            r"only floating-point '\.weight' tensors are quantized",
        ),
        (lambda: write_single_file(path, {"w.weight": weight}, "bf16", convrot_group=32), "not a power of 4"),
        (lambda: write_single_file(path, {"w.weight": weight}, "bf16", fp8_layout="v2"), "not a layout"),
    ]
    for write, message in refusals:
        with pytest.raises(ValueError, match=message):
            write()
    # A failure while the data is written leaves no partial file.
    monkeypatch.setattr(
        single_files_write,
        "quantize_int8",
        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom")),
    )
    with pytest.raises(RuntimeError, match="boom"):
        write_single_file(path, dit_tensors, "int8_rowwise")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    # Reading writes nothing beside the file.
    write_single_file(path, dit_tensors, "int8_rowwise")
    single = SingleFile.open(path)
    single.check_supported()
    for name in single:
        single.tensor(name)
    single.close()
    assert len(single) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    assert single_file_formats.SUPPORTED_FORMATS >= set(single_files_write.WRITABLE_FORMATS) - {"keep"}
