"""The app's HTTP API, driven with gradio_client against `python app.py` on a tiny random-weight checkpoint.

What is compared: every endpoint (/t2va, /fl2va, /ref2va) returns an MP4 whose streams, read back with PyAV, are
H.264 yuv420p at 24 fps with the frame count of the requested duration (124 frames for 5 s) and AAC 32 kHz stereo
lasting as long as the video (within one AAC frame); invalid requests, wrong types, out-of-range slider values and
unknown dropdown values included, are refused before queueing with a ValidationError naming the parameter once
(broken files by the user's own file name with the formats accepted; prompt labels no input defines); /fl2va takes
a first or a last frame alone, and only the prompt (and Ref2VA's references) are required parameters; a result is
served to its client, but neither the outputs folder nor anything outside it is; a cancelled generation stops (the
engine is free for the next request at once and leaves no MP4 behind); two requests submitted together both complete. Steps are kept at 2 so the
file runs in well under a minute on two cores.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _app_helpers import ASSETS, REPOSITORY_ROOT, assert_browser_playable
from _refusals import ui_refused
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError

from h3engine.media.formats import FORMATS

FIVE_SECOND_FRAMES = 124  # 17n + 5 frames at 24 fps
STEPS = 2
SETTINGS = dict(duration_seconds=5, aspect_ratio="auto", randomize_seed=False, steps=STEPS)


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


@pytest.fixture(scope="module")
def client(app, tmp_path_factory):
    return Client(app.url, verbose=False, download_files=str(tmp_path_factory.mktemp("downloads")))


def _video_path(result: tuple) -> str:
    status, _preview, video, seed_used, details, downloads, _takes = result
    assert status.startswith("Done"), status
    assert "Canvas" in details and "Denoise" in details
    assert [path.rsplit(".", 1)[-1] for path in downloads] == ["mp4", "json"]
    return video


def test_t2va_returns_a_browser_playable_mp4(client) -> None:
    result = client.predict(prompt="A red kite over green hills.", seed=11, **SETTINGS, api_name="/t2va")
    assert result[3] == 11  # the seed used
    assert_browser_playable(_video_path(result), FIVE_SECOND_FRAMES)


def test_fl2va_returns_a_browser_playable_mp4(client) -> None:
    result = client.predict(
        prompt="The kite climbs as the sun comes up.",
        first_image=handle_file(ASSETS / "fl2va" / "first.png"),
        last_image=handle_file(ASSETS / "fl2va" / "last.png"),
        seed=12,
        **SETTINGS,
        api_name="/fl2va",
    )
    assert_browser_playable(_video_path(result), FIVE_SECOND_FRAMES)


def test_ref2va_returns_a_browser_playable_mp4(client) -> None:
    result = client.predict(
        prompt="The robot from <Picture 1> waves and speaks in the voice of <Audio 1>.",
        references=[
            handle_file(ASSETS / "ref2va" / "picture1.png"),
            handle_file(ASSETS / "ref2va" / "audio1.wav"),
        ],
        duration_from_reference=False,
        seed=13,
        **SETTINGS,
        api_name="/ref2va",
    )
    assert_browser_playable(_video_path(result), FIVE_SECOND_FRAMES)


@pytest.mark.parametrize(
    ("endpoint", "arguments", "parameter"),
    [
        ("/t2va", dict(prompt="   "), "prompt"),
        ("/t2va", dict(prompt="x", steps=5000), "steps"),
        ("/t2va", dict(prompt="x", flow_shift=-1.0), "flow_shift"),
        # Types, slider ranges and dropdown choices: Gradio's own checks answered these with a bare HTTP 400.
        ("/t2va", dict(prompt="x", duration_seconds=3), "duration_seconds"),
        ("/t2va", dict(prompt="x", duration_seconds="five"), "duration_seconds"),
        ("/t2va", dict(prompt="x", aspect_ratio="7:5"), "aspect_ratio"),
        ("/t2va", dict(prompt="x", seed="abc"), "seed"),
        ("/t2va", dict(prompt="x", steps=2.5), "steps"),
        ("/t2va", dict(prompt="x", randomize_seed="no"), "randomize_seed"),
        ("/t2va", dict(prompt=["x"]), "prompt"),
        ("/t2va", dict(prompt="x", takes=9), "takes"),
        ("/t2va", dict(prompt="x", takes=1.5), "takes"),
        (
            "/ref2va",
            dict(
                prompt="x",
                references=[handle_file(ASSETS / "ref2va" / "picture1.png")],
                duration_from_reference=1,
            ),
            "duration_from_reference",
        ),
        (
            "/fl2va",
            dict(prompt="x", first_image=None, last_image=None),
            "first_image",
        ),
        (
            "/ref2va",
            dict(
                prompt="x",
                references=[handle_file(ASSETS / "ref2va" / "audio1.wav")],
                duration_from_reference=False,
            ),
            "references",
        ),
    ],
)
def test_invalid_requests_mark_their_parameter(app, client, endpoint, arguments, parameter) -> None:
    """Each refusal marks the parameter at fault (the messages' wording is the checks' own tests': tests/test_request.py,
    tests/test_app_ui_helpers.py)."""
    before = app.mp4_files()
    settings = {**SETTINGS, **{key: value for key, value in arguments.items() if key in SETTINGS}}
    inputs = {key: value for key, value in arguments.items() if key not in SETTINGS}
    with pytest.raises(ValidationError) as refused:
        client.predict(**inputs, **settings, api_name=endpoint)
    ui_refused(refused.value, parameter)
    assert app.mp4_files() == before


def test_cancel_stops_a_running_generation(app, client) -> None:
    before = app.mp4_files()
    # 1000 steps of a 15 s clip: tens of seconds of work, so only a working cancel frees the engine quickly.
    job = client.submit(
        prompt="A long one.",
        duration_seconds=15,
        aspect_ratio="auto",
        seed=1,
        randomize_seed=False,
        steps=1000,
        api_name="/t2va",
    )
    deadline = time.monotonic() + 60
    while not any(
        isinstance(update[0], str) and update[0].startswith("Denoising") for update in job.outputs()
    ):
        assert time.monotonic() < deadline, f"no denoising progress arrived:\n{app.log_tail()}"
        assert not job.done(), job.status()
        time.sleep(0.2)
    job.cancel()
    deadline = time.monotonic() + 20
    while not job.done():
        assert time.monotonic() < deadline, "the cancelled job did not end"
        time.sleep(0.2)

    # Had the engine kept denoising, this request would queue behind it; it must start and finish at once.
    started = time.monotonic()
    result = client.predict(prompt="Right after.", seed=2, **SETTINGS, api_name="/t2va")
    assert time.monotonic() - started < 20
    assert {path.name for path in app.mp4_files() - before} == {Path(_video_path(result)).name}


def test_a_result_is_served_but_not_the_outputs_folder(app, client) -> None:
    result = client.predict(prompt="Served.", seed=5, **SETTINGS, api_name="/t2va")
    # The client downloaded the MP4 and the sidecar from the URLs the app answered with.
    video, sidecar = result[5]
    assert Path(video).read_bytes()[4:8] == b"ftyp"
    assert json.loads(Path(sidecar).read_text())["request"]["prompt"] == "Served."
    served = app.outputs_dir / "served.txt"
    served.write_text("in the outputs folder")
    for outside in (served, REPOSITORY_ROOT / "app.py", app.outputs_dir.parent / "app.log"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{app.url}gradio_api/file={outside}")
        assert refused.value.code == 403


def test_two_queued_requests_both_complete(app, client) -> None:
    before = app.mp4_files()
    jobs = [
        client.submit(prompt=f"Request {seed}.", seed=seed, **SETTINGS, api_name="/t2va") for seed in (21, 22)
    ]
    results = [job.result(timeout=120) for job in jobs]
    assert [result[3] for result in results] == [21, 22]
    for result in results:
        assert_browser_playable(_video_path(result), FIVE_SECOND_FRAMES)
    assert len(app.mp4_files() - before) == 2


def test_takes_make_one_job_per_consecutive_seed(app, client) -> None:
    before = app.mp4_files()
    result = client.predict(prompt="Three takes.", seed=70, takes=3, **SETTINGS, api_name="/t2va")
    status, _preview, video, seed_used, _details, downloads, takes = result
    assert status.startswith("Done: 3 of 3 takes done"), status
    assert seed_used == 70  # the first take is the one shown
    assert [take["caption"] for take in takes] == ["Take 1 · seed 70", "Take 2 · seed 71", "Take 3 · seed 72"]
    for take in takes:
        assert_browser_playable(take["video"], FIVE_SECOND_FRAMES)
    made = app.mp4_files() - before
    assert len(made) == 3
    seeds = sorted(json.loads(path.with_suffix(".json").read_text())["seed"] for path in made)
    assert seeds == [70, 71, 72]


# ---------------------------------------------------------------------------------------------------------------
# Issue 19: every invalid parameter is named once, files by the user's own name; optional inputs are optional

PICTURE = ASSETS / "ref2va" / "picture1.png"
FIRST = ASSETS / "fl2va" / "first.png"
BASES = {
    "/t2va": dict(prompt="A kite."),
    "/fl2va": dict(prompt="A kite.", first_image=FIRST),
    "/ref2va": dict(prompt="<Picture 1> waves.", references=[PICTURE], duration_from_reference=False),
}
# (endpoint, parameter, value): one parameter of one endpoint out of range or of the wrong type.
BAD_PARAMETERS = [
    ("/t2va", "prompt", ""),
    ("/t2va", "prompt", 7),
    ("/t2va", "prompt", "<Picture 1> flies."),
    ("/t2va", "duration_seconds", 3),
    ("/t2va", "duration_seconds", "five"),
    ("/t2va", "aspect_ratio", "7:5"),
    ("/t2va", "seed", -1),
    ("/t2va", "seed", "abc"),
    ("/t2va", "randomize_seed", "no"),
    ("/t2va", "steps", 5000),
    ("/t2va", "steps", 2.5),
    ("/t2va", "flow_shift", 0),
    ("/t2va", "audio_flow_shift", "x"),
    ("/t2va", "short_edge", 100_000),
    ("/fl2va", "prompt", "From <Picture 1> to <Picture 2>."),
    ("/fl2va", "first_image", "/etc/passwd"),
    ("/fl2va", "first_image", 5),
    ("/fl2va", "last_image", {"path": "/etc/passwd"}),
    ("/fl2va", "steps", 0),
    ("/ref2va", "prompt", "<Picture 1> meets <Picture 3>."),
    ("/ref2va", "prompt", "<Picture 1> sings <Audio 1>."),
    ("/ref2va", "references", "picture1.png"),
    ("/ref2va", "references", [5]),
    ("/ref2va", "duration_from_reference", 1),
    ("/ref2va", "duration_seconds", 15.5),
]


def _call(client: Client, endpoint: str, **arguments) -> tuple:
    """`client.predict` with SETTINGS under `arguments`, local files (Path) uploaded with handle_file."""
    for name, value in arguments.items():
        if isinstance(value, Path):
            arguments[name] = handle_file(value)
        if isinstance(value, list):
            arguments[name] = [handle_file(item) if isinstance(item, Path) else item for item in value]
    return client.predict(**{**SETTINGS, **arguments}, api_name=endpoint)


def _refusal(client: Client, endpoint: str, parameter: str, **arguments) -> str:
    """What the page shows under `parameter`, the one input the refusal of this call marks."""
    with pytest.raises(ValidationError) as refused:
        _call(client, endpoint, **arguments)
    return ui_refused(refused.value, parameter)


@pytest.mark.parametrize(
    ("endpoint", "parameter", "value"), BAD_PARAMETERS, ids=[f"{e}-{p}={v!r}" for e, p, v in BAD_PARAMETERS]
)
def test_each_invalid_parameter_is_a_validation_error_naming_it_once(
    app, client, endpoint, parameter, value
) -> None:
    before = app.mp4_files()
    shown = _refusal(client, endpoint, parameter, **{**BASES[endpoint], parameter: value})
    assert parameter not in shown, shown  # named once: by the mark, not again in the words
    assert app.mp4_files() == before


@pytest.mark.parametrize(
    ("endpoint", "parameter", "name", "data", "kind"),
    [
        ("/fl2va", "first_image", "empty.png", b"", "image"),
        ("/fl2va", "last_image", "notes.jpg", b"not a picture\n", "image"),
        ("/ref2va", "references", "empty.png", b"", "image"),
        ("/ref2va", "references", "notes.mp3", b"not a sound\n" * 10, "audio"),
        ("/ref2va", "references", "cut.mp4", (ASSETS / "ref2va" / "video1.mp4").read_bytes()[:3000], "video"),
        ("/ref2va", "references", "sketch.bmp", b"BM" + bytes(100), "image"),
    ],
    ids=[
        "empty-first-frame",
        "text-last-frame",
        "empty-reference",
        "text-as-mp3",
        "truncated-mp4",
        "bmp-reference",
    ],
)
def test_a_broken_file_is_named_by_its_own_name_with_what_is_accepted(
    app, client, tmp_path, endpoint, parameter, name, data, kind
) -> None:
    (tmp_path / name).write_bytes(data)
    upload = tmp_path / name
    value = [PICTURE, upload] if parameter == "references" else upload
    shown = _refusal(client, endpoint, parameter, **{**BASES[endpoint], parameter: value})
    # The file by its own name and the formats of its kind (the sentences: the readers' tests,
    # tests/test_media_inputs.py and tests/test_app_ui_helpers.py); neither the temporary upload path nor Gradio's
    # own wording: our message, once.
    assert f"'{name}'" in shown and FORMATS[kind].describe() in shown, shown
    assert "/" not in shown.replace("/fl2va", "") and "preprocess" not in shown and parameter not in shown


def test_fl2va_takes_only_a_first_or_only_a_last_frame(client) -> None:
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for endpoint, required in (
        ("/t2va", {"prompt"}),
        ("/fl2va", {"prompt"}),
        ("/ref2va", {"prompt", "references"}),
    ):
        parameters = endpoints[endpoint]["parameters"]
        assert {p["parameter_name"] for p in parameters if not p["parameter_has_default"]} == required, (
            endpoint
        )
    result = client.predict(
        prompt="The kite climbs.", first_image=handle_file(FIRST), seed=3, **SETTINGS, api_name="/fl2va"
    )
    assert_browser_playable(_video_path(result), FIVE_SECOND_FRAMES)
    result = client.predict(
        prompt="The kite lands.", last_image=handle_file(FIRST), seed=4, **SETTINGS, api_name="/fl2va"
    )
    assert _video_path(result).endswith(".mp4")
