"""H3 text encoder: parity with transformers' full Qwen3-VL and with diffusers' MiniMax-H3 text encoder blocks.

One tiny checkpoint (52-layer Qwen3-VL, bf16, two shards) is written by our writers and read twice: by
`load_text_encoder` (50 layers, no final norm, lazy strict reads) and by transformers'
`Qwen3VLForConditionalGeneration.from_pretrained` (all layers), whose `hidden_states[50]` is the reference. The same
reference model drives diffusers' `MiniMaxH3TextEncoderStep` / `MiniMaxH3FL2VATextEncoderStep` run standalone.

Without torchvision transformers refuses to build a `Qwen3VLProcessor` (its type check trips over the placeholder
video-processor mapping); diffusers only uses the processor for `create_mm_token_type_ids` and `image_processor`, so
the tests build a real `Qwen3VLProcessor` with that type check bypassed (`_qwen3_vl_processor`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3FL2VATextEncoderStep,
    MiniMaxH3TextEncoderStep,
)
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.utils import is_torchvision_available

from h3engine.checkpoint.loader import load_text_encoder
from h3engine.checkpoint.text_encoder_files import (
    SHARD_FILE_NAMES,
    TINY_TEXT_NUM_LAYERS,
    TINY_TOKEN_IDS,
    load_tokenizer,
    tiny_image_processor_settings,
    write_tiny_processor,
    write_tiny_text_encoder,
    write_tiny_tokenizer,
)
from h3engine.errors import CheckpointError
from h3engine.models.text_encoder import (
    H3_TEXT_ENCODER_LAYERS,
    TEXT_ROW_TAG,
    VIDEO_ROW_TAG,
    H3TextEncoder,
    text_row_tags,
    tokenize_prompt,
)

PROMPT = (
    "The old fisherman looks up and says <d>[English] Good morning! The sea is calm today.</d> Waves crash."
)
SEED = 0
DTYPES = [torch.float32, torch.bfloat16]
# Ours runs the very same Qwen3-VL modules on the same weights, so the only allowed difference is none at all;
# the bound is stated as a relative error so a failure message shows how far off it is.
MAX_RELATIVE_ERROR = 1e-6
INDEX_NAME = "model.safetensors.index.json"


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny_text_side")
    write_tiny_text_encoder(root / "text_encoder", SEED)
    write_tiny_tokenizer(root / "tokenizer")
    write_tiny_processor(root / "processor")
    return root


@pytest.fixture(scope="module")
def tokenizer(tiny_root: Path):
    return load_tokenizer(tiny_root / "tokenizer")


@pytest.fixture(scope="module")
def reference_models(tiny_root: Path) -> dict[torch.dtype, Qwen3VLForConditionalGeneration]:
    return {
        dtype: Qwen3VLForConditionalGeneration.from_pretrained(
            tiny_root / "text_encoder", dtype=dtype, local_files_only=True
        ).eval()
        for dtype in DTYPES
    }


@pytest.fixture(scope="module")
def encoders(tiny_root: Path) -> dict[torch.dtype, H3TextEncoder]:
    return {dtype: load_text_encoder(tiny_root / "text_encoder", "cpu", dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def processor(tiny_root: Path, tokenizer) -> Qwen3VLProcessor:
    return _qwen3_vl_processor(tiny_root / "processor", tokenizer)


def _qwen3_vl_processor(folder: Path, tokenizer) -> Qwen3VLProcessor:
    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    video_settings = json.loads((folder / "video_preprocessor_config.json").read_text())
    for class_field in ("processor_class", "video_processor_type"):
        video_settings.pop(class_field)
    video_processor = Qwen3VLVideoProcessor(**video_settings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, argument: None)
        return Qwen3VLProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor
        )


def _reference_hidden_state_50(model: Qwen3VLForConditionalGeneration, input_ids: torch.Tensor, **vision):
    mm_token_type_ids = torch.zeros_like(input_ids)
    mm_token_type_ids[input_ids == model.config.image_token_id] = 1
    mm_token_type_ids[input_ids == model.config.video_token_id] = 2
    with torch.no_grad():
        outputs = model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_token_type_ids,
            use_cache=False,
            output_hidden_states=True,
            **vision,
        )
    return outputs.hidden_states


def _vision_block_ids(pad_token: str, count: int) -> list[int]:
    return (
        [TINY_TOKEN_IDS["<|vision_start|>"]]
        + [TINY_TOKEN_IDS[pad_token]] * count
        + [TINY_TOKEN_IDS["<|vision_end|>"]]
    )


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenize_prompt(tokenizer, text)[0].tolist()


def _keyframe(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# ------------------------------------------------------------------------------------------------ tokenizer, config


def test_tiny_tokenizer_tokens_and_prompt_tokenization(tokenizer) -> None:
    for token, token_id in TINY_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    input_ids = tokenize_prompt(tokenizer, PROMPT)
    assert input_ids.dtype == torch.long and input_ids.shape[0] == 1
    ids = input_ids[0].tolist()
    # <d> and </d> are single tokens, and nothing (no BOS/EOS, no template) is added around the prompt.
    assert ids.count(TINY_TOKEN_IDS["<d>"]) == 1 and ids.count(TINY_TOKEN_IDS["</d>"]) == 1
    assert ids == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == PROMPT
    assert all(
        token_id < TINY_TOKEN_IDS["<|endoftext|>"] for token_id in _text_ids(tokenizer, "Waves crash.")
    )


def test_tiny_config_is_consistent(tiny_root: Path, tokenizer) -> None:
    config = json.loads((tiny_root / "text_encoder" / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["num_hidden_layers"] == TINY_TEXT_NUM_LAYERS > H3_TEXT_ENCODER_LAYERS
    assert text["hidden_size"] == vision["out_hidden_size"] == 8
    assert sum(text["rope_scaling"]["mrope_section"]) == text["head_dim"] // 2
    assert text["vocab_size"] >= len(tokenizer)
    assert all(index < vision["depth"] for index in vision["deepstack_visual_indexes"])
    for field, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert config[field] == TINY_TOKEN_IDS[token]
    total_bytes = sum(path.stat().st_size for path in tiny_root.rglob("*") if path.is_file())
    assert total_bytes < 5 * 1024 * 1024
    index = json.loads((tiny_root / "text_encoder" / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == list(SHARD_FILE_NAMES)


def test_load_builds_only_what_h3_reads(encoders: dict[torch.dtype, H3TextEncoder], tokenizer) -> None:
    for dtype, encoder in encoders.items():
        keys = list(encoder.state_dict())
        assert len(encoder.model.language_model.layers) == H3_TEXT_ENCODER_LAYERS
        assert not any(
            key.startswith("lm_head") or key.startswith("model.language_model.norm") for key in keys
        )
        assert "model.language_model.layers.49.mlp.down_proj.weight" in keys
        assert "model.visual.deepstack_merger_list.1.linear_fc2.bias" in keys
        assert all(parameter.dtype == dtype for parameter in encoder.parameters())
        assert encoder.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
        encoder.verify_tokenizer(tokenizer)


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_encode_equals_transformers_hidden_state_50(dtype, encoders, reference_models, tokenizer) -> None:
    input_ids = tokenize_prompt(tokenizer, PROMPT)
    ours = encoders[dtype].encode(input_ids)
    reference_states = _reference_hidden_state_50(reference_models[dtype], input_ids)
    reference = reference_states[H3_TEXT_ENCODER_LAYERS][0]
    assert ours.shape == (input_ids.shape[1], 8) and ours.dtype == dtype
    assert _relative_error(ours, reference) <= MAX_RELATIVE_ERROR
    # The comparison can fail: the next layer's state and the final-normed state are far from layer 50's.
    assert _relative_error(reference_states[H3_TEXT_ENCODER_LAYERS + 1][0], reference) > 0.05
    normed = reference_models[dtype].model.language_model.norm(reference)
    assert _relative_error(normed, reference) > 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_encode_with_image_and_video_equals_transformers(
    dtype, encoders, reference_models, tokenizer, processor
):
    image_inputs = processor.image_processor(images=[_keyframe(60, 100, seed=1)], return_tensors="pt")
    image_tokens = int(image_inputs["image_grid_thw"][0].prod()) // 4
    # Two temporal blocks of a 64 x 96 video (4 x 6 patches, 6 tokens per block); random pixels stand in for the
    # video processor, which needs torchvision.
    video_grid_thw = torch.tensor([[2, 4, 6]])
    video_pixels = torch.randn(
        int(video_grid_thw.prod()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(2)
    )
    ids = _text_ids(tokenizer, "<Picture 1>: ") + _vision_block_ids("<|image_pad|>", image_tokens)
    ids += _text_ids(tokenizer, "<Video 1>: ")
    for timestamp in ("<0.2 seconds>", "<1.2 seconds>"):
        ids += _text_ids(tokenizer, timestamp) + _vision_block_ids("<|video_pad|>", 6)
    ids += _text_ids(tokenizer, PROMPT)
    input_ids = torch.tensor([ids])
    vision = {
        "pixel_values": image_inputs["pixel_values"],
        "image_grid_thw": image_inputs["image_grid_thw"],
        "pixel_values_videos": video_pixels,
        "video_grid_thw": video_grid_thw,
    }

    ours = encoders[dtype].encode(input_ids, **vision)
    reference = _reference_hidden_state_50(reference_models[dtype], input_ids, **vision)[
        H3_TEXT_ENCODER_LAYERS
    ][0]
    assert _relative_error(ours, reference) <= MAX_RELATIVE_ERROR

    tags = text_row_tags(input_ids, tokenizer)
    vision_rows = (
        torch.isin(
            input_ids[0],
            torch.tensor([TINY_TOKEN_IDS[token] for token in ("<|vision_start|>", "<|vision_end|>")]),
        )
        | (input_ids[0] == TINY_TOKEN_IDS["<|image_pad|>"])
        | (input_ids[0] == TINY_TOKEN_IDS["<|video_pad|>"])
    )
    assert int(vision_rows.sum()) == (image_tokens + 2) + 2 * (6 + 2)
    assert torch.equal(tags, torch.where(vision_rows, VIDEO_ROW_TAG, TEXT_ROW_TAG))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_t2va_equals_diffusers_text_encoder_step(
    dtype, encoders, reference_models, tokenizer, processor
) -> None:
    pipeline = MiniMaxH3TextEncoderStep().init_pipeline()
    pipeline.update_components(text_encoder=reference_models[dtype], tokenizer=tokenizer, processor=processor)
    state = pipeline(prompt=PROMPT)

    input_ids = tokenize_prompt(tokenizer, PROMPT)
    ours = encoders[dtype].encode(input_ids)
    reference = state.get("prompt_embeds")
    assert reference.shape == (1, input_ids.shape[1], 8) and reference.dtype == dtype
    assert _relative_error(ours, reference[0]) <= MAX_RELATIVE_ERROR
    assert torch.equal(text_row_tags(input_ids, tokenizer), state.get("text_token_tags"))


def test_fl2va_presentation_equals_diffusers_fl2va_step(
    encoders, reference_models, tokenizer, processor
) -> None:
    keyframes = [_keyframe(96, 160, seed=3), _keyframe(64, 64, seed=4)]
    pipeline = MiniMaxH3FL2VATextEncoderStep().init_pipeline()
    pipeline.update_components(
        text_encoder=reference_models[torch.float32], tokenizer=tokenizer, processor=processor
    )
    state = pipeline(prompt=PROMPT, keyframes=keyframes)

    # The FL2VA presentation (spec section 4), rebuilt here: "<Picture i>: " + vision block per keyframe, then the prompt.
    image_inputs = processor.image_processor(images=keyframes, return_tensors="pt")
    ids: list[int] = []
    for picture_number, grid in enumerate(image_inputs["image_grid_thw"], start=1):
        ids += _text_ids(tokenizer, f"<Picture {picture_number}>: ")
        ids += _vision_block_ids("<|image_pad|>", int(grid.prod()) // 4)
    input_ids = torch.tensor([ids + _text_ids(tokenizer, PROMPT)])
    ours = encoders[torch.float32].encode(
        input_ids, pixel_values=image_inputs["pixel_values"], image_grid_thw=image_inputs["image_grid_thw"]
    )
    assert _relative_error(ours, state.get("prompt_embeds")[0]) <= MAX_RELATIVE_ERROR
    assert torch.equal(text_row_tags(input_ids, tokenizer), state.get("text_token_tags"))


# ------------------------------------------------------------------------------------------------ strict loading


@pytest.fixture
def checkpoint_copy(tiny_root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_root / "text_encoder", tmp_path / "text_encoder"))


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_NAME).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))


def _rewrite_shard(path: Path, change) -> None:
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _shard_holding(folder: Path, key: str) -> Path:
    return folder / _index(folder)["weight_map"][key]


NEEDED_KEY = "model.language_model.layers.7.self_attn.k_proj.weight"


def test_missing_shard_names_file_and_key(checkpoint_copy: Path) -> None:
    (checkpoint_copy / SHARD_FILE_NAMES[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"{SHARD_FILE_NAMES[1]}.*tensor '"):
        load_text_encoder(checkpoint_copy, "cpu")


def test_truncated_shard_names_file_and_key(checkpoint_copy: Path) -> None:
    shard = checkpoint_copy / SHARD_FILE_NAMES[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{SHARD_FILE_NAMES[0]}.*tensor 'model\."):
        load_text_encoder(checkpoint_copy, "cpu")


def test_garbage_shard_names_file_and_key(checkpoint_copy: Path) -> None:
    (checkpoint_copy / SHARD_FILE_NAMES[0]).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=rf"{SHARD_FILE_NAMES[0]}.*tensor 'model\."):
        load_text_encoder(checkpoint_copy, "cpu")


def test_key_missing_from_shard_names_file_and_key(checkpoint_copy: Path) -> None:
    shard = _shard_holding(checkpoint_copy, NEEDED_KEY)
    _rewrite_shard(shard, lambda state: state.pop(NEEDED_KEY))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing tensor '{NEEDED_KEY}'"):
        load_text_encoder(checkpoint_copy, "cpu")


def test_key_missing_from_checkpoint_names_key(checkpoint_copy: Path) -> None:
    shard = _shard_holding(checkpoint_copy, NEEDED_KEY)
    _rewrite_shard(shard, lambda state: state.pop(NEEDED_KEY))
    index = _index(checkpoint_copy)
    del index["weight_map"][NEEDED_KEY]
    _write_index(checkpoint_copy, index)
    with pytest.raises(CheckpointError, match=rf"missing tensor '{NEEDED_KEY}'"):
        load_text_encoder(checkpoint_copy, "cpu")


def test_wrong_shape_names_file_and_key(checkpoint_copy: Path) -> None:
    shard = _shard_holding(checkpoint_copy, NEEDED_KEY)
    _rewrite_shard(shard, lambda state: state.update({NEEDED_KEY: torch.zeros(8, 9, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor '{NEEDED_KEY}' has shape \[8, 9\]"):
        load_text_encoder(checkpoint_copy, "cpu")


@pytest.mark.parametrize(
    "unexpected_key",
    [
        "model.language_model.extra_scale.weight",
        f"model.language_model.layers.{TINY_TEXT_NUM_LAYERS}.mlp.up_proj.weight",  # past the config's last layer
        "model.visual.blocks.0.attn.qkv.extra",
    ],
)
def test_unexpected_key_names_file_and_key(checkpoint_copy: Path, unexpected_key: str) -> None:
    shard = checkpoint_copy / SHARD_FILE_NAMES[1]
    _rewrite_shard(shard, lambda state: state.update({unexpected_key: torch.zeros(2, dtype=torch.bfloat16)}))
    index = _index(checkpoint_copy)
    index["weight_map"][unexpected_key] = SHARD_FILE_NAMES[1]
    _write_index(checkpoint_copy, index)
    with pytest.raises(
        CheckpointError, match=rf"{SHARD_FILE_NAMES[1]}: unexpected tensor '{unexpected_key}'"
    ):
        load_text_encoder(checkpoint_copy, "cpu")


def test_shard_key_not_in_index_is_unexpected(checkpoint_copy: Path) -> None:
    shard = checkpoint_copy / SHARD_FILE_NAMES[0]
    _rewrite_shard(
        shard, lambda state: state.update({"model.visual.stray": torch.zeros(2, dtype=torch.bfloat16)})
    )
    with pytest.raises(
        CheckpointError, match=rf"{SHARD_FILE_NAMES[0]}: tensor 'model\.visual\.stray' is not listed"
    ):
        load_text_encoder(checkpoint_copy, "cpu")


def test_config_with_50_layers_is_rejected(checkpoint_copy: Path) -> None:
    config_path = checkpoint_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["num_hidden_layers"] = H3_TEXT_ENCODER_LAYERS
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: key text_config\.num_hidden_layers is 50"):
        load_text_encoder(checkpoint_copy, "cpu")


def test_missing_config_and_weights_are_rejected(checkpoint_copy: Path) -> None:
    (checkpoint_copy / INDEX_NAME).unlink()
    with pytest.raises(
        CheckpointError, match=r"neither model\.safetensors\.index\.json nor model\.safetensors"
    ):
        load_text_encoder(checkpoint_copy, "cpu")
    (checkpoint_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing text encoder config: .*config\.json"):
        load_text_encoder(checkpoint_copy, "cpu")


def test_unused_keys_are_optional_and_single_file_loads(checkpoint_copy: Path, encoders, tokenizer) -> None:
    unused = {"lm_head.weight", "model.language_model.norm.weight"}
    unused |= {
        key for key in _index(checkpoint_copy)["weight_map"] if ".layers.50." in key or ".layers.51." in key
    }
    merged: dict[str, torch.Tensor] = {}
    for shard_name in SHARD_FILE_NAMES:
        merged.update(load_file(str(checkpoint_copy / shard_name)))
        (checkpoint_copy / shard_name).unlink()
    (checkpoint_copy / INDEX_NAME).unlink()
    save_file(
        {key: value for key, value in merged.items() if key not in unused},
        str(checkpoint_copy / "model.safetensors"),
    )

    single_file_encoder = load_text_encoder(checkpoint_copy, "cpu", torch.float32)
    input_ids = tokenize_prompt(tokenizer, PROMPT)
    assert torch.equal(single_file_encoder.encode(input_ids), encoders[torch.float32].encode(input_ids))


def test_verify_tokenizer_rejects_mismatched_ids(checkpoint_copy: Path, tokenizer) -> None:
    config_path = checkpoint_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["image_token_id"], config["video_token_id"] = config["video_token_id"], config["image_token_id"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"<\|image_pad\|>"):
        load_text_encoder(checkpoint_copy, "cpu").verify_tokenizer(tokenizer)


def test_load_tokenizer_requires_h3_tokens(tiny_root: Path, tmp_path: Path) -> None:
    stock_like = Path(shutil.copytree(tiny_root / "tokenizer", tmp_path / "tokenizer"))
    tokenizer_json = json.loads((stock_like / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"] = [
        entry for entry in tokenizer_json["added_tokens"] if entry["content"] not in ("<d>", "</d>")
    ]
    (stock_like / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(CheckpointError, match=r"no token <d>"):
        load_tokenizer(stock_like)
    with pytest.raises(CheckpointError, match=r"missing tokenizer folder"):
        load_tokenizer(tmp_path / "absent")


# ------------------------------------------------------------------------------------------------ writers, processor


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_writers_are_byte_deterministic(tiny_root: Path, tmp_path: Path) -> None:
    write_tiny_text_encoder(tmp_path / "same_seed", SEED)
    write_tiny_text_encoder(tmp_path / "other_seed", SEED + 1)
    reference_files = _folder_bytes(tiny_root / "text_encoder")
    assert _folder_bytes(tmp_path / "same_seed") == reference_files
    other_files = _folder_bytes(tmp_path / "other_seed")
    assert other_files.keys() == reference_files.keys()
    for shard_name in SHARD_FILE_NAMES:
        assert other_files[shard_name] != reference_files[shard_name]
    assert other_files["config.json"] == reference_files["config.json"]

    write_tiny_tokenizer(tmp_path / "tokenizer")
    write_tiny_processor(tmp_path / "processor")
    assert _folder_bytes(tmp_path / "tokenizer") == _folder_bytes(tiny_root / "tokenizer")
    assert _folder_bytes(tmp_path / "processor") == _folder_bytes(tiny_root / "processor")


def test_random_weights_are_not_identity(tiny_root: Path) -> None:
    state: dict[str, torch.Tensor] = {}
    for shard_name in SHARD_FILE_NAMES:
        state.update(load_file(str(tiny_root / "text_encoder" / shard_name)))
    assert all(tensor.dtype == torch.bfloat16 for tensor in state.values())
    for key, tensor in state.items():
        if "norm" in key and key.endswith(".weight"):
            assert not torch.all(tensor == 1), key
        else:
            assert tensor.float().std() > 0, key


def test_processor_folder(tiny_root: Path, tmp_path: Path) -> None:
    folder = tiny_root / "processor"
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    expected = tiny_image_processor_settings()
    for field in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        assert json.loads(json.dumps(getattr(image_processor, field))) == expected[field], field
    assert dict(image_processor.size) == expected["size"]

    # A 60 x 100 image is scaled up to the 65,536-pixel minimum, onto a grid of 32 x 32 pixel (merged) cells.
    features = image_processor(images=[_keyframe(60, 100, seed=5)], return_tensors="pt")
    grid_t, grid_h, grid_w = features["image_grid_thw"][0].tolist()
    assert grid_t == 1 and grid_h % 2 == 0 and grid_w % 2 == 0
    assert grid_h * grid_w * 16 * 16 >= expected["size"]["shortest_edge"]
    assert features["pixel_values"].shape == (grid_h * grid_w, 3 * 2 * 16 * 16)

    # The release-style per-processor file alone gives the same image processor as the nested processor_config.json.
    legacy_only = tmp_path / "legacy_only"
    legacy_only.mkdir()
    shutil.copy(folder / "preprocessor_config.json", legacy_only)
    legacy_processor = AutoImageProcessor.from_pretrained(legacy_only, local_files_only=True)
    assert legacy_processor.to_dict() == image_processor.to_dict()

    if is_torchvision_available():
        processor = Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
        assert processor.image_token_id == TINY_TOKEN_IDS["<|image_pad|>"]
        assert processor.vision_start_token_id == TINY_TOKEN_IDS["<|vision_start|>"]
    else:
        with pytest.raises(ImportError, match="Torchvision"):
            Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
