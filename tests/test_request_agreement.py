"""The engine front accepts exactly the requests the engine accepts, and refuses the others naming the same field.

A property test (hypothesis): requests of every task, each a valid one with up to three of its fields replaced by
valid or invalid values (prompts and their labels, keyframes, references and their files' facts, durations,
geometry, steps and rungs, LoRA files), go through `EngineFront.check` and `Engine.validate` of the same tiny
checkpoint, plain and step-distilled; both must accept, or both refuse naming the same field. The media probe is a
table of file facts (`MEDIA`), so no file is read but the LoRA files. The property can fail: with one rule taken
from the front only (a Ref2VA request's keyframes, which the front ignored before issue 30) it finds a counterexample.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _lora_helpers import random_lora, write_lora
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.engine.engine import Engine
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.files import Keyframe, MediaInfo, Reference
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.runtime.front import EngineFront

EXAMPLES = 300
RUNGS = (999, 750, 500, 250)

PICTURE = "/media/picture_1920x1080.png"
PORTRAIT = "/media/portrait_1080x1920.png"
WIDE_PICTURE = "/media/wide_2000x400.png"
TINY_PICTURE = "/media/tiny_8x8.png"
CLIP_WITH_SOUND = "/media/clip_6s_sound.mp4"
SILENT_CLIP = "/media/clip_6s_silent.mp4"
CLIP_1S = "/media/clip_1s.mp4"
CLIP_16S = "/media/clip_16s.mp4"
SOUND_ONLY_MP4 = "/media/sound_only.mp4"
VOICE_5S = "/media/voice_5s.wav"
VOICE_12S = "/media/voice_12s.wav"
SILENT_WAV = "/media/silent.wav"
MISSING = "/media/missing.png"
MEDIA = {
    PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=1920, height=1080),
    PORTRAIT: MediaInfo(duration_seconds=None, has_audio=False, width=1080, height=1920),
    WIDE_PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=2000, height=400),
    TINY_PICTURE: MediaInfo(duration_seconds=None, has_audio=False, width=8, height=8),
    CLIP_WITH_SOUND: MediaInfo(duration_seconds=6.0, has_audio=True, width=1280, height=720),
    SILENT_CLIP: MediaInfo(duration_seconds=6.0, has_audio=False, width=1280, height=720),
    CLIP_1S: MediaInfo(duration_seconds=1.0, has_audio=False, width=640, height=360),
    CLIP_16S: MediaInfo(duration_seconds=16.0, has_audio=False, width=640, height=360),
    SOUND_ONLY_MP4: MediaInfo(duration_seconds=6.0, has_audio=True, width=None, height=None),
    VOICE_5S: MediaInfo(duration_seconds=5.0, has_audio=True, width=None, height=None),
    VOICE_12S: MediaInfo(duration_seconds=12.0, has_audio=True, width=None, height=None),
    SILENT_WAV: MediaInfo(duration_seconds=5.0, has_audio=False, width=None, height=None),
}
# ~15,000 characters (under the character bound) that the tiny tokenizer turns into ~10,800 tokens (over the token bound).
LONG_PROMPT = "Waves roll onto a beach. " * 600


def fake_probe(reference: Reference) -> MediaInfo:
    if reference.path not in MEDIA:
        raise RequestError.about_file(reference.path, "cannot open the file (No such file or directory)")
    return MEDIA[reference.path]


BASES = {
    "t2va": GenerationRequest(task="t2va", prompt="A lighthouse at dusk, waves below.", duration_seconds=5.0),
    "fl2va": GenerationRequest(
        task="fl2va",
        prompt="<Picture 1> opens the door.",
        duration_seconds=5.0,
        keyframes=(Keyframe(PICTURE, "first"),),
    ),
    "ref2va": GenerationRequest(
        task="ref2va",
        prompt="<Picture 1> sings in the voice of <Audio 1>.",
        duration_seconds=5.0,
        references=(Reference("image", PICTURE), Reference("audio", VOICE_5S)),
    ),
}


def variants(lora_files: dict[str, str]) -> dict[str, list[dict]]:
    """Per part of a request, values to put in (each a dict of fields), valid and invalid."""
    return {
        "task": [{"task": task} for task in ("t2va", "fl2va", "ref2va", "i2v", "")],
        "prompt": [
            {"prompt": prompt}
            for prompt in (
                "A kite over green hills.",
                "<Picture 1> and <Picture 2> meet.",
                "<Video 1> dances to <Audio 1> and <Audio 2>.",
                "<Picture 3> waves.",
                "",
                "   ",
                "<|vision_start|> smuggled",
                "bad \udcff byte",
                LONG_PROMPT,
                "x" * 40_000,
            )
        ],
        "duration": [
            {"duration_seconds": value}
            for value in (None, 4.0, 15.0, 3.9, 15.5, math.nan, math.inf, "5", 10**30, 9)
        ],
        "aspect": [{"aspect_ratio": value} for value in ("auto", "16:9", "9:16", "21:9", "7:3", "", 1.78)],
        "short_edge": [{"short_edge": value} for value in (None, 768, 32, 64, 0, 2049, 7.5)],
        "canvas": [
            {"width": width, "height": height}
            for width, height in (
                (None, None),
                (64, 64),
                (128, 32),
                (64, None),
                (None, 64),
                (33, 64),
                (4096, 4096),
                (256, 32),
                (2048, 3584),
            )
        ],
        "seed": [{"seed": value} for value in (0, 7, -1, 2**63, 1.5)],
        "steps": [
            {"steps": steps, "recipe": recipe, "rungs": rungs}
            for steps, recipe, rungs in (
                (50, "sglang", ()),
                (4, "sglang", RUNGS),
                (5, "diffusers", RUNGS),
                (4, "diffusers", RUNGS),
                (1, "diffusers", ()),
                (0, "sglang", ()),
                (2, "sglang", (900, 100)),
                (2, "sglang", (100, 900)),
                (50, "comfy", ()),
            )
        ],
        "shifts": [
            {"flow_shift": video, "audio_flow_shift": audio}
            for video, audio in ((12.0, 3.0), (0.0, 3.0), (6.0, -1.0), (math.nan, 3.0), (2000.0, 3.0))
        ],
        "keyframes": [
            {"keyframes": keyframes}
            for keyframes in (
                (),
                (Keyframe(PICTURE, "first"),),
                (Keyframe(PORTRAIT, "last"),),
                (Keyframe(PICTURE, "first"), Keyframe(PORTRAIT, "last")),
                (Keyframe(PORTRAIT, "last"), Keyframe(PICTURE, "first")),
                (Keyframe(PICTURE, "first"), Keyframe(PICTURE, "first")),
                (Keyframe(WIDE_PICTURE, "first"),),
                (Keyframe(TINY_PICTURE, "first"),),
                (Keyframe(MISSING, "first"),),
                (Keyframe(PICTURE, "middle"),),
                (Keyframe("", "first"),),
                ("first.png",),
            )
        ],
        "references": [
            {"references": references}
            for references in (
                (),
                (Reference("image", PICTURE), Reference("audio", VOICE_5S)),
                (Reference("video", CLIP_WITH_SOUND),),
                (Reference("video", CLIP_WITH_SOUND, 0.5), Reference("image", PORTRAIT)),
                (
                    Reference("video", SILENT_CLIP),
                    Reference("audio", VOICE_5S),
                    Reference("audio", VOICE_12S),
                ),
                (Reference("video", SILENT_CLIP),),
                (Reference("audio", VOICE_5S),),
                (Reference("image", PICTURE),) * 10,
                (Reference("video", CLIP_16S),),
                (Reference("video", CLIP_1S),),
                (Reference("video", SOUND_ONLY_MP4),),
                (Reference("image", PICTURE), Reference("audio", SILENT_WAV)),
                (Reference("image", WIDE_PICTURE),),
                (Reference("image", TINY_PICTURE),),
                (Reference("image", MISSING),),
                (Reference("video", CLIP_WITH_SOUND, 7.0),),
                (Reference("audio", VOICE_5S, 1.0), Reference("image", PICTURE)),
                (Reference("text", PICTURE),),
            )
        ],
        "loras": [
            {"loras": loras}
            for loras in (
                (),
                (LoraChoice(lora_files["transformer"]),),
                (LoraChoice(lora_files["transformer_ref"]),),
                (LoraChoice(lora_files["transformer"], target="transformer_ref"),),
                (LoraChoice(lora_files["transformer"], strength=5.0),),
                (LoraChoice(lora_files["not_a_lora"]),),
                (LoraChoice("/loras/missing.safetensors"),),
            )
        ],
    }


@dataclasses.dataclass(frozen=True)
class Requests:
    """What requests are drawn from: a valid one of each task on the checkpoint, and the parts' variants."""

    bases: dict[str, GenerationRequest]
    parts: dict[str, list[dict]]


def request_strategy(requests: Requests) -> st.SearchStrategy[GenerationRequest]:
    """A valid request of a task with up to three of its parts replaced by one of their variants."""
    bases, parts = requests.bases, requests.parts

    @st.composite
    def drawn(draw: st.DrawFn) -> GenerationRequest:
        request = bases[draw(st.sampled_from(sorted(bases)))]
        for part in draw(st.lists(st.sampled_from(sorted(parts)), max_size=3, unique=True)):
            request = dataclasses.replace(request, **draw(st.sampled_from(parts[part])))
        return request

    return drawn()


def outcome(check: Callable[[GenerationRequest], object], request: GenerationRequest) -> str:
    """ "accepted", or the field a RequestError names (any other exception fails the test)."""
    try:
        check(request)
    except RequestError as error:
        return f"refused: {error.field}"
    return "accepted"


def check_agreement(
    front_check: Callable[[GenerationRequest], object],
    engine_check: Callable[[GenerationRequest], object],
    requests: Requests,
    examples: int = EXAMPLES,
) -> collections.Counter:
    """The property: on every generated request both checks accept, or both refuse naming the same field. Returns
    how often each outcome came up; raises AssertionError with the first (shrunk) counterexample."""
    outcomes: collections.Counter = collections.Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(request_strategy(requests))
    def agree(request: GenerationRequest) -> None:
        front, engine = outcome(front_check, request), outcome(engine_check, request)
        assert front == engine, f"front {front}, engine {engine}: {request}"
        outcomes[engine] += 1

    agree()
    return outcomes


@pytest.fixture(scope="module")
def probe_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The table probe in place of the media probe; hypothesis keeps its caches in a temporary folder, not in the
    repository."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(media_inputs, "probe_media", fake_probe)
        set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


@pytest.fixture(scope="module")
def distilled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("distilled") / "checkpoint", dmd_steps=list(RUNGS))


@pytest.fixture(scope="module", params=["plain", "distilled"])
def sides(
    request: pytest.FixtureRequest,
    tiny_native: Path,
    distilled_checkpoint: Path,
    tmp_path_factory,
    probe_table,
) -> Iterator[tuple[EngineFront, Engine, Requests]]:
    checkpoint = tiny_native if request.param == "plain" else distilled_checkpoint
    engine = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    folder = tmp_path_factory.mktemp("loras")
    config = engine.store.dit_config("fl2va")
    lora_files = {"not_a_lora": __file__}
    for target, layout in (("transformer", "diffusers"), ("transformer_ref", "diffusers_ref")):
        lora_files[target] = str(folder / f"{target}.safetensors")
        write_lora(Path(lora_files[target]), random_lora(config), layout, config)
    # A step-distilled checkpoint runs its own step count only.
    bases = {
        task: dataclasses.replace(base, steps=engine.facts.distilled_steps(task) or base.steps)
        for task, base in BASES.items()
    }
    front = EngineFront([engine], tmp_path_factory.mktemp("outputs"))
    try:
        yield front, engine, Requests(bases, variants(lora_files))
    finally:
        front.shutdown()


def test_the_front_accepts_exactly_what_the_engine_accepts(sides) -> None:
    front, engine, requests = sides
    outcomes = check_agreement(front.resolve, engine.resolve, requests)
    # Not a vacuous pass: many requests were accepted, and refusals named many different fields.
    accepted = outcomes.pop("accepted", 0)
    assert accepted >= EXAMPLES // 10, outcomes
    refused_fields = {name.removeprefix("refused: ") for name in outcomes}
    assert len(refused_fields) >= 10, refused_fields
    assert {"keyframes", "prompt", "duration_seconds", "steps"} <= refused_fields, refused_fields


def test_the_property_fails_when_one_side_lacks_a_rule(sides) -> None:
    front, engine, requests = sides

    def front_ignoring_ref2va_keyframes(request: GenerationRequest) -> object:
        # The front's check before issue 30: a Ref2VA request's keyframes went unread until the engine ran it.
        if request.task == "ref2va":
            request = dataclasses.replace(request, keyframes=())
        return front.resolve(request)

    with pytest.raises(AssertionError, match=r"engine refused: keyframes"):
        check_agreement(front_ignoring_ref2va_keyframes, engine.resolve, requests)
