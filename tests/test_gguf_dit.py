"""A community GGUF DiT file in place of a partition's weights (`--dit FILE.gguf`): its block-quantized linears stay
quantized (h3engine.models.stored_linear.StoredLinear, h3engine.checkpoint.dit_file_weights) and compute exactly what
the same model with the dequantized weights computes, resident, streamed from host memory or straight from the file,
with or without a LoRA beside them.

Reference: the same GGUF values stored as F32 (so the module holds plain linears with the dequantized weights, cast
once to the compute dtype as StoredLinear casts its fp32 dequantization once). The two runs do the same ops on the
same values, so outputs are compared for equality. How it breaks: a loader that dequantized in another row order or
rounded twice, a stream that lost the quantized bytes, a LoRA merged into the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _dit_files import engine, equal_outputs
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import small_lora, write_lora
from _runtime_helpers import parity_requests
from gguf import GGMLQuantizationType, GGUFWriter
from test_gguf_blocks import QUANTIZED, random_raw

from h3engine.checkpoint import dit_format, gguf_blocks
from h3engine.checkpoint.gguf_blocks import GGMLType
from h3engine.checkpoint.gguf_files import DIFFUSION_MODEL_PREFIX, GGUFFile
from h3engine.checkpoint.gguf_write import write_gguf
from h3engine.checkpoint.layout import detect_layout, parse_dit_files, with_dit_files
from h3engine.checkpoint.loader import dit_source, read_dit_config
from h3engine.checkpoint.lora_format import read_lora
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.engine.engine import Engine
from h3engine.engine.lora.adapters import Adapter, apply_adapters
from h3engine.engine.options import EngineOptions, engine_layout
from h3engine.errors import CheckpointError, RequestError
from h3engine.models.stored_linear import StoredLinear, WeightForm


def module_state(checkpoint: Path, partition: str = "fl2va") -> dict[str, torch.Tensor]:
    """A tiny checkpoint's DiT as the module holds it (QKV rows stacked, as community single files store them)."""
    layout = detect_layout(checkpoint)
    paths = layout.partitions[partition]
    files = WeightFiles.open(paths.dit)
    native = {key: files.tensor(key) for key in files.infos}
    return dit_format.native_to_module(native, read_dit_config(layout, paths))


def write_dit_gguf(path: Path, state: dict[str, torch.Tensor], kind: str) -> dict[str, str]:
    """`state` as a community file: prefixed names, rope.inv_freq left out, linears in `kind` where whole blocks."""
    tensors = {DIFFUSION_MODEL_PREFIX + key: value for key, value in state.items() if key != "rope.inv_freq"}
    return write_gguf(path, tensors, kind)


def dequantized_twin(source: Path, target: Path) -> None:
    """The GGUF file `source` with every tensor dequantized and stored as F32: the reference."""
    gguf = GGUFFile.open(source)
    write_gguf(
        target, {record.stored_name: gguf.tensor(name) for name, record in gguf.tensors.items()}, "F32"
    )


@pytest.fixture(scope="module")
def files(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint, its FL2VA DiT in Q8_0 and Q4_0 (the block types gguf-py writes), and their F32 twins."""
    checkpoint = tiny_checkpoints("native", seed=7)
    folder = tmp_path_factory.mktemp("gguf")
    state = module_state(checkpoint)
    made = {"checkpoint": checkpoint}
    for kind in ("Q8_0", "Q4_0"):
        made[kind] = folder / f"dit-{kind}.gguf"
        stored = write_dit_gguf(made[kind], state, kind)
        assert kind in stored.values()  # the tiny DiT has linears of whole blocks
        made[f"{kind}-f32"] = folder / f"dit-{kind}-f32.gguf"
        dequantized_twin(made[kind], made[f"{kind}-f32"])
    return made


# --------------------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------------------


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels)"
        ),
    ),
]


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda kind: kind.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_a_stored_linear_is_a_linear_of_its_dequantized_weight(kind: GGMLType, dtype, device) -> None:
    """On CUDA the layer dequantizes with the Triton kernel: bit-identical to the twin by construction."""
    width = gguf_blocks.BLOCK_FORMATS[kind].block_size * 2
    raw = torch.from_numpy(random_raw(kind, 6, width, seed=int(kind))).to(device)
    layer = StoredLinear(width, 6, WeightForm.gguf(kind), dtype=dtype, device=device)
    layer.quantized.copy_(raw)
    torch.nn.init.normal_(layer.bias)
    hidden = torch.randn(5, width, dtype=dtype, device=device)
    weight = gguf_blocks.dequantize(raw.cpu(), kind, (6, width)).to(dtype).to(device)
    assert torch.equal(layer.weight, weight)
    assert torch.equal(layer(hidden), F.linear(hidden, weight, layer.bias))
    assert layer.state_dict()["quantized"].dtype == torch.uint8  # the bytes, not a dequantized copy


def test_a_stored_linear_refuses_a_width_of_partial_blocks() -> None:
    with pytest.raises(CheckpointError, match="Q4_K"):
        StoredLinear(100, 4, WeightForm.gguf(GGMLType.Q4_K), name="blocks.0.mlp.fc2.weight")


# --------------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_gguf_dit_computes_what_its_dequantized_weights_compute(files, kind) -> None:
    quantized, reference = engine(files, kind), engine(files, f"{kind}-f32")
    dit = quantized.store.models_for_task("t2va").dit
    stored = [module for module in dit.modules() if isinstance(module, StoredLinear)]
    assert stored and all(module.quantized.dtype == torch.uint8 for module in stored)
    assert not any(isinstance(m, StoredLinear) for m in reference.store.models_for_task("t2va").dit.modules())
    for task in ("t2va", "fl2va"):
        request = parity_requests(steps=2, seed=5)[task]
        got, _ = quantized.generate(request)
        expected, _ = reference.generate(request)
        assert equal_outputs(got, expected), task
    # The other partition keeps the folder's DiT.
    assert quantized.layout.partitions["ref2va"].dit_weights is None


def test_a_gguf_dit_streams_its_quantized_bytes(files) -> None:
    request = parity_requests(steps=2, seed=6)["t2va"]
    expected, _ = engine(files, "Q8_0").generate(request)
    for memory in ({"memory_profile": "streamed"}, {"memory_profile": "streamed", "host_memory": 1e-6}):
        streamed = engine(files, "Q8_0", **memory)
        got, _ = streamed.generate(request)
        assert equal_outputs(got, expected), memory
        dit = streamed.store.models_for_task("t2va").dit
        stream = streamed.placement.stream_of(dit)
        assert stream is not None and stream.layer_reads + len(stream.tensors) > 0
        streamed_names = {placed.name for layer in stream.tensors for placed in layer}
        assert "quantized" in streamed_names  # the ring carries the file's bytes


def test_a_lora_beside_gguf_weights_equals_the_lora_on_the_dequantized_base(files, tmp_path) -> None:
    layout = detect_layout(files["checkpoint"])
    paths = layout.partitions["fl2va"]
    config = read_dit_config(layout, paths)
    lora_path = tmp_path / "style.safetensors"
    write_lora(lora_path, small_lora(config, seed=3), "ours", config)
    lora = read_lora(lora_path)
    request = tiny_fl2va_request(config, torch.bfloat16, seed=9)
    outputs = {}
    for dit in ("Q8_0", "Q8_0-f32"):
        replaced = with_dit_files(layout, {"fl2va": files[dit]})
        model = dit_source(replaced, replaced.partitions["fl2va"], torch.bfloat16).load(torch.device("cpu"))
        with torch.no_grad():
            plain = model(*request.as_h3_arguments())
            apply_adapters(model, [Adapter(lora)])
            outputs[dit] = model(*request.as_h3_arguments())
        assert not torch.equal(outputs[dit][0], plain[0])  # the LoRA changes the output
        if dit == "Q8_0":
            assert all(
                m.quantized.dtype == torch.uint8 for m in model.modules() if isinstance(m, StoredLinear)
            )
    assert all(torch.equal(a, b) for a, b in zip(outputs["Q8_0"], outputs["Q8_0-f32"], strict=True))


# --------------------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------------------


def test_a_type_we_do_not_read_is_refused_naming_the_tensor_and_the_type(files, tmp_path) -> None:
    state = module_state(files["checkpoint"])
    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(path, "h3")
    for key, value in state.items():
        if key == "blocks.1.mlp.fc2.weight":  # 256-wide rows of IQ2_XXS (66 bytes per 256 values)
            rows = value.shape[0]
            raw = np.zeros((rows, 66), np.uint8)
            writer.add_tensor(DIFFUSION_MODEL_PREFIX + key, raw, raw_dtype=GGMLQuantizationType.IQ2_XXS)
        elif key != "rope.inv_freq":
            writer.add_tensor(DIFFUSION_MODEL_PREFIX + key, value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"IQ2_XXS") as refused:
        engine({**files, "iq": path}, "iq")
    assert "blocks.1.mlp.fc2.weight" in str(refused.value)


def test_another_models_file_and_a_missing_tensor_are_refused_before_loading(files, tmp_path) -> None:
    other = tmp_path / "llm.gguf"
    write_gguf(other, {"blk.0.attn_q.weight": torch.zeros(64, 64)}, "Q8_0", architecture="qwen3vl")
    with pytest.raises(CheckpointError, match="qwen3vl") as refused:
        engine({**files, "other": other}, "other")
    assert "llm.gguf" in str(refused.value)
    state = module_state(files["checkpoint"])
    del state["blocks.1.mlp.fc1.weight"]
    partial = tmp_path / "partial.gguf"
    write_dit_gguf(partial, state, "Q8_0")
    with pytest.raises(CheckpointError, match="blocks.1.mlp.fc1"):
        engine({**files, "partial": partial}, "partial")


def test_the_dit_flag_names_its_partition(files, tmp_path) -> None:
    file = files["Q8_0"]
    assert parse_dit_files([f"ref2va={file}"], ("fl2va", "ref2va")) == {"ref2va": file}
    assert parse_dit_files([str(file)], ("fl2va",)) == {"fl2va": file}
    for values, partitions in (
        ([str(file)], ("fl2va", "ref2va")),  # which one?
        ([f"fl2va={tmp_path / 'missing.gguf'}"], ("fl2va", "ref2va")),
        ([f"fl2va={file}", f"fl2va={file}"], ("fl2va", "ref2va")),
    ):
        with pytest.raises(RequestError) as refused:
            parse_dit_files(values, partitions)
        assert refused.value.field == "--dit"
    layout = engine_layout(files["checkpoint"], EngineOptions(dit=(f"fl2va={file}",)))
    assert layout.partitions["fl2va"].dit_weights == file


def test_plan_memory_plans_a_gguf_dit_at_its_stored_size(tmp_path, capsys) -> None:
    """A released-size placeholder checkpoint and a released-size GGUF placeholder (header only, its data a hole):
    the plan's DiT is the file's Q4_K bytes, not bf16's."""
    from h3engine.checkpoint.dit_keys import native_state_shapes
    from h3engine.checkpoint.gguf_write import write_gguf_placeholder
    from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
    from h3engine.cli.main import main
    from h3engine.memory.sizes import checkpoint_sizes
    from h3engine.models.dit_config import DiTConfig

    released = make_placeholder_checkpoint(tmp_path / "released")
    shapes = native_state_shapes(DiTConfig.released())
    gguf = tmp_path / "dit-Q4_K.gguf"
    types = write_gguf_placeholder(
        gguf, {DIFFUSION_MODEL_PREFIX + k: v for k, v in shapes.items() if k != "rope.inv_freq"}, "Q4_K"
    )
    assert types[DIFFUSION_MODEL_PREFIX + "blocks.0.mlp.fc1.weight"] == "Q4_K"
    assert gguf.stat().st_blocks * 512 < 1 << 20  # a hole, not 23 GiB of zeros
    options = EngineOptions(dit=(f"fl2va={gguf}",))
    bf16 = checkpoint_sizes(released).partitions["fl2va"].dit
    stored = checkpoint_sizes(engine_layout(released, options)).partitions["fl2va"].dit
    total = stored.layers_total + stored.other_bytes + stored.adaln_bytes
    assert abs(total - gguf.stat().st_size) < 0.01 * gguf.stat().st_size  # the file's bytes, header aside
    assert total < 0.4 * (bf16.layers_total + bf16.other_bytes + bf16.adaln_bytes)
    # The largest weight dequantized at a time: an AdaLN projection in bf16 (96768 x 2688), counted once.
    assert stored.dequantized_bytes == 96768 * 2688 * 2 and bf16.dequantized_bytes == 0
    assert stored.layer_parameters == bf16.layer_parameters  # the same multiply-adds, whatever the storage
    flags = [
        "plan-memory",
        "--checkpoint",
        str(released),
        "--gpu-memory",
        "24",
        "--host-memory",
        "32",
        "--json",
    ]
    plans = {}
    for name, extra in (("bf16", []), ("gguf", ["--dit", f"fl2va={gguf}"])):
        assert main([*flags, *extra]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    # Under the same 24 / 32 GiB budget, a step moves and reads a fraction of the bf16 bytes.
    assert plans["gguf"]["bytes_per_step"] < 0.3 * plans["bf16"]["bytes_per_step"]
    assert plans["gguf"]["disk_bytes_per_step"] < plans["bf16"]["disk_bytes_per_step"]


def test_check_checkpoint_reads_a_community_dit_file(files, capsys) -> None:
    from h3engine.cli.main import main

    checkpoint = str(files["checkpoint"])
    assert main(["check-checkpoint", checkpoint, "--dit", f"fl2va={files['Q8_0']}", "--deep"]) == 0
    report = capsys.readouterr().out
    row = next(line for line in report.splitlines() if line.startswith("fl2va") and " dit " in line)
    assert "Q8_0" in row and "floats" in row and "verdict: OK" in report
    assert main(["check-checkpoint", checkpoint, "--dit", str(files["Q8_0"])]) == 2  # which partition?
    assert "--dit" in capsys.readouterr().err


def test_a_file_larger_than_this_machines_memory_opens(tmp_path) -> None:
    """A 64 GiB file (a hole) maps read-only: a copy-on-write map that large is refused on a machine with less
    memory (Linux's overcommit heuristic), a read-only one commits nothing."""
    from h3engine.checkpoint.gguf_write import write_gguf_placeholder

    path = tmp_path / "large.gguf"
    write_gguf_placeholder(path, {"blocks.0.mlp.fc1.weight": (1 << 20, 1 << 16)}, "Q8_0")
    assert path.stat().st_size > 64 * 10**9
    record = GGUFFile.open(path).record("blocks.0.mlp.fc1.weight")
    assert record.nbytes == (1 << 36) // 32 * 34 and int(record.raw[-1]) == 0


def test_a_gguf_placeholder_checkpoint_plans_and_loads_its_files(tmp_path, capsys) -> None:
    """`make-placeholder-checkpoint --weights q4_k --pruned-adaln`: GGUF DiT holes listed in gguf_files.json, which
    the folder's layout applies by itself; plan-memory plans it without --dit; at the tiny size an engine loads it."""
    from h3engine.cli.main import main
    from h3engine.memory.sizes import checkpoint_sizes

    released = tmp_path / "released"
    assert main(["make-placeholder-checkpoint", str(released), "--weights", "q4_k", "--pruned-adaln"]) == 0
    listed = json.loads((released / "gguf_files.json").read_text())
    assert set(listed) == {"fl2va", "ref2va"} and all(
        (released / name).stat().st_blocks < 4096 for name in listed.values()
    )
    capsys.readouterr()  # the folder's name
    layout = detect_layout(released)
    sizes = checkpoint_sizes(layout).partitions["fl2va"]
    assert (
        sizes.dit_config.adaln_form == "table" and sizes.dit.adaln_bytes < 1 << 30
    )  # pruned: ~40 M parameters
    assert (
        main(
            [
                "plan-memory",
                "--checkpoint",
                str(released),
                "--gpu-memory",
                "12",
                "--host-memory",
                "32",
                "--prompt-tokens",
                "1536",
                "--disk-read-gbps",
                "2",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["fits"]
    tiny = tmp_path / "tiny"
    assert main(["make-placeholder-checkpoint", str(tiny), "--tiny", "--weights", "q8_0"]) == 0
    engine = Engine.from_checkpoint(tiny, device="cpu", adaln_cache="off")
    dit = engine.store.models_for_task("t2va").dit
    assert any(isinstance(module, StoredLinear) for module in dit.modules())
    assert engine.store.placeholder  # said at load and in the sidecars, as a safetensors placeholder is


def test_a_gguf_dit_chunks_its_activations_as_the_plan_asks(files) -> None:
    """Stored linears are row-wise as nn.Linear is: a chunked forward (head groups, row chunks) runs chunked and
    equals the chunked forward of the dequantized model."""
    from h3engine.models.dit import set_activation_chunks
    from h3engine.models.dit_chunks import plain_linears

    layout = detect_layout(files["checkpoint"])
    config = read_dit_config(layout, layout.partitions["fl2va"])
    request = tiny_fl2va_request(config, torch.bfloat16, seed=9).as_h3_arguments()
    outputs = {}
    for name in ("Q8_0", "Q8_0-f32"):
        replaced = with_dit_files(layout, {"fl2va": files[name]})
        model = dit_source(replaced, replaced.partitions["fl2va"], torch.bfloat16).load(torch.device("cpu"))
        assert plain_linears(model.blocks[0].mlp.fc1, model.blocks[0].mlp.fc2, model.blocks[0].attn.qkv_proj)
        set_activation_chunks(model, 2)
        with torch.no_grad():
            outputs[name] = model(*request)
    assert isinstance(model.blocks[0].mlp.fc2, torch.nn.Linear)  # the twin: plain linears
    assert all(torch.equal(a, b) for a, b in zip(outputs["Q8_0"], outputs["Q8_0-f32"], strict=True))
