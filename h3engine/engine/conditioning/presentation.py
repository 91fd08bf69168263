"""The token stream H3's text encoder reads for a request (its "presentation"), with Qwen's vision inputs.

T2VA is the prompt verbatim (no chat template, no special tokens). FL2VA puts `"<Picture i>: "` and a Qwen image
block of each fitted keyframe before the prompt; Ref2VA labels each reference (`<Audio j>`, `<Picture i>`,
`<Video k>`) in request order (`reference_presentation` spells out the rules). Every label and the prompt are
tokenized on their own and concatenated, as the reference does (tokenizing the joined string could merge tokens
across the seams). `row_tags` marks each row 1 for text, 0 for every row of a vision block (modulated as video).
`prompt_token_counter(tokenizer_folder)` counts a prompt's rows without loading a model (the request's token bound).

Danger: the pixel tensors are batched per modality while the tokens follow request order; Qwen fills the n-th
image (video) pad run with the n-th image (video) of its batch, so both must keep request order within a modality.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase, Qwen3VLProcessor

from h3engine.checkpoint.text_encoder_files import load_tokenizer
from h3engine.engine.conditioning.encode import NormalizedReference
from h3engine.errors import CheckpointError
from h3engine.models.text_encoder import TEXT_ROW_TAG, VIDEO_ROW_TAG
from h3engine.request.file_rules import reference_labels
from h3engine.request.geometry import qwen_video_sampling

# The rate the text encoder reads a reference video at (the normalized clip itself runs at 24 fps).


@dataclass(frozen=True, eq=False)
class Presentation:
    """`input_ids` [1, L] int64; `row_tags` [L] int64; `vision_inputs` the text encoder's pixel keyword arguments
    (`pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`; only those present)."""

    input_ids: torch.Tensor
    row_tags: torch.Tensor
    vision_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[1]


def load_processor(folder: Path) -> Qwen3VLProcessor:
    """The checkpoint's Qwen3-VL processor (image and video processors), from the local folder only."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"missing processor folder: {folder}")
    try:
        return Qwen3VLProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises several error types for unreadable processor folders
        raise CheckpointError(f"cannot load the Qwen3-VL processor in {folder}: {error}") from error


class _TokenStream:
    """Accumulates token ids and their row tags, one separately tokenized piece at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.row_tags: list[int] = []

    def text(self, text: str) -> None:
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        self.token_ids += ids
        self.row_tags += [TEXT_ROW_TAG] * len(ids)

    def vision_block(self, pad_token: str, num_pads: int) -> None:
        convert = self._tokenizer.convert_tokens_to_ids
        ids = [convert("<|vision_start|>")] + [convert(pad_token)] * num_pads + [convert("<|vision_end|>")]
        self.token_ids += ids
        self.row_tags += [VIDEO_ROW_TAG] * len(ids)

    def finish(self, vision_inputs: dict[str, torch.Tensor]) -> Presentation:
        return Presentation(
            input_ids=torch.tensor([self.token_ids], dtype=torch.long),
            row_tags=torch.tensor(self.row_tags, dtype=torch.long),
            vision_inputs=vision_inputs,
        )


@functools.lru_cache(maxsize=8)
def prompt_token_counter(tokenizer_folder: Path) -> Callable[[str], int]:
    """How many rows the prompt itself gives the text encoder: the checkpoint's tokenizer, no special tokens.

    Reads `tokenizer.json` with the `tokenizers` library (the fast tokenizer's own backend: the same ids, loaded in
    milliseconds); a folder without one is loaded the engine's way. Cached per folder.
    """
    folder = Path(tokenizer_folder)
    json_path = folder / "tokenizer.json"
    if json_path.is_file():
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(json_path))
        except Exception as error:  # the Rust library raises plain Exceptions for unreadable files
            raise CheckpointError(f"{json_path}: cannot read the tokenizer ({error})") from error
        return lambda text: len(backend.encode(text, add_special_tokens=False).ids)
    tokenizer = load_tokenizer(folder)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_presentation(tokenizer: PreTrainedTokenizerBase, prompt: str) -> Presentation:
    """T2VA: the prompt alone."""
    stream = _TokenStream(tokenizer)
    stream.text(prompt)
    return stream.finish({})


def _image_features(
    processor: Qwen3VLProcessor, images: Sequence[Image.Image]
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Qwen pixel inputs of a batch of images and the number of pad tokens of each image's block."""
    features = processor.image_processor(images=list(images), return_tensors="pt")
    merge = processor.image_processor.merge_size**2
    pad_counts = [int(grid.prod()) // merge for grid in features["image_grid_thw"]]
    return {
        "pixel_values": features["pixel_values"],
        "image_grid_thw": features["image_grid_thw"],
    }, pad_counts


def keyframe_presentation(
    tokenizer: PreTrainedTokenizerBase,
    processor: Qwen3VLProcessor,
    prompt: str,
    keyframes: Sequence[Image.Image],
) -> Presentation:
    """FL2VA: `"<Picture i>: "` + image block per fitted keyframe (packed order), then the prompt."""
    stream = _TokenStream(tokenizer)
    vision_inputs: dict[str, torch.Tensor] = {}
    if keyframes:
        vision_inputs, pad_counts = _image_features(processor, keyframes)
        for number, pad_count in enumerate(pad_counts, start=1):
            stream.text(f"<Picture {number}>: ")
            stream.vision_block("<|image_pad|>", pad_count)
    stream.text(prompt)
    return stream.finish(vision_inputs)


def reference_presentation(
    tokenizer: PreTrainedTokenizerBase,
    processor: Qwen3VLProcessor,
    prompt: str,
    references: Sequence[NormalizedReference],
) -> Presentation:
    """Ref2VA: one labelled entry per reference in request order, then the prompt.

    Per reference in request order, numbered per modality: `"<Audio j>: "` (a label only) for every reference
    carrying audio, a video's soundtrack included, *before* its own label; `"<Picture i>: "` + image block (one
    `<|image_pad|>` per merged 2x2 patch between `<|vision_start|>` and `<|vision_end|>`); `"<Video k>: "` + for each
    Qwen temporal block `"<{t:.1f} seconds>"` + video block. Then the prompt. A reference video reaches Qwen sampled
    at 2 fps from its normalized 24 fps frames (frame `round(m * 12)`), its blocks stamped with the mean time of their
    two frames, formatted half-to-even ("<0.2 seconds>" first).
    """
    vision_inputs: dict[str, torch.Tensor] = {}
    images = [reference.image for reference in references if reference.kind == "image"]
    image_pad_counts: list[int] = []
    if images:
        image_inputs, image_pad_counts = _image_features(processor, images)
        vision_inputs.update(image_inputs)

    videos = [reference.frames for reference in references if reference.kind == "video"]
    video_block_pads: list[int] = []
    video_block_times: list[list[float]] = []
    if videos:
        temporal_patch = processor.video_processor.temporal_patch_size
        sampled = []
        for frames in videos:
            indices, block_times = qwen_video_sampling(frames.shape[0], temporal_patch=temporal_patch)
            sampled.append(np.stack([frames[index] for index in indices]))
            video_block_times.append(block_times)
        features = processor.video_processor(videos=sampled, do_sample_frames=False, return_tensors="pt")
        vision_inputs["pixel_values_videos"] = features["pixel_values_videos"]
        vision_inputs["video_grid_thw"] = features["video_grid_thw"]
        merge = processor.video_processor.merge_size**2
        for grid, block_times in zip(features["video_grid_thw"], video_block_times, strict=True):
            if int(grid[0]) != len(block_times):
                raise ValueError(
                    f"the Qwen video processor made {int(grid[0])} temporal blocks, H3 labels {len(block_times)}"
                )
            video_block_pads.append(int(grid[1]) * int(grid[2]) // merge)

    stream = _TokenStream(tokenizer)
    # The labels are h3engine.request's numbering, the one the prompt's labels are checked against.
    labels = reference_labels(
        [reference.kind for reference in references], [reference.has_audio for reference in references]
    )
    images_seen, videos_seen = 0, 0
    for reference, own_labels in zip(references, labels, strict=True):
        for label in own_labels:
            stream.text(f"{label}: ")
        if reference.kind == "image":
            stream.vision_block("<|image_pad|>", image_pad_counts[images_seen])
            images_seen += 1
        elif reference.kind == "video":
            for block_time in video_block_times[videos_seen]:
                # str.format rounds half to even: the first 2 fps block, at 0.25 s, reads "<0.2 seconds>".
                stream.text(f"<{block_time:.1f} seconds>")
                stream.vision_block("<|video_pad|>", video_block_pads[videos_seen])
            videos_seen += 1
    stream.text(prompt)
    return stream.finish(vision_inputs)
