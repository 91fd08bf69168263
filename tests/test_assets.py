"""Tests for the bundled example inputs under assets/: files, provenance, example requests and their labels.

* Every request in assets/examples.json goes through `from_dict` and `validate` with a real probe of the
  bundled files (Pillow for images, PyAV for clips), so the rules that need file facts (clip lengths,
  soundtracks, image ratios, keyframe geometry) run as they will in the app.
* The labels a prompt cites must be exactly the ones its references yield, numbered per modality in reference
  order, with a video's soundtrack labelled `<Audio j>` before the video's `<Video k>` (docs/MODEL.md §4.3, §7.3).
  A miscounted label silently points the model at the wrong reference, so this is checked label by label.
* assets/make_assets.py is run again into a temporary folder: the PNG/JPEG/WAV bytes must hash to the sha256
  values in assets/PROVENANCE.md and the regenerated PROVENANCE.md must equal the committed one apart from the
  MP4's hash. MP4 bytes depend on the FFmpeg build, so both MP4s are checked by their stream properties.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
import wave
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import av
import numpy as np
import pytest
from PIL import Image

from h3engine.media.mux import probe_mp4
from h3engine.request.files import MediaInfo, Reference
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.request.validate import validate

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "assets"
EXAMPLES = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))["examples"]
HASH_CHECKED_SUFFIXES = (".png", ".jpg", ".wav")
# Files in assets/ that are text written by hand or by the script, not media listed in PROVENANCE.md.
NON_MEDIA_FILES = {"make_assets.py", "PROVENANCE.md", "examples.json"}
MAX_ASSETS_BYTES = 3 * 1024 * 1024

LABEL = re.compile(r"<(Picture|Video|Audio) ([1-9][0-9]*)>")
LABEL_LIKE = re.compile(r"<\s*(?:picture|video|audio)[^>]*>", re.IGNORECASE)
DIALOGUE = re.compile(r"<d>\[English\] [^<>\[\]]+</d>")


def probe_bundled(reference: Reference) -> MediaInfo:
    """What the app's probe reports for a bundled file; paths are relative to the repository root."""
    path = REPO_ROOT / reference.path
    if reference.kind == "image":
        with Image.open(path) as image:
            return MediaInfo(duration_seconds=None, has_audio=False, width=image.width, height=image.height)
    with av.open(str(path)) as container:
        video = container.streams.video[0] if container.streams.video else None
        return MediaInfo(
            duration_seconds=container.duration / av.time_base if container.duration else None,
            has_audio=bool(container.streams.audio),
            width=video.codec_context.width if video is not None else None,
            height=video.codec_context.height if video is not None else None,
        )


def expected_labels(request: GenerationRequest) -> dict[str, str]:
    """{label: what it stands for} in presentation order (docs/MODEL.md §4.3); a soundtrack is
    "<path> (soundtrack)"."""
    if request.task == "fl2va":
        return {f"<Picture {number}>": keyframe.path for number, keyframe in enumerate(request.keyframes, 1)}
    counts: Counter[str] = Counter()
    labels = {}

    def label(modality: str, source: str) -> None:
        counts[modality] += 1
        labels[f"<{modality} {counts[modality]}>"] = source

    for reference in request.references:
        if reference.kind == "image":
            label("Picture", reference.path)
        elif reference.kind == "audio":
            label("Audio", reference.path)
        else:
            # The soundtrack's rows are packed before the video's, and so is its label.
            if probe_bundled(reference).has_audio:
                label("Audio", f"{reference.path} (soundtrack)")
            label("Video", reference.path)
    return labels


def example_ids() -> list[str]:
    return [example["name"] for example in EXAMPLES]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def provenance_hashes(text: str) -> dict[str, str]:
    """{path relative to assets/: sha256} from the `### `assets/...`` sections of PROVENANCE.md."""
    hashes = {}
    for section in re.split(r"^### ", text, flags=re.MULTILINE)[1:]:
        path = re.match(r"`assets/([^`]+)`", section)
        digest = re.search(r"^- sha256: `([0-9a-f]{64})`", section, flags=re.MULTILINE)
        assert path is not None and digest is not None, f"malformed PROVENANCE.md section: {section[:80]!r}"
        hashes[path.group(1)] = digest.group(1)
    return hashes


def without_unchecked_hashes(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "(this build's bytes; not checked)" not in line)


def load_make_assets() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_assets", ASSETS / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the file executes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_assets() -> ModuleType:
    return load_make_assets()


@pytest.fixture(scope="module")
def regenerated(make_assets: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("assets")
    make_assets.make_all(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Example requests


@pytest.mark.parametrize("example", EXAMPLES, ids=example_ids())
def test_example_parses_and_validates_against_the_bundled_files(example: dict[str, Any]) -> None:
    request = from_dict(example["request"])
    assert validate(request) == []
    assert validate(request, probe_bundled) == []
    paths = [keyframe.path for keyframe in request.keyframes] + [ref.path for ref in request.references]
    for path in paths:
        assert not Path(path).is_absolute() and path.startswith("assets/"), path
        assert (REPO_ROOT / path).is_file(), path
    assert from_dict(json.loads(json.dumps(request.to_dict()))) == request


@pytest.mark.parametrize("example", EXAMPLES, ids=example_ids())
def test_prompt_cites_exactly_the_labels_of_its_references(example: dict[str, Any]) -> None:
    request = from_dict(example["request"])
    cited = ["<{} {}>".format(*match) for match in LABEL.findall(request.prompt)]
    assert LABEL_LIKE.findall(request.prompt) == cited, "a label-like token is not a well-formed label"
    labels = expected_labels(request)
    if request.task == "ref2va":
        # The documented meaning of each label must be what the reference order gives it; every reference is
        # cited (otherwise it only confuses the example) and nothing else is.
        assert list(example["labels"].items()) == list(labels.items())
        assert set(cited) == set(labels), f"cites {sorted(set(cited))}, references yield {list(labels)}"
    else:
        assert "labels" not in example
        assert set(cited) <= set(labels), f"cites {sorted(set(cited))}, conditions yield {list(labels)}"


@pytest.mark.parametrize("example", EXAMPLES, ids=example_ids())
def test_dialogue_is_marked_up_with_its_language(example: dict[str, Any]) -> None:
    prompt = example["request"]["prompt"]
    assert prompt.count("<d>") == prompt.count("</d>") == len(DIALOGUE.findall(prompt))


def test_label_numbering_puts_a_soundtrack_before_its_video() -> None:
    request = GenerationRequest(
        task="ref2va",
        prompt="x",
        references=(
            Reference("image", "assets/ref2va/picture1.png"),
            Reference("video", "assets/ref2va/video1.mp4"),
            Reference("audio", "assets/ref2va/audio1.wav"),
            Reference("image", "assets/ref2va/picture2.jpg"),
        ),
    )
    assert list(expected_labels(request).items()) == [
        ("<Picture 1>", "assets/ref2va/picture1.png"),
        ("<Audio 1>", "assets/ref2va/video1.mp4 (soundtrack)"),
        ("<Video 1>", "assets/ref2va/video1.mp4"),
        ("<Audio 2>", "assets/ref2va/audio1.wav"),
        ("<Picture 2>", "assets/ref2va/picture2.jpg"),
    ]


def test_examples_cover_every_task_layout() -> None:
    layouts = set()
    for example in EXAMPLES:
        request = from_dict(example["request"])
        conditions = request.keyframes if request.task == "fl2va" else request.references
        layouts.add((request.task, tuple(getattr(item, "position", "") or item.kind for item in conditions)))
    assert {
        ("t2va", ()),
        ("fl2va", ("first",)),
        ("fl2va", ("last",)),
        ("fl2va", ("first", "last")),
        ("ref2va", ("image", "image")),
        ("ref2va", ("image", "audio")),
        ("ref2va", ("video", "image")),
    } <= layouts
    assert len(set(example_ids())) == len(EXAMPLES)


# ---------------------------------------------------------------------------------------------------------------
# The bundled files


def check_mp4(path: Path) -> None:
    facts = probe_mp4(path)
    assert (facts["video_codec"], facts["pix_fmt"], facts["width"], facts["height"]) == (
        "h264",
        "yuv420p",
        640,
        360,
    )
    assert (facts["fps"], facts["frame_count"]) == (24.0, 72)
    assert (facts["audio_codec"], facts["audio_sample_rate"], facts["audio_channels"]) == ("aac", 32000, 2)
    assert facts["audio_duration_s"] == pytest.approx(3.0, abs=1024 / 32000)


def test_bundled_files_have_the_promised_formats() -> None:
    expected_images = {
        "fl2va/first.png": ("PNG", (1344, 768)),
        "fl2va/last.png": ("PNG", (1344, 768)),
        "ref2va/picture1.png": ("PNG", (768, 1024)),
        "ref2va/picture2.jpg": ("JPEG", (1024, 768)),
    }
    for relative_path, (file_format, size) in expected_images.items():
        with Image.open(ASSETS / relative_path) as image:
            assert (image.format, image.size, image.mode) == (file_format, size, "RGB"), relative_path
    with wave.open(str(ASSETS / "ref2va/audio1.wav"), "rb") as handle:
        assert (handle.getnchannels(), handle.getsampwidth(), handle.getframerate()) == (2, 2, 32000)
        assert handle.getnframes() == 3 * 32000
    check_mp4(ASSETS / "ref2va/video1.mp4")
    total = sum(
        path.stat().st_size
        for path in ASSETS.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    assert total < MAX_ASSETS_BYTES


def test_last_keyframe_shows_the_kite_moved_and_the_sun_higher(make_assets: ModuleType) -> None:
    def centroid(relative_path: str, color: tuple[int, int, int]) -> np.ndarray:
        pixels = np.asarray(Image.open(ASSETS / relative_path)).astype(np.int16)
        rows, columns = np.nonzero(np.abs(pixels - np.array(color)).max(axis=-1) <= 8)
        assert rows.size > 500, f"{relative_path}: too few pixels of {color}"
        return np.array([columns.mean(), rows.mean()])

    kite_first = centroid("fl2va/first.png", make_assets.KITE_RED)
    kite_last = centroid("fl2va/last.png", make_assets.KITE_RED)
    assert np.linalg.norm(kite_last - kite_first) > 150
    assert kite_last[1] < kite_first[1] - 100
    sun_first = centroid("fl2va/first.png", make_assets.DAWN_PALETTE["sun"])
    sun_last = centroid("fl2va/last.png", make_assets.MORNING_PALETTE["sun"])
    assert sun_last[1] < sun_first[1] - 200


def test_every_media_file_is_listed_in_provenance_with_its_hash() -> None:
    hashes = provenance_hashes((ASSETS / "PROVENANCE.md").read_text(encoding="utf-8"))
    media = {
        path.relative_to(ASSETS).as_posix()
        for path in ASSETS.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.name not in NON_MEDIA_FILES
    }
    assert set(hashes) == media
    for relative_path, digest in hashes.items():
        if relative_path.endswith(HASH_CHECKED_SUFFIXES):
            assert sha256_of(ASSETS / relative_path) == digest, relative_path


def test_make_assets_reproduces_the_provenance_hashes(regenerated: Path) -> None:
    committed = (ASSETS / "PROVENANCE.md").read_text(encoding="utf-8")
    checked = {
        path: digest
        for path, digest in provenance_hashes(committed).items()
        if path.endswith(HASH_CHECKED_SUFFIXES)
    }
    assert len(checked) == 5
    for relative_path, digest in checked.items():
        assert sha256_of(regenerated / relative_path) == digest, relative_path
    check_mp4(regenerated / "ref2va/video1.mp4")
    regenerated_provenance = (regenerated / "PROVENANCE.md").read_text(encoding="utf-8")
    assert without_unchecked_hashes(regenerated_provenance) == without_unchecked_hashes(committed)
