"""A ComfyUI-style single DiT file in place of a partition's weights (`--dit FILE.safetensors`): bf16 / fp16 files, FP8
scaled (per-layer configs and the legacy marker layout), INT8 per tensor and per row, INT8 ConvRot, mixed files and
the published pruned (AdaLN table) form. Quantized linears stay quantized (StoredLinear: the file's bytes and
scale) and compute exactly what the same model with the dequantized weights computes, resident and streamed.

Reference: the same file's values dequantized by the reader (h3engine.checkpoint.single_files, the formats' published
math in float32) and stored as f32: the module then holds plain linears with those values cast once to bf16, as a
StoredLinear casts its float32 dequantization once, so the outputs are compared for equality. How it breaks: a
scale applied per row where the file's is per tensor (or the other way round), ConvRot's rotation left out or
applied on the wrong side, a prefix not stripped, a pruned file read as the exact form.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _dit_files import engine, equal_outputs
from _runtime_helpers import parity_requests
from test_gguf_dit import module_state

from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.layout import detect_layout, with_dit_files
from h3engine.checkpoint.single_files import SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig
from h3engine.models.stored_linear import StoredLinear

# Every layout, as (format, writer options): the tiny DiT's rows are 8 to 32 wide, so ConvRot runs in groups of 4.
LAYOUTS = {
    "bf16": ("bf16", {}),
    "fp16": ("f16", {}),
    "fp8_comfy_quant": ("fp8_e4m3_scaled", {}),
    "fp8_legacy": ("fp8_e4m3_scaled", {"fp8_layout": "legacy"}),
    "fp8_configs_in_metadata": ("fp8_e4m3_scaled", {"configs_in": "metadata"}),
    "int8_tensorwise": ("int8_tensorwise", {}),
    "int8_rowwise": ("int8_rowwise", {}),
    "int8_convrot": ("int8_convrot", {"convrot_group": 4}),
}
SCALED = {
    "fp8_comfy_quant",
    "fp8_legacy",
    "fp8_configs_in_metadata",
    "int8_tensorwise",
    "int8_rowwise",
    "int8_convrot",
}


def without_rope(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if key != "rope.inv_freq"}


def dequantized_twin(source: Path, target: Path) -> None:
    """The single file `source` with every tensor as the reader dequantizes it, stored as f32."""
    single = SingleFile.open(source)
    write_single_file(target, {name: single.tensor(name) for name in single.records}, "f32")


@pytest.fixture(scope="module")
def made(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    checkpoint = tiny_checkpoints("native", seed=9)
    folder = tmp_path_factory.mktemp("single")
    state = without_rope(module_state(checkpoint))
    files = {"checkpoint": checkpoint}
    for name, (kind, options) in LAYOUTS.items():
        files[name] = folder / f"{name}.safetensors"
        write_single_file(files[name], state, kind, **options)
        files[f"{name}-f32"] = folder / f"{name}-f32.safetensors"
        dequantized_twin(files[name], files[f"{name}-f32"])
    # Mixed: the attention in INT8 ConvRot, the feed-forward in FP8, the rest in bf16.
    mixed = {
        key: "int8_convrot" if ".attn." in key else "fp8_e4m3_scaled" if ".mlp." in key else "bf16"
        for key, value in state.items()
        if key.endswith(".weight") and value.dim() == 2
    }
    files["mixed"] = folder / "mixed.safetensors"
    write_single_file(files["mixed"], state, mixed, convrot_group=4)
    files["mixed-f32"] = folder / "mixed-f32.safetensors"
    dequantized_twin(files["mixed"], files["mixed-f32"])
    return files


@pytest.mark.parametrize("layout", [*LAYOUTS, "mixed"])
def test_a_single_file_dit_computes_what_its_dequantized_weights_compute(made, layout) -> None:
    quantized, reference = engine(made, layout), engine(made, f"{layout}-f32")
    stored = [m for m in quantized.store.models_for_task("t2va").dit.modules() if isinstance(m, StoredLinear)]
    assert bool(stored) == (layout in SCALED or layout == "mixed")
    request = parity_requests(steps=2, seed=3)["t2va"]
    got, _ = quantized.generate(request)
    expected, _ = reference.generate(request)
    assert equal_outputs(got, expected), layout


def test_a_convrot_file_streams_its_bytes_and_scales(made) -> None:
    request = parity_requests(steps=2, seed=8)["fl2va"]
    expected, _ = engine(made, "int8_convrot").generate(request)
    streamed_engine = engine(made, "int8_convrot", memory_profile="streamed", host_memory=1e-6)
    got, _ = streamed_engine.generate(request)
    assert equal_outputs(got, expected)
    stream = streamed_engine.placement.stream_of(streamed_engine.store.models_for_task("t2va").dit)
    names = {placed.name for layer in stream.tensors for placed in layer}
    assert {"quantized", "scale"} <= names


def test_the_published_pruned_form_loads_from_a_single_file(made, tmp_path) -> None:
    """A pruned (AdaLN table) DiT in INT8 ConvRot: the config follows the file's shapes, and the engine computes
    what the dequantized pruned file computes."""
    config = dataclasses.replace(DiTConfig.tiny(), adaln_rank=4, adaln_table_rows=17)
    state = without_rope(native_to_module(random_native_state(config, 31), config))
    assert "adaln_t_table" in state and not any(key.startswith("time_embedder.") for key in state)
    files = {
        **made,
        "pruned": tmp_path / "pruned.safetensors",
        "pruned-f32": tmp_path / "pruned-f32.safetensors",
    }
    write_single_file(files["pruned"], state, "int8_convrot", convrot_group=4)
    dequantized_twin(files["pruned"], files["pruned-f32"])
    quantized, reference = engine(files, "pruned"), engine(files, "pruned-f32")
    assert quantized.store.models_for_task("t2va").dit.config.adaln_table_rows == 17
    request = parity_requests(steps=2, seed=3)["t2va"]
    assert equal_outputs(quantized.generate(request)[0], reference.generate(request)[0])


def test_a_format_we_do_not_read_is_refused_before_loading(made, tmp_path) -> None:
    state = without_rope(module_state(made["checkpoint"]))
    path = tmp_path / "mxfp8.safetensors"
    from safetensors.torch import save_file

    tensors = {f"model.diffusion_model.{key}": value for key, value in state.items()}
    layer = "model.diffusion_model.blocks.0.mlp.fc1"
    tensors[f"{layer}.comfy_quant"] = torch.tensor(list(b'{"format": "mxfp8"}'), dtype=torch.uint8)
    tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="mxfp8") as refused:
        engine({**made, "mxfp8": path}, "mxfp8")
    assert "blocks.0.mlp.fc1" in str(refused.value) and "mxfp8.safetensors" in str(refused.value)
    other = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4)}, str(other))
    with pytest.raises(CheckpointError, match="not an H3 DiT file"):
        engine({**made, "other": other}, "other")


@pytest.mark.parametrize("home", ["pinned", "mapped"])
def test_quantized_adaln_projections_offload_as_stored_bytes(made, home) -> None:
    """A file's quantized AdaLN projections wait on the host as their bytes and scale (or in the mapped file) and
    give the tables they give resident."""
    from h3engine.checkpoint.loader import dit_source
    from h3engine.engine.sampling.modulation import offload_adaln, schedule_modulation

    layout = with_dit_files(detect_layout(made["checkpoint"]), {"fl2va": made["int8_convrot"]})
    source = dit_source(layout, layout.partitions["fl2va"], torch.bfloat16)
    dit = source.load(torch.device("cpu"))
    projections = [block.adaln_proj.linear for block in dit.blocks] + [dit.final_layer.adaln_proj.linear]
    assert all(isinstance(linear, StoredLinear) for linear in projections)
    steps = [torch.tensor([0.999, 0.42, 0.67]), torch.tensor([0.999, 0.5, 0.7])]
    with torch.no_grad():
        resident = schedule_modulation(dit, steps, torch.device("cpu"))
        readers = {}
        if home == "mapped":
            names = [name for name, _ in dit.named_buffers() if ".adaln_proj.linear." in name]
            readers = {name: (lambda name=name: source.files.tensor(name)) for name in names}
            assert any(name.endswith(".quantized") for name in readers)
        offload_adaln(dit, readers=readers)
        offloaded = schedule_modulation(dit, steps, torch.device("cpu"))
    assert offloaded is not resident
    for a, b in zip(resident, offloaded, strict=True):
        assert all(torch.equal(x.gate_attn, y.gate_attn) for x, y in zip(a.blocks, b.blocks, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a.final, b.final, strict=True))


def test_a_lora_beside_fp8_scaled_weights_equals_the_lora_on_the_dequantized_base(made, tmp_path) -> None:
    from _dit_helpers import tiny_fl2va_request
    from _lora_helpers import small_lora, write_lora

    from h3engine.checkpoint.loader import dit_source
    from h3engine.checkpoint.lora_format import read_lora
    from h3engine.engine.lora.adapters import Adapter, apply_adapters

    config = DiTConfig.tiny()
    path = tmp_path / "style.safetensors"
    write_lora(path, small_lora(config, seed=5), "ours", config)
    adapter = Adapter(read_lora(path))
    request = tiny_fl2va_request(config, torch.bfloat16, seed=9).as_h3_arguments()
    outputs = {}
    for name in ("fp8_comfy_quant", "fp8_comfy_quant-f32"):
        layout = with_dit_files(detect_layout(made["checkpoint"]), {"fl2va": made[name]})
        model = dit_source(layout, layout.partitions["fl2va"], torch.bfloat16).load(torch.device("cpu"))
        with torch.no_grad():
            plain = model(*request)
            apply_adapters(model, [adapter])
            outputs[name] = model(*request)
        assert not torch.equal(outputs[name][0], plain[0])  # the adapter changes the output
        # FP8 bytes and scales beside the adapter; the twin holds plain linears.
        assert any(isinstance(m, StoredLinear) for m in model.modules()) == (name == "fp8_comfy_quant")
    assert all(
        torch.equal(a, b)
        for a, b in zip(outputs["fp8_comfy_quant"], outputs["fp8_comfy_quant-f32"], strict=True)
    )
