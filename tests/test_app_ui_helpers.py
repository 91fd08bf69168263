"""The app's plain-Python helpers: reference labels, request building and error placement, history, inputs, examples.

What is compared: labels numbered per modality with a sounding video's <Audio j> before its <Video k> (the order
the model was trained on); tab inputs turn into the exact GenerationRequest and back; RequestError messages land on
the input they name, naming the user's file (not the upload path) and the field once; file inputs hand over upload
paths undecoded and refuse anything else; the Ref2VA picker and the CLI's help offer exactly the formats of
h3engine.media.formats; the history lists only complete results, newest first, and refuses stems that leave the
outputs folder; stored inputs are content-addressed and keep the user's file name; every example in
assets/examples.json loads with files that exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import gradio as gr
import pytest
from _app_helpers import ASSETS, REPOSITORY_ROOT
from _refusals import refused

from h3engine.cli.parser import build_parser
from h3engine.engine.lora.library import LoraLibrary
from h3engine.errors import RequestError
from h3engine.media.formats import FORMATS, accepted_text
from h3engine.request.file_rules import reference_labels
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest
from ui.components import NotAnUpload, as_uploaded
from ui.examples import load_examples
from ui.history import find_entry, history_rows, list_history, result_markdown
from ui.inputs import InputStore, label_references, reference_kind
from ui.references import (
    THUMBNAIL_EDGE,
    append_references,
    insert_label,
    move_reference,
    reference_preview,
    remove_reference,
)
from ui.tabs import build_ref2va_tab
from ui.task_values import (
    TaskValues,
    build_request,
    check_input_types,
    error_text,
    failing_parameter,
    parameter_names,
    request_values,
)


def test_labels_are_numbered_per_modality_and_a_sounding_video_takes_an_audio_label_first() -> None:
    kinds = ["image", "video", "audio", "video", "image"]
    has_audio = [False, True, False, False, False]
    assert reference_labels(kinds, has_audio) == [
        ("<Picture 1>",),
        ("<Audio 1>", "<Video 1>"),
        ("<Audio 2>",),
        ("<Video 2>",),
        ("<Picture 2>",),
    ]
    labelled = label_references(
        [str(ASSETS / "ref2va" / "video1.mp4"), str(ASSETS / "ref2va" / "picture1.png")]
    )
    assert [reference.labels for reference in labelled] == [("<Audio 1>", "<Video 1>"), ("<Picture 1>",)]
    with refused(RequestError, field="references", says="cannot tell whether 'notes.txt'"):
        reference_kind("notes.txt")


def test_reorder_and_remove_keep_the_other_references() -> None:
    paths = ["a.png", "b.mp4", "c.wav"]
    assert move_reference(1, -1, paths) == ["b.mp4", "a.png", "c.wav"]
    assert move_reference(2, 1, paths) == paths
    assert remove_reference(0, paths) == ["b.mp4", "c.wav"]
    assert paths == ["a.png", "b.mp4", "c.wav"]
    assert append_references(paths, ["d.jpg", "e.mp3"]) == [*paths, "d.jpg", "e.mp3"]
    assert append_references(None, "d.jpg") == ["d.jpg"]
    assert append_references(paths, None) == paths
    assert insert_label("<Picture 1>", "The robot from  ") == "The robot from <Picture 1>"
    assert insert_label("<Audio 1>", None) == "<Audio 1>"


def test_reference_previews_show_a_thumbnail_a_poster_frame_and_lengths() -> None:
    picture = reference_preview(str(ASSETS / "ref2va" / "picture1.png"))
    assert picture.error is None and picture.seconds is None
    assert max(picture.picture.size) <= THUMBNAIL_EDGE and min(picture.picture.size) > 0
    video = reference_preview(str(ASSETS / "ref2va" / "video1.mp4"))
    assert video.error is None and video.seconds == pytest.approx(3.0, abs=0.05)
    assert video.picture.size == (THUMBNAIL_EDGE, THUMBNAIL_EDGE * 360 // 640)  # the first frame, 640 x 360
    assert video.picture.getextrema() != ((0, 0), (0, 0), (0, 0))  # a decoded frame, not a black placeholder
    audio = reference_preview(str(ASSETS / "ref2va" / "audio1.wav"))
    assert (audio.error, audio.picture) == (None, None)
    assert audio.seconds == pytest.approx(3.0, abs=0.05)
    # Read once per file: the same preview object comes back.
    assert reference_preview(str(ASSETS / "ref2va" / "video1.mp4")) is video


def test_a_reference_that_does_not_decode_gets_one_line_naming_the_file(tmp_path) -> None:
    empty_png = tmp_path / "empty.png"
    empty_png.write_bytes(b"")
    garbage_mp4 = tmp_path / "garbage.mp4"
    garbage_mp4.write_bytes(b"not a video" * 100)
    cut_wav = tmp_path / "cut.wav"
    cut_wav.write_bytes((ASSETS / "ref2va" / "audio1.wav").read_bytes()[:30])
    for path, kind in ((empty_png, "an image"), (garbage_mp4, "a video clip"), (cut_wav, "an audio clip")):
        preview = reference_preview(str(path))
        assert preview.picture is None, path
        assert preview.error.startswith(f"references: '{path.name}' does not open as {kind} ("), preview.error
        assert "\n" not in preview.error and str(tmp_path) not in preview.error, preview.error
        assert path.suffix in preview.error  # what would be accepted
    # The file changes (a new upload under the same path): it is read again, not served from the cache.
    garbage_mp4.write_bytes((ASSETS / "ref2va" / "video1.mp4").read_bytes())
    os.utime(garbage_mp4, ns=(1, 1))
    assert reference_preview(str(garbage_mp4)).error is None
    assert reference_preview(str(tmp_path / "gone.png")).error == (
        "references: 'gone.png' is no longer on the server; add it again"
    )


def test_a_reference_preview_is_bounded_in_time(tmp_path, monkeypatch) -> None:
    import ui.references

    slow = tmp_path / "slow.mp4"
    slow.write_bytes((ASSETS / "ref2va" / "video1.mp4").read_bytes())
    monkeypatch.setattr(ui.references, "PREVIEW_SECONDS", 1e-9)
    preview = reference_preview(str(slow))
    assert preview.picture is None
    assert preview.error.startswith(
        "references: 'slow.mp4' does not open as a video clip (reading it took longer"
    )
    # A slow moment is not remembered: with time enough, the same file shows its poster frame.
    monkeypatch.undo()
    assert reference_preview(str(slow)).picture is not None


def _values(task: str, **overrides) -> TaskValues:
    defaults = {"prompt": "p", "first_image": None, "last_image": None, "references": []}
    defaults |= {"duration_from_reference": False, "duration_seconds": 6.0, "aspect_ratio": "4:3", "seed": 9}
    defaults |= {
        "randomize_seed": False,
        "steps": 7,
        "flow_shift": 11.0,
        "audio_flow_shift": 2.5,
        "short_edge": 32,  # a tab starts at the checkpoint's own (the tiny checkpoints': 32)
        "takes": 1,
        "rungs": "",
        "loras": [],
        "cache": "off",
    }
    defaults |= overrides
    return TaskValues.from_inputs(task, [defaults[name] for name in parameter_names(task)])


def test_tab_inputs_become_the_request_and_back() -> None:
    first, last = str(ASSETS / "fl2va" / "first.png"), str(ASSETS / "fl2va" / "last.png")
    request = build_request(_values("fl2va", first_image=first, last_image=last))
    assert request == GenerationRequest(
        task="fl2va",
        prompt="p",
        duration_seconds=6.0,
        aspect_ratio="4:3",
        seed=9,
        steps=7,
        flow_shift=11.0,
        audio_flow_shift=2.5,
        short_edge=32,
        keyframes=(Keyframe(first, "first"), Keyframe(last, "last")),
    )
    restored = request_values(request, keep=str)
    assert (restored["first_image"], restored["last_image"], restored["randomize_seed"]) == (
        first,
        last,
        False,
    )
    assert build_request(_values("fl2va", **restored)) == request

    picture, audio = str(ASSETS / "ref2va" / "picture1.png"), str(ASSETS / "ref2va" / "audio1.wav")
    request = build_request(_values("ref2va", references=[picture, audio], duration_from_reference=True))
    assert request.references == (Reference("image", picture), Reference("audio", audio))
    assert request.duration_seconds is None
    assert build_request(_values("ref2va", **request_values(request, keep=str))) == request
    # A request left to the checkpoint's rule shows that rule's short edge (a browser cannot send an empty number).
    own = dataclasses.replace(request, short_edge=None)
    assert request_values(own, keep=str, own_short_edge=32)["short_edge"] == 32
    assert request_values(own, keep=str)["short_edge"] == 768


def test_request_errors_land_on_the_input_they_name() -> None:
    values = _values("fl2va", last_image="/uploads/x/last.png")
    assert failing_parameter(RequestError("prompt", "must be a non-empty string, got ''"), values) == "prompt"
    assert failing_parameter(RequestError("width, height", "nope"), values) == "aspect_ratio"
    assert failing_parameter(RequestError("short_edge", "must be <= 2048, got 4000"), values) == "short_edge"
    # Only a last image was given, so keyframes[0] is the last image.
    ratio = RequestError("keyframes[0]", "keyframe image ratio must be within 1:4 to 4:1")
    assert failing_parameter(ratio, values) == "last_image"
    assert (
        failing_parameter(RequestError("keyframes[0].path", "must be a non-empty path"), values)
        == "last_image"
    )
    # A file's problem not yet filed under a field lands on the input holding that file.
    unfiled = RequestError.about_file("/uploads/x/last.png", "not a readable image")
    assert failing_parameter(unfiled, values) == "last_image"
    ref_values = _values("ref2va", references=["/u/a.png"], duration_from_reference=True)
    assert (
        failing_parameter(RequestError("duration_seconds", "is required"), ref_values)
        == "duration_from_reference"
    )
    assert failing_parameter(RequestError("references[0]", "clip too short"), ref_values) == "references"
    # Nothing in the message decides: a field-less problem that reads like a field's lands on the prompt.
    assert failing_parameter(RequestError("", "steps: must be <= 1000"), values) == "prompt"


def test_errors_name_the_users_file_and_the_field_once() -> None:
    upload = "/tmp/gradio/0f3a9c/my photo.png"
    values = _values("fl2va", last_image=upload)
    empty = RequestError(
        "keyframes[0]", "the image file is empty; accepted: a JPEG, PNG or WEBP image", upload
    )
    assert (
        str(empty)
        == f"keyframes[0]: '{upload}': the image file is empty; accepted: a JPEG, PNG or WEBP image"
    )
    assert failing_parameter(empty, values) == "last_image"
    shown = error_text(empty, "last_image", values)
    assert (
        shown == "'my photo.png' (last frame): the image file is empty; accepted: a JPEG, PNG or WEBP image"
    )
    steps = RequestError("steps", "must be <= 1000, got 5000")
    assert error_text(steps, "steps", values) == "must be <= 1000, got 5000"
    clips = _values("ref2va", references=["/u/1/a.png", "/u/2/notes.mp3"], duration_from_reference=True)
    corrupt = RequestError(
        "references[1]", "the audio file is corrupt or truncated (InvalidDataError)", "/u/2/notes.mp3"
    )
    assert failing_parameter(corrupt, clips) == "references"
    assert error_text(corrupt, "references", clips) == (
        "'notes.mp3' (reference 2): the audio file is corrupt or truncated (InvalidDataError)"
    )
    short = RequestError("references[0]", "clip too short")
    assert error_text(short, "references", clips) == "reference 1: clip too short"
    start = RequestError("references[0].start_seconds", "must be >= 0, got -1")
    assert error_text(start, "references", clips) == "reference 1.start_seconds: must be >= 0, got -1"
    stored = RequestError("references[0]", "the image file is empty", "/data/outputs/inputs/0a1b2c/a.png")
    assert error_text(stored, "references", clips) == "'a.png' (reference 1): the image file is empty"
    required = RequestError("duration_seconds", "is required")
    assert error_text(required, "duration_from_reference", clips) == "duration_seconds is required"
    cited = RequestError(
        "prompt", "cites <Picture 3>, which no input defines: the references define <Picture 1>"
    )
    assert error_text(cited, failing_parameter(cited, clips), clips) == cited.problem
    # A server path inside a problem shows as its base name.
    inside = RequestError("references[1]", "video file has no video stream: '/data/outputs/inputs/9f/b.mp4'")
    assert error_text(inside, "references", clips) == "reference 2: video file has no video stream: 'b.mp4'"


def test_file_inputs_hand_over_upload_paths_undecoded_and_refuse_anything_else() -> None:
    upload = {
        "path": "/tmp/gradio/0f3a9c/empty.png",
        "orig_name": "empty.png",
        "meta": {"_type": "gradio.FileData"},
    }
    image = as_uploaded(gr.Image(type="filepath"))
    assert image.api_info()["properties"]["path"]  # the API schema is still the image's
    # Not opened: a 0-byte or missing file reaches our own checks, which name it.
    assert image.preprocess(upload) == upload["path"] and image.preprocess(None) is None
    files = as_uploaded(gr.File(file_count="multiple", type="filepath"))
    assert files.preprocess([upload, upload]) == [upload["path"]] * 2
    for sent in ("/etc/passwd", 5, {"path": "/etc/passwd"}):
        assert image.preprocess(sent) == NotAnUpload(sent)
        with refused(
            RequestError, field="first_image", says="must be an uploaded file (gradio_client: handle_file"
        ):
            check_input_types(_values("fl2va", first_image=image.preprocess(sent)))
        with refused(RequestError, field="references"):
            check_input_types(_values("ref2va", references=files.preprocess([upload, sent])))
    # The checkboxes are no request fields: their type is checked here.
    for name, task in (("randomize_seed", "t2va"), ("duration_from_reference", "ref2va")):
        with refused(RequestError, field=name, says="must be true or false, got 'no'"):
            check_input_types(_values(task, **{name: "no"}))
    assert files.preprocess("a.png") == NotAnUpload("a.png")


def test_the_pickers_offer_exactly_what_is_accepted() -> None:
    with gr.Blocks():
        tab = build_ref2va_tab("", [], LoraLibrary(None))
    accepted = [suffix for media in FORMATS.values() for suffix in media.suffixes]
    assert tab.references.file_types == accepted
    for kind, media in FORMATS.items():
        for suffix in media.suffixes:
            assert reference_kind(f"clip{suffix.upper()}") == kind
    assert FORMATS["image"].suffixes == (".jpg", ".jpeg", ".png", ".webp")
    # The command line's help lists the same formats.
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    assert " ".join(accepted_text().split()) in " ".join(generate.format_help().split())
    for name in ("scan.bmp", "scan.tif", "scan.tiff", "notes.txt"):
        with refused(
            RequestError, field="references", says="accepted: image: a JPEG, PNG or WEBP image (.jpg"
        ):
            reference_kind(name)


def test_stored_copies_keep_the_users_file_name(tmp_path) -> None:
    store = InputStore(tmp_path)
    for name in ("Фото (1).png", "café [final], v2.jpg", "clip+voice@2x.mp4"):
        assert os.path.basename(store.keep_bytes(b"x", name)) == name
    long_name = "é" * 200 + ".webp"
    kept = os.path.basename(store.keep_bytes(b"x", long_name))
    assert kept.endswith(".webp") and len(kept.encode()) <= 120
    assert os.path.basename(store.keep_bytes(b"x", "a\x00b/../\n.png")) == "_.png"


def _write_result(folder, stem: str, prompt: str, mtime: float) -> None:
    (folder / f"{stem}.mp4").write_bytes(b"mp4")
    sidecar = {
        "request": {"task": "t2va", "prompt": prompt},
        "seed": 3,
        "geometry": {"width": 56, "height": 32},
    }
    (folder / f"{stem}.json").write_text(json.dumps(sidecar))
    os.utime(folder / f"{stem}.mp4", (mtime, mtime))


def test_history_lists_complete_results_newest_first(tmp_path) -> None:
    now = time.time()
    _write_result(tmp_path, "older", "first prompt", now - 60)
    _write_result(tmp_path, "newer", "second prompt", now)
    (tmp_path / "orphan.json").write_text(json.dumps({"request": {"task": "t2va", "prompt": "no video"}}))
    (tmp_path / ".newer.mp4.abc.partial").write_bytes(b"")
    (tmp_path / "broken.mp4").write_bytes(b"")
    (tmp_path / "broken.json").write_text("{not json")

    entries = list_history(tmp_path)
    assert [entry.stem for entry in entries] == ["newer", "older"]
    assert history_rows(entries)[0][2:5] == ["T2VA", "second prompt", "3"]
    assert find_entry(tmp_path, "older").sidecar["request"]["prompt"] == "first prompt"
    for hostile in ("../older", "/etc/passwd", ".hidden", "", None, ["older"]):
        assert find_entry(tmp_path, hostile) is None


def test_stored_inputs_are_content_addressed(tmp_path) -> None:
    store = InputStore(tmp_path)
    first = store.keep_file(ASSETS / "fl2va" / "first.png")
    again = store.keep_file(ASSETS / "fl2va" / "first.png")
    assert first == again and first.startswith(str(tmp_path / "inputs"))
    assert open(first, "rb").read() == (ASSETS / "fl2va" / "first.png").read_bytes()
    renamed = store.keep_bytes(b"\x89PNG", "../../evil name?.png")
    assert renamed.startswith(str(tmp_path / "inputs")) and renamed.endswith("evil name_.png")


def test_every_bundled_example_loads_with_existing_files() -> None:
    examples = load_examples(ASSETS / "examples.json", REPOSITORY_ROOT)
    assert all(examples[task] for task in ("t2va", "fl2va", "ref2va"))
    for task, group in examples.items():
        for example in group:
            assert example.request.task == task
            for path in [keyframe.path for keyframe in example.request.keyframes] + [
                reference.path for reference in example.request.references
            ]:
                assert os.path.isfile(path), path
    assert load_examples(ASSETS / "missing.json", REPOSITORY_ROOT) == {"t2va": [], "fl2va": [], "ref2va": []}


def test_result_table_counts_the_mux_that_ran_alongside_the_decode_once() -> None:
    overlapped = {"denoise_s": 10.0, "video_decode_s": 2.0, "mux_s": 1.5, "mux_after_decode_s": 0.25}
    table = result_markdown(1, 64, 48, 24, 24, overlapped)
    assert "| MP4 mux (alongside the video decode) | 1.50 |" in table
    assert "| MP4 mux after the video decode | 0.25 |" in table
    assert table.endswith("| **Total** | **12.25** |")
    # A mux after the decode (a VAE group larger than one) counts whole.
    assert result_markdown(1, 64, 48, 24, 24, {"decode_s": 2.0, "mux_s": 1.5}).endswith(
        "| **Total** | **3.50** |"
    )


def test_every_ending_of_a_set_of_takes_states_itself() -> None:
    from h3engine.runtime.messages import JobFailed, JobFinished, JobStarted, StepProgress
    from ui.takes import MAX_TAKES, TakeSet, checked_takes

    def finished(job: str, seed: int) -> JobFinished:
        return JobFinished(job, f"{job}.mp4", f"{job}.json", seed, 56, 32, 124, 24, {})

    def started(job: str) -> JobStarted:
        return JobStarted(job, 0, 0.0, 56, 32, 124, 24, 32)

    one = TakeSet.of([object()])  # the handles are only drained by TakeSet.drain
    one.takes[0].apply(started("a"))
    one.takes[0].apply(StepProgress("a", 8, 50, 1.0, 5.0))
    assert one.status_line().startswith("Denoising: step 8 of 50")
    one.takes[0].apply(JobFailed("a", "cancelled", "cancelled"))
    assert one.final_status(3.0) == "Cancelled at step 8 of 50."

    three = TakeSet.of([object(), object(), object()])
    three.takes[0].apply(finished("a", 5))
    three.takes[1].apply(JobFailed("b", "engine", "the worker group stopped."))
    assert three.status_line().startswith("Take 3 of 3 (1 done): Waiting")
    three.takes[2].apply(JobFailed("c", "cancelled", "cancelled"))
    assert three.ended
    assert three.final_status(9.0) == (
        "1 of 3 takes done in 9.0 s; 1 cancelled; take 2 failed: the worker group stopped."
    )
    done = TakeSet.of([object(), object()])
    for take, job in zip(done.takes, "ab", strict=True):
        take.apply(finished(job, 7))
    assert done.final_status(2.0) == "Done: 2 of 2 takes done in 2.0 s."
    assert checked_takes(3.0) == 3
    for bad in (0, MAX_TAKES + 1, 1.5, True, "2"):
        with refused(RequestError, field="takes"):
            checked_takes(bad)
    # Two rules on takes: a count out of range, and no whole number.
    with refused(RequestError, field="takes", says=f"must be from 1 to {MAX_TAKES}, got {MAX_TAKES + 1}"):
        checked_takes(MAX_TAKES + 1)
    with refused(RequestError, field="takes", says=f"must be a whole number from 1 to {MAX_TAKES}, got 1.5"):
        checked_takes(1.5)
