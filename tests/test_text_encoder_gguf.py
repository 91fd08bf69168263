"""A llama.cpp GGUF text encoder (`--text-encoder FILE.gguf` with its mmproj file beside it).

The files are written here as llama.cpp's converter writes Qwen3-VL (the names spelled out below from its published
converter, not from our reader's map): the language model under `qwen3vl` names, the vision tower in an `mmproj`
file under `clip` names, the merger as `mm.0` / `mm.2` / `v.post_ln`, deepstack mergers under the vision layer they
tap, the patch convolution split along time. Reference: the folder's text encoder (F32 / BF16 files hold its values
exactly, so the outputs are equal), and for quantized files the same files' values as gguf-py dequantizes them,
written as F32 (equal outputs: the module's dtype is the one rounding either way). How it breaks: a name mapped to
another tensor (the outputs differ), the patch halves stacked in the wrong order, a quantized linear read as its raw
bytes, a quantized embedding not dequantized, the mmproj file of another model accepted.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _runtime_helpers import parity_requests
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from h3engine.checkpoint.gguf_write import write_gguf
from h3engine.checkpoint.layout import detect_layout, with_component_files
from h3engine.checkpoint.loader import load_text_encoder
from h3engine.checkpoint.text_encoder_files import open_text_encoder_files, write_tiny_text_encoder
from h3engine.checkpoint.text_encoder_gguf import find_mmproj, llama_cpp_name
from h3engine.engine.engine import Engine
from h3engine.errors import CheckpointError
from h3engine.models.stored_linear import StoredLinear

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")
# llama.cpp's names for a decoder layer's and a vision block's tensors (its converter, gguf-py's tensor map).
LANGUAGE_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
VISION_NAMES = {
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down",
}
MERGER_NAMES = {"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}
DEEPSTACK_NAMES = {"linear_fc1": "fc1", "linear_fc2": "fc2", "norm": "norm"}


def converted(key: str, tensor: torch.Tensor, deepstack: list[int]) -> dict[str, torch.Tensor]:
    """What llama.cpp's Qwen3-VL converter writes for the stock tensor `key` (one or two tensors)."""
    if key == "lm_head.weight":
        return {"output.weight": tensor}
    if key.startswith("model.language_model."):
        rest = key.removeprefix("model.language_model.")
        if match := re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", rest):
            return {f"blk.{match[1]}.{LANGUAGE_NAMES[match[2]]}.{match[3]}": tensor}
        return {
            {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}[rest]: tensor
        }
    rest = key.removeprefix("model.visual.")
    if rest == "patch_embed.proj.weight":
        return {"v.patch_embd.weight": tensor[:, :, 0], "v.patch_embd.weight.1": tensor[:, :, 1]}
    if match := re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", rest):
        return {f"v.blk.{match[1]}.{VISION_NAMES[match[2]]}.{match[3]}": tensor}
    if match := re.fullmatch(r"deepstack_merger_list\.(\d+)\.(\w+)\.(weight|bias)", rest):
        return {f"v.deepstack.{deepstack[int(match[1])]}.{DEEPSTACK_NAMES[match[2]]}.{match[3]}": tensor}
    if match := re.fullmatch(r"merger\.(\w+)\.(weight|bias)", rest):
        return {f"{MERGER_NAMES[match[1]]}.{match[2]}": tensor}
    simple = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight"}
    return {simple[rest]: tensor}


def write_llama_cpp_files(
    folder: Path, text_encoder: Path, types: str, stem: str = "Qwen3-VL-tiny"
) -> tuple[Path, Path]:
    """The `text_encoder/` folder's weights as a llama.cpp text GGUF and an mmproj GGUF in `folder`, every tensor of
    whole blocks in `types` (F32 / BF16 / Q8_0 / Q4_0 ...); -> (text file, mmproj file)."""
    config = json.loads((text_encoder / "config.json").read_text())
    deepstack = config["vision_config"]["deepstack_visual_indexes"]
    files = open_text_encoder_files(text_encoder)[1]
    text, vision = {}, {}
    for key in files.infos:
        target = text if not key.startswith("model.visual.") else vision
        target.update(converted(key, files.tensor(key), deepstack))
    folder.mkdir(parents=True, exist_ok=True)
    text_path, vision_path = folder / f"{stem}-{types}.gguf", folder / f"mmproj-{stem}-{types}.gguf"
    write_gguf(text_path, text, types, architecture="qwen3vl")
    write_gguf(vision_path, vision, types, architecture="clip")
    return text_path, vision_path


def dequantized_twin(path: Path, out: Path) -> Path:
    """`path` with every tensor as gguf-py dequantizes it, stored as F32, under the same name in `out`."""
    reader = GGUFReader(path)
    architecture = reader.get_field("general.architecture").contents()
    values = {
        tensor.name: torch.from_numpy(
            np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(
                tuple(reversed(tensor.shape.tolist()))
            )
        )
        for tensor in reader.tensors
    }
    write_gguf(out, values, "F32", architecture=architecture)
    return out


@pytest.fixture(scope="module")
def made(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    checkpoint = tiny_checkpoints("native", seed=5)
    text_encoder = detect_layout(checkpoint).partitions["fl2va"].text_encoder
    root = tmp_path_factory.mktemp("te_gguf")
    files = {"checkpoint": checkpoint, "text_encoder": text_encoder}
    for types in ("F32", "BF16", "Q8_0"):
        files[types] = write_llama_cpp_files(root / types, text_encoder, types)[0]
    twin = root / "Q8_0-twin"
    twin.mkdir()
    for path in (root / "Q8_0").iterdir():
        dequantized_twin(path, twin / path.name)
    files["Q8_0-twin"] = twin / files["Q8_0"].name
    return files


def engine(files: dict[str, Path], name: str | None = None, memory: dict | None = None) -> Engine:
    layout = detect_layout(files["checkpoint"])
    if name is not None:
        layout = with_component_files(layout, {"text_encoder": files[name]})
    return Engine.from_checkpoint(layout, device="cpu", adaln_cache="off", **(memory or {}))


def outputs(engine_: Engine, task: str):  # noqa: ANN201
    return engine_.generate(parity_requests(steps=2, seed=3)[task])[0]


def assert_equal_outputs(got, expected) -> None:
    for name in OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_llama_cpp_names_are_the_converters() -> None:
    deepstack = [8, 16, 24]
    assert llama_cpp_name("model.language_model.layers.7.self_attn.o_proj.weight", 64, 27, deepstack) == (
        "blk.7.attn_output.weight"
    )
    assert (
        llama_cpp_name("model.language_model.embed_tokens.weight", 64, 27, deepstack) == "token_embd.weight"
    )
    assert llama_cpp_name("model.visual.blocks.3.attn.qkv.bias", 64, 27, deepstack) == "v.blk.3.attn_qkv.bias"
    assert llama_cpp_name("model.visual.deepstack_merger_list.1.linear_fc2.weight", 64, 27, deepstack) == (
        "v.deepstack.16.fc2.weight"
    )
    assert llama_cpp_name("model.visual.merger.linear_fc2.bias", 64, 27, deepstack) == "mm.2.bias"
    assert llama_cpp_name("model.visual.merger.norm.weight", 64, 27, deepstack) == "v.post_ln.weight"
    assert llama_cpp_name("model.visual.patch_embed.proj.weight", 64, 27, deepstack) == "v.patch_embd.weight"
    with pytest.raises(CheckpointError, match="model.visual.deepstack_merger_list.3.norm.weight"):
        llama_cpp_name("model.visual.deepstack_merger_list.3.norm.weight", 64, 27, deepstack)


@pytest.mark.parametrize("types", ["F32", "BF16"])
def test_a_gguf_of_the_folders_values_gives_what_the_folder_gives(made, types) -> None:
    """T2VA reads the language model; Ref2VA's image reference runs the vision tower (patch halves, deepstack)."""
    folder, replaced = engine(made), engine(made, types)
    for task in ("t2va", "ref2va"):
        assert_equal_outputs(outputs(replaced, task), outputs(folder, task))


@pytest.mark.parametrize(
    "memory", [{}, {"memory_profile": "streamed", "host_memory": 1e-6}], ids=["resident", "streamed"]
)
def test_quantized_linears_stay_quantized_and_compute_the_dequantized_file(made, memory) -> None:
    """Resident, or streamed from the two files (the bytes at each tensor's offset in its own file)."""
    quantized, twin = engine(made, "Q8_0", memory), engine(made, "Q8_0-twin", memory)
    encoder = quantized.store.models_for_task("ref2va").text_encoder
    stored = [module for module in encoder.modules() if isinstance(module, StoredLinear)]
    # The tiny vision tower's 32- and 64-wide linears are whole Q8_0 blocks; the 8- and 16-wide ones stay F32.
    assert stored and all(module.form.name == "Q8_0" for module in stored)
    assert_equal_outputs(outputs(quantized, "ref2va"), outputs(twin, "ref2va"))


def test_a_quantized_embedding_and_language_model_read_as_gguf_py_dequantizes_them(tmp_path) -> None:
    """A text encoder 32 wide: the token embeddings and every language linear are whole Q8_0 / Q4_0 blocks."""
    folder = tmp_path / "text_encoder"
    write_tiny_text_encoder(folder, seed=4, text_dim=32)
    config = json.loads((folder / "config.json").read_text())
    ids = torch.tensor([[5, 9, 17, 33, 2, *[config["image_token_id"]] * 4, 40]])
    vision = {
        "pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1)),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    exact = load_text_encoder(folder, "cpu", torch.float32).encode(ids, **vision)
    errors = {}
    for types in ("Q8_0", "Q4_0"):
        text, _ = write_llama_cpp_files(tmp_path / types, folder, types)
        twin = tmp_path / f"{types}-twin"
        twin.mkdir()
        for path in (tmp_path / types).iterdir():
            dequantized_twin(path, twin / path.name)
        encoder = load_text_encoder(folder, "cpu", torch.float32, weights=text)
        assert isinstance(encoder.model.language_model.layers[0].mlp.down_proj, StoredLinear)
        got = encoder.encode(ids, **vision)
        want = load_text_encoder(folder, "cpu", torch.float32, weights=twin / text.name).encode(ids, **vision)
        assert torch.equal(got, want), types
        errors[types] = ((got - exact).norm() / exact.norm()).item()
    # Near the unquantized encoder, nearer with more bits, and nearer than another seed's encoder is (the rounding
    # of the weights, not other tensors' values).
    other = tmp_path / "other"
    write_tiny_text_encoder(other, seed=5, text_dim=32)
    unrelated = load_text_encoder(other, "cpu", torch.float32).encode(ids, **vision)
    assert 0 < errors["Q8_0"] < errors["Q4_0"] < ((unrelated - exact).norm() / exact.norm()).item()


def test_the_mmproj_file_is_found_beside_the_text_file(tmp_path) -> None:
    text = tmp_path / "Qwen3-VL-32B-Instruct-Q4_K_M.gguf"
    for name in (text.name, "mmproj-Qwen3-VL-32B-Instruct-F16.gguf", "mmproj-Other-Model-F16.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    assert find_mmproj(text).name == "mmproj-Qwen3-VL-32B-Instruct-F16.gguf"
    (tmp_path / "mmproj-Qwen3-VL-32B-Instruct-BF16.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="several mmproj") as refused:
        find_mmproj(text)
    assert "mmproj-Qwen3-VL-32B-Instruct-BF16.gguf" in str(refused.value)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "te.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="no mmproj file"):
        find_mmproj(lone / "te.gguf")


def test_wrong_files_are_refused_naming_them(made, tmp_path) -> None:
    text, vision = made["F32"], find_mmproj(made["F32"])
    with pytest.raises(CheckpointError, match="an mmproj") as refused:
        engine({**made, "wrong": vision}, "wrong")
    assert vision.name in str(refused.value)
    other = tmp_path / "other"
    other.mkdir()
    qwen3 = other / "qwen3-Q8_0.gguf"
    write_gguf(qwen3, {"blk.0.attn_q.weight": torch.zeros(64, 64)}, "Q8_0", architecture="qwen3")
    with pytest.raises(CheckpointError, match="'qwen3'"):
        engine({**made, "qwen3": qwen3}, "qwen3")
    # The mmproj of another (wider) model beside the right text file: refused naming the tensor and both shapes.
    wide = tmp_path / "wide"
    write_tiny_text_encoder(wide / "text_encoder", seed=4, text_dim=32)
    write_llama_cpp_files(wide / "files", wide / "text_encoder", "F32", stem="x")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(text, mixed / "x-F32.gguf")
    shutil.copy(find_mmproj(wide / "files" / "x-F32.gguf"), mixed / "mmproj-x-F32.gguf")
    with pytest.raises(CheckpointError, match=r"mmproj-x-F32.gguf: tensor 'mm\.2\.weight' has shape"):
        engine({**made, "mixed": mixed / "x-F32.gguf"}, "mixed")


def test_a_type_we_do_not_read_is_refused_naming_the_tensor_and_the_type(made, tmp_path) -> None:
    folder = tmp_path / "iq"
    shutil.copytree(made["F32"].parent, folder)
    vision = find_mmproj(folder / made["F32"].name)
    reader = GGUFReader(find_mmproj(made["F32"]))
    writer = GGUFWriter(vision, "clip")
    for tensor in reader.tensors:
        if tensor.name != "v.blk.1.ffn_down.weight":
            writer.add_tensor(
                tensor.name, np.array(tensor.data).reshape(tuple(reversed(tensor.shape.tolist())))
            )
    # 16 rows of 32 values: one IQ4_NL block (18 bytes) per row.
    writer.add_tensor(
        "v.blk.1.ffn_down.weight", np.zeros((16, 18), np.uint8), raw_dtype=GGMLQuantizationType.IQ4_NL
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="IQ4_NL") as refused:
        engine({**made, "iq": folder / made["F32"].name}, "iq")
    assert "v.blk.1.ffn_down.weight" in str(refused.value)


def test_check_checkpoint_and_plan_memory_read_a_gguf_text_encoder(made, capsys) -> None:
    from h3engine.cli.main import main
    from h3engine.memory.sizes import checkpoint_sizes

    checkpoint = str(made["checkpoint"])
    assert main(["check-checkpoint", checkpoint, "--text-encoder", str(made["Q8_0"])]) == 0
    report = capsys.readouterr().out
    row = next(line for line in report.splitlines() if " text_encoder " in line)
    assert "Q8_0" in row and "verdict: OK" in report
    folder = checkpoint_sizes(detect_layout(made["checkpoint"])).partitions["fl2va"].text_encoder
    layout = with_component_files(detect_layout(made["checkpoint"]), {"text_encoder": made["Q8_0"]})
    stored = checkpoint_sizes(layout).partitions["fl2va"].text_encoder
    assert stored.dequantized_bytes > 0 == folder.dequantized_bytes
    flags = ["plan-memory", "--checkpoint", checkpoint, "--gpu-memory", "4", "--json"]
    assert main([*flags, "--text-encoder", str(made["Q8_0"])]) == 0
    assert '"fits": true' in capsys.readouterr().out
    assert main(["check-checkpoint", checkpoint, "--text-encoder", str(find_mmproj(made["Q8_0"]))]) == 2
    assert "an mmproj" in capsys.readouterr().out
