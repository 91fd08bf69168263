"""A request is resolved once: each input file probed once a job, an explicit short edge taken as given, and request
errors that carry their field as data across process boundaries.

What is checked: `Engine.generate` of an FL2VA and a Ref2VA request (a video with a soundtrack among the references)
probes each input file exactly once (the probe function counted), also along a worker rank's calls (validate,
geometry_for, prepare) and the CLI's (its own checks, then the engine's); `short_edge` None is the checkpoint's
canvas rule and an explicit 768 is 768 on a checkpoint whose rule is 32 (tiny engine); `RequestError` pickles with
its field, problem and path, and `in_field` files a media reader's error under the request field; a LoRA file's
values are read when the job prepares.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from _lora_helpers import random_lora, write_lora
from _refusals import refused

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import detect_layout
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.resolved import resolve_request
from h3engine.errors import RequestError
from h3engine.media import inputs as media_inputs
from h3engine.request.files import Keyframe, MediaFacts, MediaInfo, Reference
from h3engine.request.geometry import Geometry, canvas_rule
from h3engine.request.model import GenerationRequest, LoraChoice

ASSETS = Path(__file__).resolve().parents[1] / "assets"
PICTURE = str(ASSETS / "ref2va" / "picture1.png")
CLIP_WITH_SOUND = str(ASSETS / "ref2va" / "video1.mp4")
VOICE = str(ASSETS / "ref2va" / "audio1.wav")
FIRST, LAST = str(ASSETS / "fl2va" / "first.png"), str(ASSETS / "fl2va" / "last.png")
REQUESTS = {
    "fl2va": GenerationRequest(
        task="fl2va",
        prompt="<Picture 1> turns into <Picture 2>.",
        duration_seconds=4,
        steps=2,
        keyframes=(Keyframe(FIRST, "first"), Keyframe(LAST, "last")),
    ),
    "ref2va": GenerationRequest(
        task="ref2va",
        prompt="<Picture 1> walks through <Video 1> and hums <Audio 2>.",
        duration_seconds=4,
        steps=2,
        references=(
            Reference("image", PICTURE),
            Reference("video", CLIP_WITH_SOUND),
            Reference("audio", VOICE),
        ),
    ),
}


@pytest.fixture(scope="module")
def engine(tiny_native: Path) -> Engine:
    return Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Every call of the media probe, by (kind, path)."""
    counted: collections.Counter = collections.Counter()
    probe = media_inputs.probe_media

    def counting(entry: Reference | Keyframe) -> object:
        kind = "image" if isinstance(entry, Keyframe) else entry.kind
        counted[kind, Path(entry.path).name] += 1
        return probe(entry)

    monkeypatch.setattr(media_inputs, "probe_media", counting)
    return counted


def files_of(request: GenerationRequest) -> set[tuple[str, str]]:
    return {("image", Path(keyframe.path).name) for keyframe in request.keyframes} | {
        (reference.kind, Path(reference.path).name) for reference in request.references
    }


@pytest.mark.parametrize("task", sorted(REQUESTS))
def test_a_generation_probes_each_input_file_once(engine: Engine, probes, task: str, tmp_path: Path) -> None:
    request = REQUESTS[task]
    written = engine.generate_to_file(request, tmp_path / "clip.mp4")
    assert written.video.is_file()
    assert set(probes) == files_of(request)
    assert set(probes.values()) == {1}, probes


def test_a_resolved_request_is_not_resolved_again(engine: Engine, probes) -> None:
    request = REQUESTS["ref2va"]
    # What a worker group's rank 0 gets with its job: the request its door resolved.
    resolved = engine.resolve(request)
    assert engine.resolved(resolved) is resolved  # its memory check was made with the engine's plan
    prepared = engine.prepare(resolved)
    assert prepared.geometry == resolved.geometry
    assert set(probes.values()) == {1} and set(probes) == files_of(request)
    # A bare request is resolved each time it is given (no memo): its files may have changed.
    engine.validate(request)
    assert set(probes.values()) == {2}


def test_the_cli_probes_each_file_once_for_its_checks_and_the_engines(
    tiny_native: Path, probes, tmp_path: Path, capsys
) -> None:
    request = REQUESTS["ref2va"]
    references = [f"--ref={reference.kind}:{reference.path}" for reference in request.references]
    code = main(
        [
            "generate",
            "--checkpoint",
            str(tiny_native),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt",
            request.prompt,
            *references,
            "--duration",
            "4",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "clip.mp4"),
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert set(probes) == files_of(request) and set(probes.values()) == {1}, probes


def test_short_edge_none_is_the_checkpoints_rule_and_an_explicit_768_is_768(engine: Engine) -> None:
    assert engine.layout.canvas.short_edge == 32  # the tiny checkpoints' own rule
    request = GenerationRequest(task="t2va", prompt="A kite.", aspect_ratio="16:9")
    own = engine.geometry_for(request)
    assert (own.height, own.width) == (32, 56)
    explicit_own = engine.geometry_for(dataclasses.replace(request, short_edge=32))
    assert (explicit_own.height, explicit_own.width) == (32, 56)
    # Before issue 30, 768 stood for "the checkpoint's rule" and this gave 32 x 56.
    explicit = engine.geometry_for(dataclasses.replace(request, short_edge=768))
    # 768 under the tiny rule's area cap (32 x 56) scaled to it: 16:9 at 768 is over the cap by a little.
    cap = canvas_rule(768, 32, 32 * 56)[1]
    assert explicit == Geometry.for_request(
        "16:9", 5.0, short_edge=768, max_pixels=cap, vae_spatial_ratio=4, patch=2
    )
    assert (explicit.height, explicit.width) == (760, 1352)
    # The front's model-free check resolves the same from the checkpoint's headers.
    facts = CheckpointFacts.from_layout(engine.layout)
    assert resolve_request(dataclasses.replace(request, short_edge=768), facts).geometry == explicit
    assert resolve_request(request, facts).geometry == own


def test_canvas_rule_takes_every_short_edge_as_given() -> None:
    assert canvas_rule(None, 32, 32 * 56) == (32, 32 * 56)
    assert canvas_rule(32, 32, 32 * 56) == (32, 32 * 56)
    assert canvas_rule(768, 32, 32 * 56) == (768, 768 * 1344)
    assert canvas_rule(None, 768, 768 * 1344) == canvas_rule(768, 768, 768 * 1344) == (768, 768 * 1344)
    assert canvas_rule(1024, 768, 768 * 1344) == (1024, 768 * 1344 * 1024**2 // 768**2)


def test_checkpoint_facts_from_the_headers_are_the_engines(engine: Engine, tiny_native: Path) -> None:
    facts = CheckpointFacts.from_layout(detect_layout(tiny_native))
    assert engine.facts == CheckpointFacts.from_engine(engine)
    assert (
        facts == dataclasses.replace(engine.facts, memory_plan=None)
        and engine.facts.memory_plan is engine.plan
    )
    models = engine.store.models_for_partition(engine.store.first_partition)
    assert (facts.vae_spatial_ratio, facts.patch) == models.spatial_factors
    assert pickle.loads(pickle.dumps(facts)) == facts


def test_media_facts_probe_each_file_once_by_kind_and_path() -> None:
    asked = []

    def probe(reference: Reference) -> MediaInfo:
        asked.append((reference.kind, reference.path))
        return MediaInfo(duration_seconds=None, has_audio=False, width=64, height=64)

    media = MediaFacts(probe)
    media(Keyframe("a.png", "first"))
    media(Reference("image", "a.png"))  # the same file, asked about as the same kind
    media(Reference("video", "a.png"))
    assert asked == [("image", "a.png"), ("video", "a.png")]


# --- errors that carry their field ---------------------------------------------------------------------------------


def test_request_errors_pickle_with_their_field_problem_and_path() -> None:
    for error in (
        RequestError("duration_seconds", "must be within [4, 15] s, got 3"),
        RequestError("references[1]", "has no video stream", "/data/in/clip.mp4"),
        RequestError.about_file(Path("/data/in/a.png"), "the image file is empty"),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is RequestError
        assert (copy.field, copy.problem, copy.path) == (error.field, error.problem, error.path)
        assert str(copy) == str(error)
    assert str(RequestError("references[1]", "has no video stream", "/d/clip.mp4")) == (
        "references[1]: '/d/clip.mp4': has no video stream"
    )
    assert str(RequestError.about_file("/d/a.png", "is empty")) == "'/d/a.png': is empty"


def test_in_field_files_a_readers_error_under_the_request_field() -> None:
    unfiled = RequestError.about_file("/d/a.png", "the image file is empty")
    filed = unfiled.in_field("keyframes[0]")
    assert (filed.field, filed.problem, filed.path) == ("keyframes[0]", "the image file is empty", "/d/a.png")
    inside = RequestError("references[0].start_seconds", "must be >= 0")
    assert inside.in_field("references[0]") is inside
    other = RequestError("out_path", "is a folder").in_field("references[0]")
    assert (other.field, other.problem) == ("references[0]", "out_path: is a folder")


def test_a_files_problem_is_filed_under_the_field_that_named_it(engine: Engine, tmp_path: Path) -> None:
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    request = dataclasses.replace(
        REQUESTS["fl2va"], keyframes=(Keyframe(FIRST, "first"), Keyframe(str(empty), "last"))
    )
    # The reader's wording: tests/test_media_inputs.py.
    with refused(RequestError, field="keyframes[1]", path=empty):
        engine.validate(request)


def test_a_lora_files_values_are_read_when_the_job_prepares(engine: Engine, tmp_path: Path) -> None:
    """The checks read LoRA headers only; `prepare` reads the files whole, so a worker group's rank 0 refuses one
    with broken values (naming it) before the other ranks apply it."""
    config = engine.store.dit_config("fl2va")
    lora = random_lora(config)
    module = next(iter(lora.down))
    lora.down[module][0, 0] = float("nan")
    path = tmp_path / "broken.safetensors"
    write_lora(path, lora, "diffusers", config)
    request = GenerationRequest(task="t2va", prompt="A kite.", steps=2, loras=(LoraChoice(str(path)),))
    assert engine.validate(request) == []
    with refused(RequestError, field="loras[0]"):
        engine.prepare(request)
