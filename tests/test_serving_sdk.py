"""Every H3 task through the unchanged `openai` SDK, and nothing kept from a refused or failed request, against
`python app.py` (tiny checkpoint, loopback, two API keys, the job store in a folder of its own).

Checked: every `size` the canvas rule makes (and `auto`) accepted, others 400 listing them; FL2VA with a last frame
and Ref2VA with several references sent by the SDK as data: URLs, as ids of files uploaded to /v1/files (JSON and
multipart), and as a list of uploads; /v1/files owner-scoped; 50 refused uploads leave the outputs folder as it
was; a job's inputs go with the job; the inputs quota; an outputs folder that breaks mid-run (the job fails with the
page's sentence, its staging files gone at once, the store answering, the next request refused with the same
sentence until the folder works again); `spritesheet`; `edit`, unknown routes and methods in OpenAI's shape;
`model` a string the server serves; a body of invalid UTF-8 named. Jobs use 1 step at the smallest canvas.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from _api_helpers import openai_client, wait_for_video
from _app_helpers import ASSETS, RunningApp, refusing_writes, start_app, stop_app
from _refusals import api_refused
from PIL import Image

from h3engine.serving.service import owner_of_key

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning"
)  # the SDK marks its video API deprecated

KEY_A = "key-a-0123456789"
KEY_B = "key-b-0123456789"
FAST = {"steps": 1, "aspect_ratio": "1:1"}
QUOTA_BYTES = 4 * 1024**2
ARGUMENTS = [
    *("--api-key", KEY_A, "--api-key", KEY_B, "--max-inputs-size", "4mb", "--max-body-size", "3mb"),
    *("--max-queue", "16", "--max-jobs-per-owner", "16"),
]
OUTPUTS_SENTENCE = "The outputs folder refuses writes ("


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_native) -> RunningApp:
    folder = tmp_path_factory.mktemp("serving_sdk")
    running = start_app(
        folder, extra_arguments=[*ARGUMENTS, "--state-dir", str(folder / "state")], checkpoint=tiny_native
    )
    yield running
    assert stop_app(running) == 0, running.log_tail()


def _client(app: RunningApp, key: str = KEY_A) -> openai.OpenAI:
    return openai_client(app, key)


def _wait(client: openai.OpenAI, video_id: str, timeout: float = 90) -> openai.types.Video:
    return wait_for_video(client, video_id, timeout)


def _data_url(path: Path, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _inputs(client: openai.OpenAI, video_id: str) -> list[dict]:
    return json.loads(client.videos.download_content(video_id, variant="sidecar").content)["inputs"]


def _tree(folder: Path) -> dict[str, int]:
    return {
        str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*") if path.is_file()
    }


def owner_key(owner: str) -> str:
    """The folder name of an owner's results and inputs (h3engine.serving.inputs.owner_key)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


def _owner_inputs(app: RunningApp, key: str = KEY_A) -> Path:
    return app.outputs_dir / "inputs" / "api" / owner_key(owner_of_key(key))


@pytest.mark.parametrize(
    ("size", "reported"), [("auto", "56x32"), ("56x32", "56x32"), ("32x56", "32x56"), ("64x64", "64x64")]
)
def test_every_size_the_rule_makes_is_taken(app, size, reported) -> None:
    client = _client(app)
    video = client.videos.create(prompt="A kite.", size=size, extra_body={"steps": 1})
    assert video.size == reported, video
    assert _wait(client, video.id).status == "completed"


def test_a_size_beyond_the_presets_passes_the_canvas_checks(app) -> None:
    """1344x768 (README's size) on the tiny checkpoint, whose 16:9 at that edge is 1360x768: the explicit canvas
    passes, so the checker's next complaint is the duration (checked after the canvas); no job is made."""
    with pytest.raises(openai.BadRequestError) as raised:
        _client(app).videos.create(prompt="A kite.", size="1344x768", seconds="3")  # type: ignore[arg-type]
    assert raised.value.body["param"] == "seconds", raised.value.body


def test_sizes_are_judged_by_the_checker_and_a_size_that_is_not_wxh_lists_the_sizes(app) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        _client(app).videos.create(prompt="A kite.", size="1000x10")
    api_refused(
        raised.value.body, "size"
    )  # the checker's refusal of --height (its sentence: test_serving_units.py)
    with pytest.raises(openai.BadRequestError) as raised:
        _client(app).videos.create(prompt="A kite.", size="big")
    error = raised.value.body
    assert (
        error["param"] == "size"
        and "supported: auto, 64x24, 56x32, 40x32, 32x32, 32x40, 32x56" in error["message"]
    )


def test_fl2va_with_a_last_frame_and_ref2va_with_several_references_through_the_sdk(app) -> None:
    client = _client(app)
    first, last = ASSETS / "fl2va" / "first.png", ASSETS / "fl2va" / "last.png"
    picture, voice = ASSETS / "ref2va" / "picture1.png", ASSETS / "ref2va" / "audio1.wav"
    uploaded = client.files.create(file=last, purpose="vision")
    assert (uploaded.object, uploaded.filename, uploaded.bytes) == ("file", "last.png", last.stat().st_size)
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == last.read_bytes()
    voice_file = client.files.create(file=voice, purpose="user_data")
    jobs = {
        "fl2va, last frame a data URL": client.videos.create(
            prompt="The kite climbs.",
            input_reference=first,
            extra_body={**FAST, "last_frame": _data_url(last, "image/png")},
        ),
        "fl2va, last frame a file id (multipart)": client.videos.create(
            prompt="The kite climbs.",
            input_reference=first,
            extra_body={**FAST, "last_frame": {"file_id": uploaded.id}},
        ),
        "ref2va, a list of uploads": client.videos.create(
            prompt="<Picture 1> speaks in the voice of <Audio 1>.",
            input_reference=[picture, voice],
            extra_body=FAST,
        ),
        "ref2va, file ids and a data URL": client.videos.create(
            prompt="<Picture 1> speaks in the voice of <Audio 1>.",
            extra_body={**FAST, "references": [_data_url(picture, "image/png"), voice_file.id]},
        ),
    }
    as_json = httpx.post(
        f"{app.url}v1/videos",
        json={
            "prompt": "The kite climbs.",
            **FAST,
            "input_reference": {"file_id": uploaded.id},
            "last_frame": uploaded.id,
        },
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert as_json.status_code == 200, as_json.text
    jobs["fl2va, file ids (JSON)"] = client.videos.retrieve(as_json.json()["id"])
    expected = {
        "fl2va, last frame a data URL": ("fl2va", ["first", "last"]),
        "fl2va, last frame a file id (multipart)": ("fl2va", ["first", "last"]),
        "ref2va, a list of uploads": ("ref2va", ["image", "audio"]),
        "ref2va, file ids and a data URL": ("ref2va", ["image", "audio"]),
        "fl2va, file ids (JSON)": ("fl2va", ["first", "last"]),
    }
    for name, video in jobs.items():
        video = _wait(client, video.id)
        assert video.status == "completed", (name, video)
        task, roles = expected[name]
        inputs = _inputs(client, video.id)
        assert (
            video.h3["task"] == task
            and [entry.get("position") or entry.get("kind") for entry in inputs] == roles
        )
    # Another key can neither see nor use the file.
    other = _client(app, KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError) as raised:
        other.videos.create(prompt="x", input_reference=first, extra_body={"last_frame": uploaded.id})
    assert raised.value.body["param"] == "last_frame"
    assert uploaded.id not in [item.id for item in other.files.list()]
    assert uploaded.id in [item.id for item in client.files.list()]
    # Deleting the files does not break a job made from them: each job keeps its own copy (a remix its own too).
    assert client.files.delete(uploaded.id).deleted and client.files.delete(voice_file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    remix = _wait(client, client.videos.remix(jobs["fl2va, file ids (JSON)"].id, prompt="At night.").id)
    assert remix.status == "completed" and [entry["position"] for entry in _inputs(client, remix.id)] == [
        "first",
        "last",
    ]


def test_refused_requests_keep_nothing_and_inputs_go_with_their_job(app) -> None:
    client = _client(app)
    image = (ASSETS / "fl2va" / "first.png").read_bytes()
    before = _tree(app.outputs_dir)
    refusals = [
        {"seconds": "3"},
        {"size": "1000x10"},
        {"colour": "red"},
        {"steps": "5000"},
        {"task": "t2va", "last_frame": "data:image/png;base64,AAAA"},
    ]
    for index in range(50):
        response = httpx.post(
            f"{app.url}v1/videos",
            data={"prompt": "x", **refusals[index % len(refusals)]},
            files=[("input_reference", (f"frame{index}.png", image, "image/png"))],
            headers={"Authorization": f"Bearer {KEY_A}"},
        )
        assert response.status_code == 400, response.text
    assert _tree(app.outputs_dir) == before
    # A finished FL2VA job's frame is its own, and goes when the job is deleted.
    video = _wait(
        client,
        client.videos.create(prompt="x", input_reference=ASSETS / "fl2va" / "first.png", extra_body=FAST).id,
    )
    assert video.status == "completed"
    folder = _owner_inputs(app) / video.id
    assert [path.name for path in folder.iterdir()] == ["first.png"]
    client.videos.delete(video.id)
    assert not folder.exists()


def test_the_inputs_quota_refuses_before_writing(app) -> None:
    client = _client(app, KEY_B)
    noise = base64.b64encode(bytes(range(256)) * 6400)  # 2.2 MB
    kept = [client.files.create(file=("a.png", b"\x89PNG" + noise), purpose="vision")]
    folder = _owner_inputs(app, KEY_B)
    before = _tree(folder)
    with pytest.raises(openai.RateLimitError) as raised:
        client.files.create(file=("b.png", b"\x89PNG" + noise), purpose="vision")
    assert (
        raised.value.body["code"] == "inputs_quota_exceeded"
        and "4.0 MB per owner" in raised.value.body["message"]
    )
    assert _tree(folder) == before
    client.files.delete(kept[0].id)
    kept.append(client.files.create(file=("b.png", b"\x89PNG" + noise), purpose="vision"))  # room again
    client.files.delete(kept[1].id)


def test_a_broken_outputs_folder_fails_the_job_in_plain_words_and_refuses_until_fixed(app, tmp_path) -> None:
    client = _client(app)
    running = client.videos.create(prompt="A longer one.", extra_body={**FAST, "steps": 400})
    deadline = time.monotonic() + 60
    while client.videos.retrieve(running.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.02)
    moved = tmp_path / "moved-outputs"
    shutil.move(app.outputs_dir, moved)
    app.outputs_dir.write_text("not a folder")
    try:
        video = _wait(client, running.id)
        assert video.status == "failed", video
        assert (
            video.error.message
            == "The outputs folder refuses writes (Not a directory); the details are in the server log."
        )
        assert not [path for path in moved.rglob("*.partial")]  # the staging files went at once
        with pytest.raises(openai.InternalServerError) as raised:  # 503, the same sentence; the store answers
            client.videos.create(prompt="x", extra_body=FAST)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "outputs_unwritable"
        assert raised.value.body["message"] == video.error.message
        assert client.videos.retrieve(running.id).status == "failed"
    finally:
        app.outputs_dir.unlink()
        shutil.move(moved, app.outputs_dir)
    assert _wait(client, client.videos.create(prompt="x", extra_body=FAST).id).status == "completed"


def test_an_outputs_folder_that_refuses_writes_refuses_the_request_not_the_job(app) -> None:
    """Immutable (or read-only) results folder: the create is refused with the page's sentence (once: 200 with a job
    already failed, naming the internal field out_path), and served again once the folder takes writes."""
    client = _client(app)
    results = app.outputs_dir / "api" / owner_key(owner_of_key(KEY_A))
    with refusing_writes(results):
        with pytest.raises(openai.InternalServerError) as raised:
            client.videos.create(prompt="x", extra_body=FAST)
        assert (
            raised.value.body["message"].startswith(OUTPUTS_SENTENCE)
            and "out_path" not in raised.value.body["message"]
        )
    assert _wait(client, client.videos.create(prompt="x", extra_body=FAST).id).status == "completed"


def test_spritesheet_edit_model_and_bodies(app, tmp_path) -> None:
    client = _client(app)
    video = _wait(client, client.videos.create(prompt="A kite.", extra_body=FAST).id)
    target, clip = tmp_path / "sheet.jpg", tmp_path / "clip.mp4"
    client.videos.download_content(video.id).write_to_file(clip)
    client.videos.download_content(video.id, variant="spritesheet").write_to_file(target)
    width, height = map(int, video.size.split("x"))
    with Image.open(target) as sheet:
        assert (sheet.format, sheet.size) == ("JPEG", (5 * width, 5 * height))
    with pytest.raises(openai.NotFoundError) as raised:
        client.videos.edit(prompt="Make it night.", video=clip)  # the SDK's {"id": ...} form fails in the SDK
    assert (raised.value.body["type"], raised.value.body["code"]) == (
        "invalid_request_error",
        "unsupported_endpoint",
    )
    headers = {"Authorization": f"Bearer {KEY_A}"}
    wrong_method = httpx.put(f"{app.url}v1/videos", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{app.url}v1/nothing", headers=headers).json()["error"]["code"] == "unknown_url"
    for model in (123, "sora-2"):
        with pytest.raises(openai.BadRequestError) as raised:
            client.videos.create(prompt="x", model=model)  # type: ignore[arg-type]
        assert raised.value.body["param"] == "model"
    not_utf8 = httpx.post(
        f"{app.url}v1/videos",
        content=b'{"prompt": "caf\xe9"}',
        headers={**headers, "Content-Type": "application/json"},
    )
    assert not_utf8.status_code == 400 and not_utf8.json()["error"]["param"] == "body"
    assert "not valid UTF-8" in not_utf8.json()["error"]["message"]
