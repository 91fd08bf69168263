"""ComfyUI NVFP4 single files (comfy_quant "nvfp4", comfy-kitchen's layout): the math, the block-scale swizzle, and a
DiT whose linears stay NVFP4 (StoredLinear: packed codes, row-major e4m3 block scales, a global scale).

References: the published formula written here independently (codes decoded by table, the high nibble first, the
block scales found by index arithmetic in cuBLAS' 128x4 layout, the products in float64 rounded once to float32);
the published swizzle as its reshape chain; the same file's values dequantized and stored as f32 (the engine then
holds plain linears of those values cast once, as a StoredLinear casts its float32 dequantization once, so outputs
are compared for equality). How it breaks: the nibbles swapped, the block scales read unswizzled or transposed, the
global scale left out or applied twice, a stream or a LoRA that loses the block scales.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dit_files import engine, equal_outputs
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import small_lora, write_lora
from _runtime_helpers import parity_requests
from _wide_dit import write_wide_checkpoint
from safetensors.torch import save_file
from test_gguf_dit import module_state

from h3engine.checkpoint import nvfp4
from h3engine.checkpoint.layout import detect_layout, with_dit_files
from h3engine.checkpoint.loader import dit_source, read_dit_config
from h3engine.checkpoint.lora_format import read_lora
from h3engine.checkpoint.single_files import SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.engine.lora.adapters import Adapter, apply_adapters
from h3engine.errors import CheckpointError
from h3engine.models.stored_linear import StoredLinear, WeightForm

# e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0 (bias 1; exponent 0 is subnormal: mantissa x 0.5).
TABLE = [
    (-1.0 if code & 8 else 1.0)
    * (0.5 * (code & 1) if not (code >> 1) & 3 else 2.0 ** (((code >> 1) & 3) - 1) * (1 + 0.5 * (code & 1)))
    for code in range(16)
]


def published_blocked(scales: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's `to_blocked(flatten=False)` as its reshape chain: pad to 128 x 4 tiles, then rearrange."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(row_tiles * 128, col_tiles * 4, dtype=torch.uint8)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiles = padded.view(row_tiles, 128, col_tiles, 4).permute(0, 2, 1, 3)
    chained = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return chained.reshape(row_tiles * 128, col_tiles * 4).view(scales.dtype)


def published_value(packed, blocked, global_scale, r: int, k: int) -> float:
    """One weight value by the published formula, in float64."""
    byte = int(packed[r, k // 2])
    code = byte >> 4 if k % 2 == 0 else byte & 0x0F
    c = k // 16
    col_tiles = blocked.shape[1] // 4
    index = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    scale = float(blocked.reshape(-1)[index].to(torch.float32))
    return TABLE[code] * scale * float(global_scale)


def random_nvfp4(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=generator)
    shape = nvfp4.blocked_shape(rows, columns // 16)
    # e4m3 bytes 0x00-0x7E: the positive finite values and zero (0x7F is NaN).
    blocked = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn)
    return packed, blocked, torch.tensor(0.0123, dtype=torch.float32)


def test_the_twin_is_the_published_formula() -> None:
    rows, columns = 130, 96  # a partial 128-row tile, 6 blocks a row (padded to 8)
    packed, blocked, global_scale = random_nvfp4(rows, columns, seed=3)
    scales = nvfp4.unswizzle_block_scales(blocked, rows, columns // 16)
    got = nvfp4.dequantize_nvfp4(packed, scales, global_scale)
    expected = torch.tensor(
        [[published_value(packed, blocked, global_scale, r, k) for k in range(columns)] for r in range(rows)],
        dtype=torch.float64,
    )
    assert torch.equal(got, expected.to(torch.float32))
    assert torch.equal(
        nvfp4.dequantize_nvfp4(packed, scales, global_scale, torch.bfloat16), got.to(torch.bfloat16)
    )
    # Rows are independent: a row range of the bytes and scales is that row range of the weight.
    assert torch.equal(nvfp4.dequantize_nvfp4(packed[7:9], scales[7:9], global_scale), got[7:9])


def test_the_swizzle_is_the_published_one_and_round_trips() -> None:
    generator = torch.Generator().manual_seed(4)
    for rows, blocks in ((128, 4), (130, 6), (5, 18), (300, 3)):
        scales = torch.randint(1, 0x7F, (rows, blocks), dtype=torch.uint8, generator=generator)
        scales = scales.view(torch.float8_e4m3fn)
        stored = nvfp4.swizzle_block_scales(scales)
        assert stored.dtype == torch.float8_e4m3fn and tuple(stored.shape) == nvfp4.blocked_shape(
            rows, blocks
        )
        assert torch.equal(stored.view(torch.uint8), published_blocked(scales).view(torch.uint8))
        back = nvfp4.unswizzle_block_scales(stored, rows, blocks)
        assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def test_packing_and_rounding() -> None:
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert nvfp4.pack_codes(codes).tolist() == [[0x12, 0xF8]]  # column 2j in the high nibble
    assert torch.equal(nvfp4.unpack_codes(nvfp4.pack_codes(codes)), codes)
    # Midpoints go to the even code; the sign is bit 3.
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.3, -6.0])
    assert nvfp4.round_to_e2m1(values).tolist() == [0, 2, 2, 4, 4, 6, 6, 14, 1, 15]


def test_quantize_then_dequantize_keeps_the_nearest_values() -> None:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    packed, blocked, global_scale = nvfp4.quantize_nvfp4(weight)
    assert torch.equal(global_scale, weight.abs().max() / (448 * 6))
    scales = nvfp4.unswizzle_block_scales(blocked, 48, 4)
    back = nvfp4.dequantize_nvfp4(packed, scales, global_scale)
    step = (scales.to(torch.float32) * global_scale).repeat_interleave(16, dim=1)
    assert (
        (back - weight).abs() <= step + 1e-6
    ).all()  # within the widest e2m1 gap's half (2 / 2) of the step
    assert ((back - weight).abs() / weight.abs().max()).mean() < 0.1


def test_a_stored_linear_holds_the_bytes_and_computes_the_twin() -> None:
    packed, blocked, global_scale = random_nvfp4(32, 64, seed=5)
    scales = nvfp4.unswizzle_block_scales(blocked, 32, 4)
    linear = StoredLinear(64, 32, WeightForm.nvfp4_form(), dtype=torch.float32)
    assert StoredLinear.STORED_TENSORS == ("quantized", "scale", "block_scale")
    linear.load_state_dict(
        {
            "quantized": packed,
            "scale": global_scale.reshape(1),
            "block_scale": scales,
            "bias": torch.zeros(32),
        }
    )
    assert [name for name, _ in linear.named_buffers()] == ["quantized", "scale", "block_scale"]
    assert torch.equal(linear.weight, nvfp4.dequantize_nvfp4(packed, scales, global_scale))
    assert torch.equal(linear.weight_from(*linear.stored()), linear.weight)
    with pytest.raises(CheckpointError, match="whole blocks of 16"):
        StoredLinear(40, 8, WeightForm.nvfp4_form(), name="x.weight")


# --------------------------------------------------------------------------------------------------------------
# A DiT file
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("nvfp4")
    checkpoint = write_wide_checkpoint(tiny_checkpoints("native", seed=7), folder / "checkpoint")
    state = {k: v for k, v in module_state(checkpoint).items() if k != "rope.inv_freq"}
    made = {
        "checkpoint": checkpoint,
        "nvfp4": folder / "nvfp4.safetensors",
        "f32": folder / "f32.safetensors",
    }
    stored = write_single_file(made["nvfp4"], state, "nvfp4", input_scale=0.25)
    assert "nvfp4" in stored.values() and "keep" in stored.values()  # condition_proj (8 wide) stays bf16
    single = SingleFile.open(made["nvfp4"])
    write_single_file(made["f32"], {name: single.tensor(name) for name in single.records}, "f32")
    return made


def test_the_file_holds_the_published_layout(files) -> None:
    from safetensors import safe_open

    with safe_open(str(files["nvfp4"]), "pt") as handle:
        prefix = "model.diffusion_model.blocks.0.mlp.fc1"
        weight, blocks = handle.get_tensor(f"{prefix}.weight"), handle.get_tensor(f"{prefix}.weight_scale")
        global_scale = handle.get_tensor(f"{prefix}.weight_scale_2")
        config = json.loads(bytes(handle.get_tensor(f"{prefix}.comfy_quant").tolist()))
    assert config == {"format": "nvfp4"} and global_scale.dtype == torch.float32 and global_scale.shape == ()
    rows, half = weight.shape
    assert weight.dtype == torch.uint8 and blocks.dtype == torch.float8_e4m3fn
    assert tuple(blocks.shape) == (-(-rows // 128) * 128, -(-(half * 2 // 16) // 4) * 4)
    read = SingleFile.open(files["nvfp4"]).tensor("blocks.0.mlp.fc1.weight")
    for r, k in ((0, 0), (1, 17), (rows - 1, half * 2 - 1), (rows // 2, 33)):
        assert read[r, k].item() == pytest.approx(
            published_value(weight, blocks, global_scale, r, k), rel=1e-7
        )


def test_an_nvfp4_dit_computes_what_its_dequantized_weights_compute(files) -> None:
    quantized, reference = engine(files, "nvfp4"), engine(files, "f32")
    dit = quantized.store.models_for_task("t2va").dit
    stored = [m for m in dit.modules() if isinstance(m, StoredLinear)]
    assert stored and all(m.form.nvfp4 and m.block_scale.dtype == torch.float8_e4m3fn for m in stored)
    assert not any(isinstance(m, StoredLinear) for m in reference.store.models_for_task("t2va").dit.modules())
    request = parity_requests(steps=2, seed=5)["t2va"]
    expected, _ = reference.generate(request)
    got, _ = quantized.generate(request)
    assert equal_outputs(got, expected)
    streamed = engine(files, "nvfp4", memory_profile="streamed", host_memory=1e-6)
    assert equal_outputs(streamed.generate(request)[0], expected)
    stream = streamed.placement.stream_of(streamed.store.models_for_task("t2va").dit)
    names = {placed.name for layer in stream.tensors for placed in layer}
    assert {"quantized", "scale", "block_scale"} <= names  # the ring carries the bytes and both scales


def test_a_lora_beside_nvfp4_weights_equals_the_lora_on_the_dequantized_base(files, tmp_path) -> None:
    layout = detect_layout(files["checkpoint"])
    config = read_dit_config(layout, layout.partitions["fl2va"])
    path = tmp_path / "style.safetensors"
    write_lora(path, small_lora(config, seed=5), "ours", config)
    adapter = Adapter(read_lora(path))
    request = tiny_fl2va_request(config, torch.bfloat16, seed=9).as_h3_arguments()
    outputs = {}
    for name in ("nvfp4", "f32"):
        replaced = with_dit_files(layout, {"fl2va": files[name]})
        model = dit_source(replaced, replaced.partitions["fl2va"], torch.bfloat16).load(torch.device("cpu"))
        with torch.no_grad():
            plain = model(*request)
            apply_adapters(model, [adapter])
            outputs[name] = model(*request)
        assert not torch.equal(outputs[name][0], plain[0])
        assert any(isinstance(m, StoredLinear) for m in model.modules()) == (name == "nvfp4")
    assert all(torch.equal(a, b) for a, b in zip(outputs["nvfp4"], outputs["f32"], strict=True))


# --------------------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------------------


def _config(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


def test_other_block_formats_stay_refused_by_name(tmp_path) -> None:
    p = "model.diffusion_model."
    tensors = {
        f"{p}a.weight": torch.zeros(8, 32, dtype=torch.float8_e4m3fn),
        f"{p}a.weight_scale": torch.zeros(8, 1, dtype=torch.uint8),
        f"{p}a.comfy_quant": _config("mxfp8"),
        f"{p}b.weight": torch.zeros(8, 16, dtype=torch.uint8),
        f"{p}b.comfy_quant": _config("convrot_w4a4"),
        f"{p}c.weight": torch.zeros(8, 16, dtype=torch.int32),
        f"{p}c.comfy_quant": _config("awq_w4a16"),
    }
    path = tmp_path / "others.safetensors"
    save_file(tensors, str(path))
    single = SingleFile.open(path)
    for name, fmt in (("a", "mxfp8"), ("b", "convrot_w4a4"), ("c", "awq_w4a16")):
        assert single.record(f"{name}.weight").format == fmt
        with pytest.raises(CheckpointError, match=rf"stored as {fmt}: a format this reader does not decode"):
            single.tensor(f"{name}.weight")


def test_malformed_nvfp4_layers_are_refused_at_open(tmp_path) -> None:
    packed, blocked, global_scale = random_nvfp4(8, 32, seed=1)
    good = {"weight": packed, "weight_scale": blocked, "weight_scale_2": global_scale}
    cases = {
        "awq": ({**good, "pre_quant_scale": torch.ones(32)}, r"carries \['pre_quant_scale'\] \(NVFP4-AWQ"),
        "no_global": ({k: v for k, v in good.items() if k != "weight_scale_2"}, "has no weight_scale_2"),
        "unpadded": (
            {**good, "weight_scale": blocked[:8, :2].contiguous()},
            r"stores float8_e4m3fn \[128, 4\]",
        ),
        "not_bytes": ({**good, "weight": packed.to(torch.int8)}, "its nvfp4 config stores uint8"),
    }
    for case, (parts, message) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file({**{f"l.{k}": v for k, v in parts.items()}, "l.comfy_quant": _config("nvfp4")}, str(path))
        with pytest.raises(CheckpointError, match=message):
            SingleFile.open(path)
    # A uint8 view of the block scales (as some writers store them) reads as e4m3.
    path = tmp_path / "u8.safetensors"
    save_file(
        {
            "l.weight": packed,
            "l.weight_scale": blocked.view(torch.uint8),
            "l.weight_scale_2": global_scale,
            "l.comfy_quant": _config("nvfp4"),
        },
        str(path),
    )
    scales = nvfp4.unswizzle_block_scales(blocked, 8, 2)
    assert torch.equal(
        SingleFile.open(path).tensor("l.weight"), nvfp4.dequantize_nvfp4(packed, scales, global_scale)
    )
