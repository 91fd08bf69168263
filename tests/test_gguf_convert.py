"""Converting a released checkpoint's DiT to a community-style GGUF file (h3engine.checkpoint.gguf_convert).

Oracles: gguf-py's GGUFReader and `gguf.quants.dequantize` read the file (names, types, shapes, values bit for bit
as our GGUFFile decodes them); each tensor's values are the source module's (QKV rows stacked) within its type's
bound (tests/test_gguf_quantize.py: RMS error / RMS value on Gaussian rows, which the random DiT weights are); an
Engine on the converted DiT generates exactly what an Engine on the same file's values stored as F32 generates (the
reference of tests/test_gguf_dit.py). The tiny DiT's rows are 8 to 32 wide, so the K-quants fall back to Q8_0 and
F16 there; a DiT of 256- and 512-wide linears (its fc2 288 wide: Q8_0) has real Q4_K / Q6_K blocks written and run.
The native and diffusers layouts of one seed hold the same weights, so they convert to the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _runtime_helpers import parity_requests
from _wide_dit import write_wide_checkpoint
from gguf import GGUFReader, quants
from test_gguf_quantize import BOUNDS

from h3engine.checkpoint import dit_format, gguf_convert, gguf_quantize
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.gguf_blocks import BLOCK_FORMATS, GGMLType
from h3engine.checkpoint.gguf_convert import (
    GGUF_FILES_JSON,
    convert_checkpoint_to_gguf,
    convert_dit_to_gguf,
    tensor_type,
)
from h3engine.checkpoint.gguf_files import DIFFUSION_MODEL_PREFIX, GGUFFile
from h3engine.checkpoint.gguf_write import write_gguf
from h3engine.checkpoint.layout import detect_layout, with_dit_files
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.engine.engine import Engine
from h3engine.errors import CheckpointError
from h3engine.models.dit import FP32_PARAMETER_NAMES
from h3engine.models.stored_linear import StoredLinear

KINDS = ("q8_0", "q6_k", "q4_k")
OUTPUTS = ("video", "audio", "video_latents", "audio_latents")
# bf16 -> fp16 is exact but where a value is below fp16's normal range (6.1e-5).
F16_BOUND = 1e-3


def module_state(folder: Path) -> dict[str, torch.Tensor]:
    """A partition's DiT as the module holds it (QKV rows stacked), float32, from its native folder."""
    layout = detect_layout(folder)
    paths = layout.partitions["fl2va"]
    files = WeightFiles.open(paths.dit)
    config = dit_format.config_from_native(json.loads((paths.dit / "config.json").read_text()))
    native = {key: files.tensor(key).float() for key in files.infos}
    return dit_format.native_to_module(native, config)


def f32_twin(source: Path, target: Path) -> None:
    """The GGUF file `source` with every tensor's values stored as F32 (the reference)."""
    gguf = GGUFFile.open(source)
    write_gguf(
        target, {record.stored_name: gguf.tensor(name) for name, record in gguf.tensors.items()}, "F32"
    )


def relative_error(approximation: torch.Tensor, values: torch.Tensor) -> float:
    return float((approximation - values).square().sum().sqrt() / values.square().sum().sqrt())


def generate(checkpoint: Path, files: dict[str, Path]):  # noqa: ANN201
    layout = with_dit_files(detect_layout(checkpoint), files)
    engine = Engine.from_checkpoint(layout, device="cpu", adaln_cache="off")
    output, _ = engine.generate(parity_requests(steps=2, seed=5)["t2va"])
    return engine, output


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory) -> dict:
    """The tiny checkpoint (seed 7) and its conversion to each kind."""
    checkpoint = tiny_checkpoints("native", seed=7)
    root = tmp_path_factory.mktemp("gguf_convert")
    made = {"checkpoint": checkpoint}
    for kind in KINDS:
        made[kind] = (root / kind, convert_checkpoint_to_gguf(checkpoint, root / kind, kind))
    return made


def check_file(path: Path, state: dict[str, torch.Tensor], conversion: gguf_convert.GGUFConversion) -> None:
    """The file reads back in gguf-py and ours: names, types, values within bounds, the reported errors."""
    reader = GGUFReader(path)
    assert reader.get_field("general.architecture").contents() == "h3"
    expected_names = {DIFFUSION_MODEL_PREFIX + key for key in state if key != ROPE_KEY}
    assert {entry.name for entry in reader.tensors} == expected_names
    ours = GGUFFile.open(path)
    assert ours.architecture == "h3" and ROPE_KEY not in ours
    for entry in reader.tensors:
        key = entry.name.removeprefix(DIFFUSION_MODEL_PREFIX)
        kind = GGMLType(int(entry.tensor_type))
        assert kind.name == conversion.types[key] == ours.record(key).type_name, key
        values = ours.tensor(key)
        theirs = torch.from_numpy(np.array(quants.dequantize(entry.data, entry.tensor_type)))
        assert torch.equal(values.view(torch.int32), theirs.reshape(values.shape).view(torch.int32)), key
        assert values.shape == state[key].shape, key
        error = relative_error(values, state[key])
        assert abs(error - conversion.errors[key]) <= 1e-6 + 1e-4 * error, key
        if kind == GGMLType.F32:
            assert torch.equal(values, state[key]), key
        else:
            assert error < (F16_BOUND if kind == GGMLType.F16 else BOUNDS[kind]), (key, kind.name, error)
    assert conversion.bytes_after == path.stat().st_size


@pytest.mark.parametrize("kind", KINDS)
def test_a_converted_dit_reads_back_within_its_types_bounds(converted, kind) -> None:
    out, conversions = converted[kind]
    state = module_state(converted["checkpoint"])
    assert json.loads((out / GGUF_FILES_JSON).read_text()) == {
        "fl2va": f"fl2va-dit-{kind}.gguf",
        "ref2va": f"ref2va-dit-{kind}.gguf",
    }
    conversion = conversions["fl2va"]
    assert conversion.path == out / f"fl2va-dit-{kind}.gguf"
    check_file(conversion.path, state, conversion)
    # The tiny linears' rows (8 to 32 wide) are not whole 256-blocks: 32-wide rows fall back to Q8_0, the rest F16.
    assert conversion.types["blocks.0.mlp.fc2.weight"] == "Q8_0"
    assert conversion.types["blocks.0.attn.qkv_proj.weight"] == "F16"
    assert all(conversion.types[key] == "F32" for key in FP32_PARAMETER_NAMES - {ROPE_KEY})
    assert all(conversion.types[key] == "F32" for key in state if state[key].dim() == 1 and key != ROPE_KEY)
    source_bytes = WeightFiles.open(detect_layout(converted["checkpoint"]).partitions["fl2va"].dit).infos
    assert conversion.bytes_before == sum(
        info.nbytes for key, info in source_bytes.items() if key != ROPE_KEY
    )


@pytest.mark.parametrize("kind", KINDS)
def test_the_converted_folder_links_the_rest_and_holds_no_dit_weights(converted, kind) -> None:
    out, _ = converted[kind]
    source = converted["checkpoint"]
    for path in source.rglob("*"):
        target = out / path.relative_to(source)
        if path.is_dir():
            continue
        if path.parent.name == "transformer" and path.name != "config.json":
            assert not target.exists(), target
        else:
            assert target.stat().st_ino == path.stat().st_ino, target  # a hard link
    names = {path.name for path in out.iterdir()}
    assert names == {"FL2VA", "Ref2VA", GGUF_FILES_JSON, f"fl2va-dit-{kind}.gguf", f"ref2va-dit-{kind}.gguf"}


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_on_the_converted_dit_computes_what_its_values_compute(converted, kind, tmp_path) -> None:
    out, _ = converted[kind]
    files = {
        partition: out / name for partition, name in json.loads((out / GGUF_FILES_JSON).read_text()).items()
    }
    twins = {partition: tmp_path / f"{partition}-f32.gguf" for partition in files}
    for partition, file in files.items():
        f32_twin(file, twins[partition])
    # The source checkpoint with its DiTs replaced (the converted folder: the next test).
    engine, got = generate(converted["checkpoint"], files)
    stored = [m for m in engine.store.models_for_task("t2va").dit.modules() if isinstance(m, StoredLinear)]
    assert stored and all(module.quantized.dtype == torch.uint8 for module in stored)
    _, expected = generate(converted["checkpoint"], twins)
    assert all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)


def test_the_converted_folder_loads_as_it_is(converted, capsys) -> None:
    """Its gguf_files.json puts each partition's GGUF file in place (no --dit needed): the engine on the folder alone
    computes what the source checkpoint computes with those files; the CLI writes the same folder."""
    out, _ = converted["q8_0"]
    listed = json.loads((out / GGUF_FILES_JSON).read_text())
    layout = detect_layout(out)
    assert {partition: paths.dit_weights for partition, paths in layout.partitions.items()} == {
        partition: out / name for partition, name in listed.items()
    }
    engine = Engine.from_checkpoint(out, device="cpu", adaln_cache="off")
    got, _ = engine.generate(parity_requests(steps=2, seed=5)["t2va"])
    _, expected = generate(converted["checkpoint"], {p: out / name for p, name in listed.items()})
    assert all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)
    from h3engine.cli.main import main

    again = out.parent / "q8_0-cli"
    assert (
        main(
            [
                "convert",
                "--checkpoint",
                str(converted["checkpoint"]),
                "--weights",
                "q8_0",
                "--out",
                str(again),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "fl2va DiT:" in printed and "ref2va DiT:" in printed
    assert all((again / name).read_bytes() == (out / name).read_bytes() for name in listed.values())


def test_both_layouts_convert_to_the_same_bytes(tiny_checkpoints, tmp_path) -> None:
    """The diffusers layout (to_q/to_k/to_v, fc1's [value; gate]) is read as native: the same file."""
    written = {}
    for name in ("native", "diffusers"):
        layout = detect_layout(tiny_checkpoints(name, seed=7))
        written[name] = tmp_path / f"{name}.gguf"
        convert_dit_to_gguf(layout, layout.partitions["fl2va"], written[name], "q8_0")
    assert written["native"].read_bytes() == written["diffusers"].read_bytes()


# --------------------------------------------------------------------------------------------------------------
# Wide linears: real K-quant blocks
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny checkpoint with an FL2VA DiT of 256- and 512-wide linears (fc2 288 wide, condition_proj 8)."""
    target = tmp_path_factory.mktemp("wide") / "checkpoint"
    return write_wide_checkpoint(tiny_checkpoints("native", seed=7), target)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_wide_linears_are_written_in_k_quant_blocks_and_run(wide_checkpoint, kind, tmp_path) -> None:
    layout = detect_layout(wide_checkpoint)
    path = tmp_path / f"fl2va-{kind}.gguf"
    conversion = convert_dit_to_gguf(layout, layout.partitions["fl2va"], path, kind)
    name = kind.upper()
    assert sorted(os.listdir(tmp_path)) == [path.name]
    for key in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "adaln_proj.linear"):
        assert conversion.types[f"blocks.1.{key}.weight"] == name, key
    assert conversion.types["blocks.0.mlp.fc2.weight"] == "Q8_0"  # 288 = 9 blocks of 32
    assert conversion.types["condition_proj.weight"] == "F16"
    state = module_state(wide_checkpoint)
    check_file(path, state, conversion)
    quantized = [key for key, value in conversion.types.items() if value == name]
    worst = max(conversion.errors[key] for key in quantized)
    assert worst < BOUNDS[GGMLType[name]]
    # Sizes: the K-quant weights take their bits per value (4.5 or 6.5625 of bf16's 16).
    bits = {"q4_k": 4.5, "q6_k": 6.5625}[kind]
    assert conversion.bytes_after < conversion.bytes_before * (bits / 16 + 0.1)
    twin = tmp_path / "twin.gguf"
    f32_twin(path, twin)
    engine, got = generate(wide_checkpoint, {"fl2va": path})
    layout = BLOCK_FORMATS[GGMLType[name]]
    dit = engine.store.models_for_task("t2va").dit
    stored = [m for m in dit.modules() if isinstance(m, StoredLinear)]
    # Layers holding rows of `kind`'s blocks (their bytes per row are its).
    assert any(m.quantized.shape[1] * layout.block_size == m.in_features * layout.type_size for m in stored)
    _, expected = generate(wide_checkpoint, {"fl2va": twin})
    assert all(torch.equal(getattr(got, field), getattr(expected, field)) for field in OUTPUTS)


# --------------------------------------------------------------------------------------------------------------
# Types, failures and refusals
# --------------------------------------------------------------------------------------------------------------


def test_the_type_of_each_tensor() -> None:
    assert tensor_type("blocks.0.mlp.fc1.weight", (64, 512), "q4_k", linear=True) == "Q4_K"
    assert tensor_type("blocks.0.mlp.fc1.weight", (64, 96), "q4_k", linear=True) == "Q8_0"
    assert tensor_type("blocks.0.mlp.fc1.weight", (64, 24), "q6_k", linear=True) == "F16"
    assert tensor_type("blocks.0.mlp.fc1.weight", (64, 512), "Q8_0", linear=True) == "Q8_0"
    assert tensor_type("video_patch_proj.weight", (64, 512), "q4_k", linear=True) == "F32"  # an fp32 island
    assert tensor_type("blocks.0.norm1.weight", (512,), "q4_k", linear=False) == "F32"
    assert tensor_type("adaln_curve.basis", (64, 512), "q4_k", linear=False) == "F32"
    # A pruned form's AdaLN projection, which the module holds in fp32.
    assert (
        tensor_type("blocks.0.adaln_proj.linear.weight", (64, 512), "q4_k", linear=True, fp32=True) == "F32"
    )
    with pytest.raises(ValueError, match="'iq2_xxs' cannot be written"):
        tensor_type("blocks.0.mlp.fc1.weight", (64, 512), "iq2_xxs", linear=True)


def test_a_pruned_adaln_forms_fp32_tensors_stay_f32(converted, tmp_path) -> None:
    """The basis form (h3engine.checkpoint.prune_adaln): its curve and its AdaLN projections, which the module holds
    in fp32, are stored in F32, the other linears in the kind asked for."""
    from h3engine.checkpoint.prune_adaln import prune_checkpoint

    prune_checkpoint(converted["checkpoint"], tmp_path / "pruned", rank=2)
    layout = detect_layout(tmp_path / "pruned")
    conversion = convert_dit_to_gguf(layout, layout.partitions["fl2va"], tmp_path / "pruned.gguf", "q8_0")
    adaln = [key for key in conversion.types if "adaln" in key]
    assert {"adaln_curve.mean", "adaln_curve.basis", "blocks.0.adaln_proj.linear.weight"} <= set(adaln)
    assert all(conversion.types[key] == "F32" for key in adaln)
    assert conversion.types["blocks.0.mlp.fc2.weight"] == "Q8_0"


def test_a_failed_conversion_leaves_nothing(converted, tmp_path, monkeypatch) -> None:
    checkpoint = converted["checkpoint"]
    quantize = gguf_quantize.quantize
    calls = []

    def failing(values, kind):  # noqa: ANN001, ANN202
        calls.append(kind)
        if len(calls) == 20:  # the 20th tensor of the first DiT
            raise OSError("disk full")
        return quantize(values, kind)

    monkeypatch.setattr(gguf_quantize, "quantize", failing)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint_to_gguf(checkpoint, tmp_path / "new" / "out", "q4_k")
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint_to_gguf(checkpoint, empty, "q4_k")
    assert list(empty.iterdir()) == []
    monkeypatch.undo()

    def refused_rename(source, target) -> None:  # noqa: ANN001
        raise PermissionError(f"{target}: read-only folder")

    monkeypatch.setattr(gguf_convert.os, "replace", refused_rename)
    layout = detect_layout(checkpoint)
    with pytest.raises(PermissionError, match="read-only"):
        convert_dit_to_gguf(layout, layout.partitions["fl2va"], empty / "dit.gguf", "q8_0")
    assert list(empty.iterdir()) == []


def test_a_read_only_out_folder_is_refused_leaving_nothing(converted, tmp_path) -> None:
    layout = detect_layout(converted["checkpoint"])
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        try:
            (folder / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("this process writes into read-only folders (root with CAP_DAC_OVERRIDE)")
        with pytest.raises(PermissionError):
            convert_dit_to_gguf(layout, layout.partitions["fl2va"], folder / "dit.gguf", "q6_k")
        with pytest.raises(PermissionError):
            convert_checkpoint_to_gguf(converted["checkpoint"], folder, "q6_k")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


def test_refusals(converted, tmp_path) -> None:
    checkpoint = converted["checkpoint"]
    with pytest.raises(ValueError, match="'q3_0' cannot be written"):
        convert_checkpoint_to_gguf(checkpoint, tmp_path / "out", "q3_0")
    assert not (tmp_path / "out").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_checkpoint_to_gguf(checkpoint, full, "q8_0")
    assert [path.name for path in full.iterdir()] == ["keep.txt"]
    out, _ = converted["q8_0"]
    layout = with_dit_files(detect_layout(checkpoint), {"fl2va": out / "fl2va-dit-q8_0.gguf"})
    with pytest.raises(CheckpointError, match="already a single file"):
        convert_dit_to_gguf(layout, layout.partitions["fl2va"], tmp_path / "again.gguf", "q8_0")
