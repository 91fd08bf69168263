"""Community single files in place of the shared components' weights (`--video-vae`, `--audio-vae`,
`--text-encoder FILE`): ComfyUI-style safetensors files in bf16 / fp16 / FP8 scaled / INT8 / INT8 ConvRot, under our
module's names behind a prefix (a text encoder's also in the spellings re-packs use), dequantized at load.

Reference: the same file's values as the reader dequantizes them (float32), stored as f32: the engine then casts
each tensor once to the module's dtype either way, so the outputs are compared for equality; a file holding the
folder's own values (any prefix or spelling) gives what the folder gives. How it breaks: a prefix or spelling not
mapped, a quantized tensor read as its raw values, the store keying the component by its folder (the folder's
weights served), another component's file accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _refusals import refused
from _runtime_helpers import parity_requests
from safetensors.torch import save_file

from h3engine.checkpoint.component_files import text_encoder_key
from h3engine.checkpoint.layout import detect_layout, with_component_files
from h3engine.checkpoint.loader import audio_vae_source, video_vae_source
from h3engine.checkpoint.single_files import SingleFile
from h3engine.checkpoint.single_files_write import write_single_file
from h3engine.checkpoint.text_encoder_files import open_text_encoder_files
from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions, engine_layout
from h3engine.errors import CheckpointError, RequestError
from h3engine.models.stored_linear import StoredLinear

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")
COMPONENTS = ("video_vae", "audio_vae", "text_encoder")


def every_weight(name: str, tensor: torch.Tensor) -> bool:
    """The convolutions' weights too (the VAEs are mostly convolutions; a scale per tensor fits any shape)."""
    return name.endswith(".weight") and tensor.dim() >= 2 and tensor.is_floating_point()


# The tiny components' rows are 4 to 32 wide, so ConvRot runs in groups of 4.
FORMATS = {
    "bf16": ("bf16", {}),
    "fp16": ("f16", {}),
    "fp8_scaled": ("fp8_e4m3_scaled", {"quantized": every_weight}),
    "int8_tensorwise": ("int8_tensorwise", {"quantized": every_weight}),
    "int8_rowwise": ("int8_rowwise", {}),
    "int8_convrot": ("int8_convrot", {"convrot_group": 4}),
}
# How each component's community files name its tensors (a text encoder: Comfy's Qwen spelling).
PREFIXES = {"video_vae": "vae.", "audio_vae": "first_stage_model.", "text_encoder": ""}


def component_state(checkpoint: Path, component: str) -> dict[str, torch.Tensor]:
    """A tiny checkpoint's component, every tensor its files hold, under the module's (native) names."""
    layout = detect_layout(checkpoint)
    paths = layout.partitions["fl2va"]
    if component == "text_encoder":
        files = open_text_encoder_files(paths.text_encoder)[1]
    else:
        source = (video_vae_source if component == "video_vae" else audio_vae_source)(layout, paths)
        files = source.files
    return {key: files.tensor(key) for key in files.infos}


def comfy_spelling(name: str) -> str:
    """A stock Qwen3-VL name as ComfyUI's Qwen text-encoder files spell it (`model.layers.*`, `visual.*`)."""
    return name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)


def write_component(path: Path, state: dict[str, torch.Tensor], component: str, fmt: str, **options) -> None:
    if component == "text_encoder":
        state = {comfy_spelling(key): value for key, value in state.items()}
    write_single_file(path, state, fmt, prefix=PREFIXES[component], **options)


@pytest.fixture(scope="module")
def made(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    checkpoint = tiny_checkpoints("native", seed=5)
    folder = tmp_path_factory.mktemp("components")
    files = {"checkpoint": checkpoint}
    for component in COMPONENTS:
        state = component_state(checkpoint, component)
        files[f"{component}-keep"] = folder / f"{component}-keep.safetensors"
        write_component(files[f"{component}-keep"], state, component, "keep")
        for name, (fmt, options) in FORMATS.items():
            path = files[f"{component}-{name}"] = folder / f"{component}-{name}.safetensors"
            write_component(path, state, component, fmt, **options)
            single = SingleFile.open(path)
            twin = files[f"{component}-{name}-f32"] = folder / f"{component}-{name}-f32.safetensors"
            write_single_file(twin, {key: single.tensor(key) for key in single.records}, "f32", prefix="")
    return files


def engine(files: dict[str, Path], memory: dict | None = None, **replaced: str) -> Engine:
    layout = with_component_files(
        detect_layout(files["checkpoint"]), {component: files[name] for component, name in replaced.items()}
    )
    return Engine.from_checkpoint(layout, device="cpu", adaln_cache="off", **(memory or {}))


def outputs(engine_: Engine, task: str = "t2va"):  # noqa: ANN201
    return engine_.generate(parity_requests(steps=2, seed=3)[task])[0]


def equal_outputs(got, expected) -> bool:
    return all(torch.equal(getattr(got, name), getattr(expected, name)) for name in OUTPUTS)


@pytest.fixture(scope="module")
def folder_outputs(made):  # noqa: ANN201
    folder = engine(made)
    return {task: outputs(folder, task) for task in ("t2va", "ref2va")}


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_file_of_the_folders_values_gives_what_the_folder_gives(made, folder_outputs, component) -> None:
    replaced = engine(made, **{component: f"{component}-keep"})
    assert equal_outputs(outputs(replaced), folder_outputs["t2va"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_a_component_file_computes_what_its_dequantized_values_compute(
    made, folder_outputs, component, fmt
) -> None:
    # The audio VAE's linears (its pre-block) encode the Ref2VA audio reference: the ref2va partition, replaced too.
    task = "ref2va" if component == "audio_vae" else "t2va"
    got = outputs(engine(made, **{component: f"{component}-{fmt}"}), task)
    expected = outputs(engine(made, **{component: f"{component}-{fmt}-f32"}), task)
    assert equal_outputs(got, expected)
    # Quantized values are not the folder's: the outputs show that the file's were served.
    if set(SingleFile.open(made[f"{component}-{fmt}"]).formats()) - {"f32", "f16", "bf16"}:
        assert not equal_outputs(got, folder_outputs[task])


def test_the_video_vae_file_encodes_a_keyframe(made) -> None:
    """fl2va encodes its keyframe with the video VAE: the file's weights do it."""
    got = outputs(engine(made, video_vae="video_vae-int8_convrot"), "fl2va")
    expected = outputs(engine(made, video_vae="video_vae-int8_convrot-f32"), "fl2va")
    assert equal_outputs(got, expected)


def test_the_store_loads_the_file_not_the_folder(made, folder_outputs) -> None:
    """The store keys a replaced component by its file: the folder's weights are neither loaded nor served."""
    replaced = engine(made, audio_vae="audio_vae-fp8_scaled")
    replaced.store.models_for_task("t2va")
    assert "audio_vae:audio_vae-fp8_scaled.safetensors" in replaced.store.load_timings
    assert "audio_vae:audio_vae" not in replaced.store.load_timings
    assert not equal_outputs(outputs(replaced), folder_outputs["t2va"])


def test_text_encoder_spellings() -> None:
    assert (
        text_encoder_key("model.layers.3.mlp.up_proj.weight")
        == "model.language_model.layers.3.mlp.up_proj.weight"
    )
    assert (
        text_encoder_key("language_model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    )
    assert text_encoder_key("visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert text_encoder_key("model.visual.merger.norm.weight") == "model.visual.merger.norm.weight"
    assert text_encoder_key("lm_head.weight") == "lm_head.weight"


def test_another_components_file_is_refused_naming_it(made, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="not an H3 audio VAE file") as refused:
        engine(made, audio_vae="video_vae-bf16")
    assert "video_vae-bf16.safetensors" in str(refused.value)
    dit = tmp_path / "dit.safetensors"
    write_single_file(dit, {"blocks.0.attn.qkv_proj.weight": torch.zeros(8, 4)}, "bf16")
    with pytest.raises(CheckpointError, match="a DiT file"):
        engine({**made, "dit": dit}, video_vae="dit")
    with pytest.raises(CheckpointError, match="not an H3 text encoder file"):
        engine(made, text_encoder="audio_vae-bf16")


def test_a_missing_or_unread_tensor_is_refused_naming_it(made, tmp_path) -> None:
    state = component_state(made["checkpoint"], "video_vae")
    dropped = sorted(state)[0]
    partial = tmp_path / "partial.safetensors"
    write_single_file(partial, {k: v for k, v in state.items() if k != dropped}, "keep", prefix="")
    with pytest.raises(CheckpointError, match=f"missing tensor '{dropped}'"):
        engine({**made, "partial": partial}, video_vae="partial")
    mxfp8 = tmp_path / "mxfp8.safetensors"
    tensors = {f"vae.{key}": value for key, value in state.items()}
    layer = next(key for key, value in state.items() if key.endswith(".weight") and value.dim() == 2)
    tensors[f"vae.{layer.removesuffix('.weight')}.comfy_quant"] = torch.tensor(
        list(b'{"format": "mxfp8"}'), dtype=torch.uint8
    )
    tensors[f"vae.{layer}"] = torch.zeros(state[layer].shape, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(mxfp8))
    with pytest.raises(CheckpointError, match="mxfp8") as refused:
        engine({**made, "mxfp8": mxfp8}, video_vae="mxfp8")
    assert layer.removesuffix(".weight") in str(refused.value)


def test_gguf_vaes_and_missing_files_are_refused(made, tmp_path) -> None:
    """(A GGUF text encoder is read: tests/test_text_encoder_gguf.py.)"""
    gguf = tmp_path / "video_vae-Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="a GGUF video VAE file is not read") as error:
        engine({**made, "gguf": gguf}, video_vae="gguf")
    assert gguf.name in str(error.value)
    with refused(RequestError, field="--video-vae"):
        engine_layout(made["checkpoint"], EngineOptions(video_vae=str(tmp_path / "absent.safetensors")))
    layout = engine_layout(made["checkpoint"], EngineOptions(text_encoder=str(made["text_encoder-bf16"])))
    assert all(paths.text_encoder_home == made["text_encoder-bf16"] for paths in layout.partitions.values())


@pytest.mark.parametrize(
    "memory", [{}, {"memory_profile": "streamed", "host_memory": 1e-6}], ids=["resident", "streamed"]
)
def test_a_text_encoder_file_keeps_its_quantized_linears(made, memory) -> None:
    """On one rank the INT8 ConvRot text encoder's linears stay its bytes and scales (StoredLinear), resident or
    streamed from the file, and compute what the dequantized file computes."""
    quantized = engine(made, memory, text_encoder="text_encoder-int8_convrot")
    encoder = quantized.store.models_for_task("t2va").text_encoder
    stored = [module for module in encoder.modules() if isinstance(module, StoredLinear)]
    assert stored and all(module.quantized.dtype == torch.uint8 for module in stored)
    twin = engine(made, memory, text_encoder="text_encoder-int8_convrot-f32")
    assert not any(
        isinstance(module, StoredLinear)
        for module in twin.store.models_for_task("t2va").text_encoder.modules()
    )
    assert equal_outputs(outputs(quantized), outputs(twin))


def test_plan_memory_plans_a_text_encoder_file_at_its_stored_size(made, capsys) -> None:
    from h3engine.cli.main import main
    from h3engine.memory.sizes import checkpoint_sizes

    folder = checkpoint_sizes(detect_layout(made["checkpoint"])).partitions["fl2va"].text_encoder
    layout = with_component_files(
        detect_layout(made["checkpoint"]), {"text_encoder": made["text_encoder-int8_rowwise"]}
    )
    stored = checkpoint_sizes(layout).partitions["fl2va"].text_encoder
    assert (
        stored.layers_total < folder.layers_total and stored.dequantized_bytes > 0 == folder.dequantized_bytes
    )
    flags = ["plan-memory", "--checkpoint", str(made["checkpoint"]), "--gpu-memory", "4", "--json"]
    assert main([*flags, "--text-encoder", str(made["text_encoder-int8_rowwise"])]) == 0
    assert '"fits": true' in capsys.readouterr().out


def test_check_checkpoint_checks_a_component_file(made, capsys) -> None:
    from h3engine.cli.main import main

    checkpoint = str(made["checkpoint"])
    assert (
        main(["check-checkpoint", checkpoint, "--text-encoder", str(made["text_encoder-int8_rowwise"])]) == 0
    )
    report = capsys.readouterr().out
    row = next(line for line in report.splitlines() if " text_encoder " in line)
    assert "int8 x row scale" in row and "verdict: OK" in report  # the file's quantized linears, kept
    # A text encoder file given as the video VAE: that component fails, naming the file.
    assert main(["check-checkpoint", checkpoint, "--video-vae", str(made["text_encoder-bf16"])]) == 2
    assert "text_encoder-bf16.safetensors" in capsys.readouterr().out


def test_a_mixed_fp8_video_vae_reads_its_plain_fp8_weights_cast(made, tmp_path) -> None:
    """An 'fp8mix' VAE: the convolutions' weights stored as plain float8_e4m3fn (no scale), the rest fp16. The
    reference: the same values widened to f32 in a file (the loader casts either to the module's dtype once)."""
    state = component_state(made["checkpoint"], "video_vae")
    formats = {key: "fp8_e4m3" if every_weight(key, value) else "f16" for key, value in state.items()}
    assert "fp8_e4m3" in formats.values() and "f16" in formats.values()
    mixed = tmp_path / "video_vae-fp8mix.safetensors"
    write_single_file(mixed, state, formats, prefix="")
    single = SingleFile.open(mixed)
    assert {single.records[key].format for key in single.records} == {"fp8_e4m3", "f16"}
    twin = tmp_path / "video_vae-fp8mix-f32.safetensors"
    write_single_file(twin, {key: single.tensor(key) for key in single.records}, "f32", prefix="")
    files = {**made, "mixed": mixed, "twin": twin}
    assert equal_outputs(outputs(engine(files, video_vae="mixed")), outputs(engine(files, video_vae="twin")))
