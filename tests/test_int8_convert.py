"""`convert --weights int8` (h3engine.checkpoint.int8_convert), the streamed single-file writer it uses, and
`--prune-adaln` with int8 or a GGUF type in one step.

Oracles: the in-memory writer (`write_single_file` given the tensors themselves) writes the same bytes as the
streamed one (`read=`, meta stand-ins), so the converter's file is the one the tested writer makes of the source
module's tensors; an engine on the converted folder computes exactly what an engine given the same files as
`--dit` computes (tests/test_single_file_dit.py covers such files against their dequantized values). The tiny DiT's
rows are 8 to 32 wide, so the ConvRot linears are tested on a DiT of 256- and 512-wide linears (fc2 288 wide: kept).

How it breaks: the values cached between a quantized tensor's two parts (or re-quantized differently), a stand-in's
dtype instead of the read tensor's, keys or QKV rows not as the GGUF converter writes them, an fp32 island quantized,
gguf_files.json missing, the staging folder or a half-written --out left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _runtime_helpers import parity_requests
from _wide_dit import write_wide_checkpoint

from h3engine.checkpoint import dit_format, gguf_quantize, int8_convert
from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.gguf_convert import GGUF_FILES_JSON
from h3engine.checkpoint.layout import detect_layout, with_dit_files
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.single_files import SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.cli.convert import STAGING_SUFFIX
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.models.stored_linear import StoredLinear

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")
INT8_NAMES = {"fl2va": "fl2va-dit-int8_convrot.safetensors", "ref2va": "ref2va-dit-int8_convrot.safetensors"}


def source_state(checkpoint: Path, partition: str) -> dict[str, torch.Tensor]:
    """A partition's DiT as the module holds it (QKV rows stacked), in its stored dtypes, rope.inv_freq aside."""
    paths = detect_layout(checkpoint).partitions[partition]
    files = WeightFiles.open(paths.dit)
    config = dit_format.config_from_native(json.loads((paths.dit / "config.json").read_text()))
    native = {key: files.tensor(key) for key in files.infos if key != ROPE_KEY}
    return dit_format.native_to_module(native, config)


def convert(*arguments: str) -> int:
    return main(["convert", *arguments])


def generate(checkpoint: Path | object):  # noqa: ANN201
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    output, _ = engine.generate(parity_requests(steps=2, seed=5)["t2va"])
    return engine, output


def stored_linears(engine: Engine) -> dict[str, StoredLinear]:
    dit = engine.store.models_for_task("t2va").dit
    return {name: module for name, module in dit.named_modules() if isinstance(module, StoredLinear)}


@pytest.fixture(scope="module")
def wide_checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny checkpoint with an FL2VA DiT of 256- and 512-wide linears (fc2 288 wide, condition_proj 8)."""
    target = tmp_path_factory.mktemp("wide") / "checkpoint"
    return write_wide_checkpoint(tiny_checkpoints("native", seed=7), target)


@pytest.fixture(scope="module")
def converted(wide_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("int8") / "out"
    assert convert("--checkpoint", str(wide_checkpoint), "--weights", "int8", "--out", str(out)) == 0
    return out


# --------------------------------------------------------------------------------------------------------------
# (a) convert --weights int8
# --------------------------------------------------------------------------------------------------------------


def test_the_int8_folder_loads_with_int8_convrot_linears(wide_checkpoint, converted, capsys) -> None:
    assert json.loads((converted / GGUF_FILES_JSON).read_text()) == INT8_NAMES
    assert [path.name for path in (converted / "FL2VA" / "transformer").iterdir()] == ["config.json"]
    layout = detect_layout(converted)
    assert {p: paths.dit_weights for p, paths in layout.partitions.items()} == {
        p: converted / name for p, name in INT8_NAMES.items()
    }
    single = SingleFile.open(converted / INT8_NAMES["fl2va"])
    formats = {name: record.format for name, record in single.records.items()}
    for key in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "adaln_proj.linear"):
        assert formats[f"blocks.1.{key}.weight"] == "int8_convrot", key
        assert single.records[f"blocks.1.{key}.weight"].convrot_group == 256
    assert formats["blocks.0.mlp.fc2.weight"] == "int8_rowwise"  # 288 columns: not whole groups, not rotated
    assert formats["video_patch_proj.weight"] != "int8_convrot"  # an fp32 island, kept as stored
    assert ROPE_KEY not in formats
    single.close()
    engine, _ = generate(converted)
    stored = stored_linears(engine)
    assert "blocks.1.attn.qkv_proj" in stored and "blocks.0.mlp.fc2" in stored
    assert stored["blocks.1.attn.qkv_proj"].form.rotation_group == 256
    assert stored["blocks.0.mlp.fc2"].form.rotation_group == 0  # 288 columns: INT8 per row, not rotated
    assert {(m.form.values_dtype, m.form.scale_per_row) for m in stored.values()} == {(torch.int8, True)}


def test_the_streamed_file_is_the_in_memory_writers(wide_checkpoint, converted, tmp_path) -> None:
    """Each partition's file equals, byte for byte, what write_single_file writes from the source module's tensors
    held in memory (no `read`), with the formats the converter chose."""
    for partition, name in INT8_NAMES.items():
        state = source_state(wide_checkpoint, partition)
        written = SingleFile.open(converted / name)
        formats = {
            key: fmt if (fmt := written.records[key].format) in ("int8_convrot", "int8_rowwise") else "keep"
            for key in state
        }
        assert set(written.records) == set(state)
        written.close()
        memory = tmp_path / f"{partition}.safetensors"
        write_single_file(memory, state, formats)
        assert memory.read_bytes() == (converted / name).read_bytes(), partition
        if partition == "ref2va":  # the tiny DiT: no linear is whole 256-column groups
            assert "int8_convrot" not in formats.values() and "int8_rowwise" in formats.values()


def test_the_converted_folder_computes_what_the_files_given_as_dit_compute(
    wide_checkpoint, converted
) -> None:
    _, got = generate(converted)
    files = {partition: converted / name for partition, name in INT8_NAMES.items()}
    _, expected = generate(with_dit_files(detect_layout(wide_checkpoint), files))
    assert all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)


def test_the_reported_errors_are_the_files(wide_checkpoint, converted, tmp_path, capsys) -> None:
    conversions = int8_convert.convert_checkpoint_to_int8(wide_checkpoint, tmp_path / "again")
    conversion = conversions["fl2va"]
    assert conversion.path.read_bytes() == (converted / INT8_NAMES["fl2va"]).read_bytes()
    state = source_state(wide_checkpoint, "fl2va")
    single = SingleFile.open(conversion.path)
    for key, fmt in conversion.types.items():
        reference = state[key].float()
        stored = single.tensor(key).float()
        expected = float((stored - reference).square().sum().sqrt() / reference.square().sum().sqrt())
        if fmt == "keep":
            assert conversion.errors[key] == 0.0 and torch.equal(stored, reference), key
        else:
            assert abs(conversion.errors[key] - expected) <= 1e-6 + 1e-4 * expected, key
            assert 0 < expected < 0.02, key
    single.close()
    assert conversion.bytes_after == conversion.path.stat().st_size < conversion.bytes_before


# --------------------------------------------------------------------------------------------------------------
# (b) the streamed writer writes the in-memory writer's bytes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8_convrot", "fp8_e4m3_scaled", "fp8_legacy", "mixed"])
def test_write_with_read_writes_the_same_bytes(tiny_checkpoints, tmp_path, fmt) -> None:
    state = source_state(tiny_checkpoints("native", seed=9), "fl2va")
    options: dict = {"convrot_group": 4}
    if fmt == "mixed":
        fmt = {
            key: "int8_convrot" if ".attn." in key else "fp8_e4m3_scaled" if ".mlp." in key else "f32"
            for key, value in state.items()
            if key.endswith(".weight") and value.dim() == 2
        }
    elif fmt == "fp8_legacy":
        fmt, options = "fp8_e4m3_scaled", {"fp8_layout": "legacy", "input_scale": 0.5}
    in_memory = write_single_file(tmp_path / "memory.safetensors", state, fmt, **options)
    reads: list[str] = []

    def read(name: str) -> torch.Tensor:
        reads.append(name)
        return state[name].clone()

    stand_ins = {
        key: torch.empty(value.shape, dtype=value.dtype, device="meta") for key, value in state.items()
    }
    streamed = write_single_file(tmp_path / "streamed.safetensors", stand_ins, fmt, read=read, **options)
    assert streamed == in_memory
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "memory.safetensors").read_bytes()
    # Every tensor read when written; a quantized one once per part (values, scale), nothing held between.
    quantized = {key for key, stored in in_memory.items() if stored not in ("keep", "f32")}
    assert quantized and sorted(reads) == sorted([*state, *quantized])


# --------------------------------------------------------------------------------------------------------------
# (c) --prune-adaln with int8 or a GGUF type
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["q8_0", "int8"])
def test_prune_and_quantize_in_one_step(wide_checkpoint, tmp_path, capsys, weights) -> None:
    out = tmp_path / "out"
    assert (
        convert(
            "--checkpoint", str(wide_checkpoint), "--prune-adaln", "--weights", weights, "--out", str(out)
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "FL2VA/transformer: pruned AdaLN to rank 8" in printed and "AdaLN table error" in printed
    assert "fl2va DiT:" in printed and "ref2va DiT:" in printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no staging folder left
    listed = json.loads((out / GGUF_FILES_JSON).read_text())
    suffix = "q8_0.gguf" if weights == "q8_0" else "int8_convrot.safetensors"
    assert all(name.endswith(suffix) for name in listed.values())
    config = json.loads((out / "FL2VA" / "transformer" / "config.json").read_text())
    assert config["adaln_rank"] == 8
    engine, output = generate(out)
    dit = engine.store.models_for_task("t2va").dit
    assert dit.config.adaln_form == "basis" and dit.config.adaln_rank == 8
    assert torch.isfinite(output.video_latents).all() and torch.isfinite(output.audio_latents).all()
    stored = stored_linears(engine)
    assert "blocks.1.mlp.fc1" in stored
    # The pruned form's AdaLN projections are held in fp32: never quantized.
    assert not any("adaln" in name for name in stored)


@pytest.mark.parametrize(
    ("weights", "error", "code"), [("int8", OSError, 1), ("q8_0", KeyboardInterrupt, 130)]
)
def test_a_failure_mid_way_leaves_neither_out_nor_staging(
    tiny_checkpoints, tmp_path, monkeypatch, capsys, weights, error, code
) -> None:
    calls = []
    if weights == "int8":
        original = int8_convert.convert_dit_to_int8

        def failing(*arguments, **options):  # noqa: ANN002, ANN003, ANN202
            calls.append(arguments)
            if len(calls) == 2:  # the second partition, the first one written
                raise error("disk full")
            return original(*arguments, **options)

        monkeypatch.setattr(int8_convert, "convert_dit_to_int8", failing)
    else:
        quantize = gguf_quantize.quantize

        def failing(values, kind):  # noqa: ANN001, ANN202
            calls.append(kind)
            if len(calls) == 20:
                raise error("Ctrl-C")
            return quantize(values, kind)

        monkeypatch.setattr(gguf_quantize, "quantize", failing)
    out = tmp_path / "new" / "out"
    checkpoint = tiny_checkpoints("native", seed=7)
    assert (
        convert("--checkpoint", str(checkpoint), "--prune-adaln", "--weights", weights, "--out", str(out))
        == code
    )
    assert len(calls) == (2 if weights == "int8" else 20)
    assert list(tmp_path.iterdir()) == []  # neither --out, the staging folder, nor the folder made for them


def test_prune_and_quantize_refusals(tiny_checkpoints, tmp_path, capsys) -> None:
    checkpoint = str(tiny_checkpoints("native", seed=7))
    staging = tmp_path / f"out{STAGING_SUFFIX}"
    staging.mkdir()
    (staging / "theirs.txt").write_text("kept")
    assert (
        convert(
            "--checkpoint", checkpoint, "--prune-adaln", "--weights", "int8", "--out", str(tmp_path / "out")
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out: ") and "staging" in err[0], err
    assert (staging / "theirs.txt").read_text() == "kept" and not (tmp_path / "out").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert convert("--checkpoint", checkpoint, "--prune-adaln", "--weights", "q4_k", "--out", str(full)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out: ") and "not empty" in err[0], err
    assert not (tmp_path / f"full{STAGING_SUFFIX}").exists()
