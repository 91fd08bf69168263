"""Converted FP8 checkpoints (h3engine.checkpoint.fp8_files, `python -m h3engine convert --weights fp8`): the files hold
exactly the values `--weights fp8` makes at load, so an engine on them computes bit for bit what `--weights fp8`
computes from the original, resident, streamed from host memory, or streamed straight from the files in FP8.

How it breaks: a converter that quantized in another row order or dtype, or a loader that quantized the dequantized
values again, changes the FP8 values (outputs differ); a stream that took the files' bf16 view instead of their FP8
bytes reads twice the bytes (checked on `read_bytes`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _runtime_helpers import parity_requests
from safetensors import safe_open

from h3engine.checkpoint.fp8_files import FORMAT_FP8, FORMAT_KEY, SCALE_SUFFIX, dit_quantized_key
from h3engine.checkpoint.fp8_rows import dequantize_rows, quantize_rows
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.memory.sizes import checkpoint_sizes

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


@pytest.fixture(scope="module", params=["native", "diffusers"])
def pair(request, tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(an original tiny checkpoint, its conversion by the CLI)."""
    original = tiny_checkpoints(request.param, seed=11)
    converted = tmp_path_factory.mktemp("converted") / "fp8"
    assert main(["convert", "--checkpoint", str(original), "--weights", "fp8", "--out", str(converted)]) == 0
    return original, converted


def _equal(got, expected) -> bool:
    return all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)


def test_a_converted_checkpoint_computes_what_weights_fp8_computes_from_the_original(pair) -> None:
    original, converted = pair
    reference = Engine.from_checkpoint(original, device="cpu", weights="fp8", adaln_cache="off")
    engines = {
        "resident": Engine.from_checkpoint(converted, device="cpu", adaln_cache="off"),
        "streamed": Engine.from_checkpoint(
            converted, device="cpu", adaln_cache="off", memory_profile="streamed"
        ),
        # A host budget below every streamed model: their layers stream from the files, in FP8.
        "from the files": Engine.from_checkpoint(
            converted, device="cpu", adaln_cache="off", memory_profile="streamed", host_memory=1e-6
        ),
    }
    assert all(engine.plan.weights == "fp8" for engine in engines.values())
    bf16 = Engine.from_checkpoint(original, device="cpu", adaln_cache="off")
    for task, request in parity_requests(steps=2, seed=4).items():
        expected, _ = reference.generate(request)
        for name, engine in engines.items():
            got, _ = engine.generate(request)
            assert _equal(got, expected), (task, name)
        unquantized, _ = bf16.generate(request)
        assert not torch.equal(unquantized.video_latents, expected.video_latents), task  # FP8 did change them


def test_layers_stream_from_the_files_as_fp8_bytes(pair) -> None:
    _, converted = pair
    engine = Engine.from_checkpoint(
        converted, device="cpu", adaln_cache="off", memory_profile="streamed", host_memory=1e-6
    )
    engine.generate(parity_requests(steps=1, seed=4)["t2va"])
    models = engine.store.models_for_task("t2va")
    for name in ("dit", "text_encoder"):
        stream = engine.placement.stream_of(getattr(models, name))
        assert stream.quantize and stream.host_bytes == 0 and stream.layer_reads > 0, name
        fp8_bytes = sum(
            placed.shape.numel() + 4 * placed.shape[0] if placed.quantized else placed.shape.numel() * 2
            for placed in stream.tensors[0]
        )
        # One layer's reads in bytes: its e4m3 values and row scales (and its small bf16 tensors), not bf16 values.
        assert stream.read_bytes // stream.layer_reads == fp8_bytes, name


def test_the_files_hold_rows_quantized_once_and_the_loader_dequantizes_them(pair) -> None:
    original, converted = pair
    native = (original / "FL2VA" / "transformer").is_dir()
    dit_folder = "FL2VA/transformer" if native else "transformer"
    source = WeightFiles.open(original / dit_folder)
    files = WeightFiles.open(converted / dit_folder)
    assert files.stores_fp8 and not source.stores_fp8
    assert set(files.infos) == set(source.infos)  # scales are not tensors of the module
    quantized = [key for key in files.scales]
    assert quantized and all(files.infos[key].dtype == torch.float8_e4m3fn for key in quantized)
    for key in quantized[:6]:
        values, scales = quantize_rows(source.tensor(key))
        stored_values, stored_scales = files.fp8(key)
        assert torch.equal(stored_values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(
            stored_scales, scales
        ), key
        assert torch.equal(files.tensor(key), dequantize_rows(values, scales))
        assert torch.equal(files.row_slice(key, 1, 3), dequantize_rows(values, scales)[1:3])
    if native:
        assert {key for key in files.infos if dit_quantized_key(key)} == set(quantized)
    for key in set(files.infos) - set(quantized):
        assert torch.equal(files.tensor(key), source.tensor(key)), key
    shard = sorted((converted / dit_folder).glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as handle:
        assert handle.metadata()[FORMAT_KEY] == FORMAT_FP8
        assert any(key.endswith(SCALE_SUFFIX) for key in handle.keys())
    sizes = checkpoint_sizes(converted)
    assert sizes.files_weights == "fp8" and sizes.weights == "fp8"


def test_the_text_encoder_keeps_only_what_h3_reads_and_its_copies_are_linked(tiny_native, tmp_path) -> None:
    """The native layout's two partitions carry the same text encoder: converted once, the second one linked."""
    converted = tmp_path / "fp8"
    assert (
        main(["convert", "--checkpoint", str(tiny_native), "--weights", "fp8", "--out", str(converted)]) == 0
    )
    index = json.loads((converted / "FL2VA" / "text_encoder" / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert "lm_head.weight" not in keys and "model.language_model.norm.weight" not in keys
    layers = {int(key.split(".")[3]) for key in keys if key.startswith("model.language_model.layers.")}
    assert max(layers) == 49
    first = sorted((converted / "FL2VA" / "text_encoder").glob("*.safetensors"))
    second = sorted((converted / "Ref2VA" / "text_encoder").glob("*.safetensors"))
    assert [path.name for path in first] == [path.name for path in second]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(
    ("extra", "starts"),
    [
        (
            ["--weights", "int4"],
            "error: --weights: expected one of fp8, int8, q8_0, q6_k, q5_k, q4_k, q3_k, q2_k, got 'int4'",
        ),
        (["--weights", "fp8", "--out", "OCCUPIED"], "error: --out: "),
    ],
)
def test_convert_refuses_in_one_line(capsys, tiny_native, tmp_path, extra, starts) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "file").write_text("x")
    arguments = ["convert", "--checkpoint", str(tiny_native), "--out", str(tmp_path / "out"), *extra]
    arguments = [str(occupied) if value == "OCCUPIED" else value for value in arguments]
    assert main(arguments) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(starts), err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_missing_checkpoint(capsys, tmp_path) -> None:
    missing = tmp_path / "missing"
    code = main(["convert", "--checkpoint", str(missing), "--weights", "fp8", "--out", str(tmp_path / "out")])
    assert code == 2 and str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("real_bytes", [(), ("dit", "text_encoder")])
def test_an_fp8_placeholder_is_the_quantized_bf16_placeholder(tmp_path, real_bytes) -> None:
    """`make-placeholder-checkpoint --weights fp8` (holes, or real bytes) stands for the quantized values of the bf16
    placeholder of the same seed: an engine on it computes what `--weights fp8` computes on the bf16 one."""
    from h3engine.checkpoint.placeholder import make_placeholder_checkpoint

    bf16 = make_placeholder_checkpoint(tmp_path / "bf16", seed=3, tiny=True)
    fp8 = make_placeholder_checkpoint(
        tmp_path / "fp8", seed=3, tiny=True, weights="fp8", real_bytes=real_bytes
    )
    files = WeightFiles.open(fp8 / "FL2VA" / "transformer")
    assert files.stores_fp8 and files.placeholder
    request = parity_requests(steps=1, seed=4)["t2va"]
    expected, _ = Engine.from_checkpoint(bf16, device="cpu", weights="fp8", adaln_cache="off").generate(
        request
    )
    engine = Engine.from_checkpoint(fp8, device="cpu", adaln_cache="off", memory_profile="streamed")
    got, _ = engine.generate(request)
    assert engine.plan.weights == "fp8" and _equal(got, expected)
