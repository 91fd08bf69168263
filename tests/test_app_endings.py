"""Every ending restores the page, and each --auth user has a History of their own: `python app.py` on a tiny
checkpoint served by a worker group of two CPU ranks, with one user from `--auth` and one from `--auth-file`, and
room for one job running and one waiting; its DiT is split by tensor parallelism (--dit-tp 2).

What is compared, through gradio_client and in a real browser (Playwright, Debian's headless chromium):
* the ranks fork from a server that has imported torch and the engine, though the app runs from another folder;
* the group serves requests through the HTTP API (a browser-playable MP4);
* a rank killed (SIGKILL) mid-job fails that job with the engine's sentence (the API's error; the page's status,
  with Generate enabled again at once); the next job, pressed on the same page without a reload, is done;
* an outputs folder that refuses writes refuses the job before it is queued with a sentence naming the outputs
  folder and no server path (the API's error; the page's status instead of "Starting…", Generate enabled); once
  the folder takes writes again the next job is done;
* a press that Gradio's full queue refuses says so, and Generate is enabled again;
* two users, each in their own browser, see only their own results in History; the same user in another browser
  sees theirs;
* last, SIGTERM with one rank stopped (SIGSTOP) ends the app within 10 s, with exit code 0 and no process left.
The API tests run without chromium; the browser tests skip, with the reason, when /usr/bin/chromium is missing.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from _app_helpers import (
    assert_browser_playable,
    descendants,
    fork_servers_of,
    rank_processes,
    refusing_writes,
    start_app,
    stop_app,
)
from _browser_helpers import DESKTOP, browser_page, needs_chromium, open_advanced, screenshot, set_field
from _runtime_helpers import still_running
from gradio_client import Client
from gradio_client.client import Job
from gradio_client.exceptions import AppError
from gradio_client.utils import QueueError, Status

from ui.access import owner_folder
from ui.endings import NOT_TAKEN_STATUS

ALICE, BOB = ("alice", "a1-secret"), ("bob", "b2 with spaces, and a comma")
SETTINGS = dict(duration_seconds=4, aspect_ratio="auto", seed=3, randomize_seed=False)
KILLED = re.compile(r"A worker process died \(rank \d, exit code -9\)")
REFUSED = re.compile(r"the outputs folder refuses writes")
EVENT_TIMEOUT_S = 120
FOUR_SECOND_FRAMES = 107  # 17n + 5 frames covering 4 s at 24 fps


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("app_endings")
    users = folder / "users.txt"
    users.write_text(f"# who may log in besides --auth\n{BOB[0]}:{BOB[1]}\n", encoding="utf-8")
    running = start_app(
        folder,
        # One generation at a time and one waiting: a third is refused (Gradio's full queue).
        extra_arguments=[
            "--world-size",
            "2",
            "--dit-tp",
            "2",
            "--queue-size",
            "1",
            "--auth",
            ":".join(ALICE),
            "--auth-file",
            str(users),
        ],
    )
    yield running
    assert stop_app(running) == 0, running.log_tail()


def _client(app, tmp_path, user: tuple[str, str]) -> Client:
    return Client(app.url, auth=user, verbose=False, download_files=str(tmp_path / "downloads"))


def _wait_for_denoising(app, job) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not any(str(update[0]).startswith("Denoising") for update in job.outputs()):
        assert time.monotonic() < deadline and not job.done(), f"no denoising step:\n{app.log_tail()}"
        time.sleep(0.2)


def _submit_once_taken(app, client: Client, **arguments) -> Job:
    """A job submitted until Gradio's queue takes it and it denoises: a job of an earlier test may still hold the
    queue's one place for a moment (Gradio then refuses the submit with a QueueError)."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        job = client.submit(**arguments)
        while not any(str(update[0]).startswith("Denoising") for update in job.outputs()):
            if job.done():
                break
            assert time.monotonic() < deadline, f"no denoising step:\n{app.log_tail()}"
            time.sleep(0.2)
        else:
            return job
        assert isinstance(job.exception(), QueueError), f"{job.exception()!r}\n{app.log_tail()}"
        assert time.monotonic() < deadline, f"the queue stayed full:\n{app.log_tail()}"
        time.sleep(0.5)


def _kill_a_rank(app) -> None:
    ranks = rank_processes(app)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)


def test_ranks_fork_from_a_server_that_has_the_engine_imported(app) -> None:
    """The app runs from a folder of its own (not the repository's), and its fork server, which does not use the
    sys.path it is handed, must still have imported the rank code: otherwise every rank start and group restart
    imports torch and the engine anew. app.py itself imports no torch at its top, so torch's library in the server's
    memory map tells that the preload worked."""
    (server,) = fork_servers_of(app.process.pid)
    assert "libtorch_cpu" in Path(f"/proc/{server}/maps").read_text()


def test_api_a_killed_rank_fails_its_job_with_a_sentence_and_the_next_job_is_done(app, tmp_path) -> None:
    client = _client(app, tmp_path, ALICE)
    job = client.submit(prompt="A long one.", steps=1000, **SETTINGS, api_name="/t2va")
    _wait_for_denoising(app, job)
    _kill_a_rank(app)
    with pytest.raises(AppError, match=KILLED):
        job.result(timeout=EVENT_TIMEOUT_S)
    assert job.outputs()[-1][0].startswith("Failed: A worker process died")
    result = client.predict(prompt="Right after.", steps=2, **SETTINGS, api_name="/t2va")
    assert result[0].startswith("Done"), result[0]
    assert_browser_playable(result[2], FOUR_SECOND_FRAMES)


def test_api_an_outputs_folder_that_refuses_writes_is_refused_in_words_then_recovers(app, tmp_path) -> None:
    client = _client(app, tmp_path, BOB)
    results = app.outputs_dir / owner_folder(BOB[0], None)
    assert not results.exists()  # so the results folder's own creation is refused
    with refusing_writes(app.outputs_dir / "users"):
        job = client.submit(prompt="Nowhere to go.", steps=2, **SETTINGS, api_name="/t2va")
        with pytest.raises(AppError, match=REFUSED) as refused:
            job.result(timeout=EVENT_TIMEOUT_S)
    assert str(app.outputs_dir) not in str(refused.value)
    assert job.outputs()[-1][0].startswith("⚠ Not started: the outputs folder refuses writes"), job.outputs()
    assert "upstream Gradio app has raised an exception" not in str(refused.value)
    result = client.predict(prompt="Somewhere now.", steps=2, **SETTINGS, api_name="/t2va")
    assert result[0].startswith("Done"), result[0]


def _generate(page, prompt: str, steps: int) -> None:
    page.locator("#t2va-prompt textarea").fill(prompt)
    if not page.locator("#t2va-steps input").is_visible():
        open_advanced(page, "t2va")
    set_field(page, "#t2va-steps input", str(steps))
    page.locator("#t2va-generate").click()


@needs_chromium
def test_browser_after_a_killed_rank_the_status_says_why_and_generate_works_again(app) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, DESKTOP, login=ALICE) as page:
        _generate(page, "A long one.", 1000)
        expect(page.locator("#h3-status")).to_contain_text("Denoising: step")
        expect(page.locator("#t2va-generate")).to_be_disabled()
        _kill_a_rank(app)
        expect(page.locator("#h3-status")).to_contain_text(KILLED)
        expect(page.locator("#t2va-generate")).to_be_enabled()
        screenshot(page, "ending-killed-rank-desktop")
        _generate(page, "Right after the restart.", 2)
        expect(page.locator("#h3-status")).to_contain_text("Done")
        expect(page.locator("#h3-history tbody tr").first).to_contain_text("Right after the restart.")


@needs_chromium
def test_browser_an_outputs_folder_that_refuses_writes_says_so_and_generate_works_again(app) -> None:
    from playwright.sync_api import expect

    results = app.outputs_dir / owner_folder(ALICE[0], None)
    with browser_page(app.url, DESKTOP, login=ALICE) as page:
        with refusing_writes(results):  # made first, so the front's own check of the output path refuses it
            _generate(page, "Nowhere to go.", 2)
            expect(page.locator("#h3-status")).to_contain_text(
                "⚠ Not started: the outputs folder refuses writes"
            )
            expect(page.locator("#t2va-generate")).to_be_enabled()
            screenshot(page, "ending-unwritable-outputs-desktop")
        assert str(app.outputs_dir) not in page.locator("body").inner_text()
        _generate(page, "Somewhere now.", 2)
        expect(page.locator("#h3-status")).to_contain_text("Done")


@needs_chromium
def test_browser_each_user_sees_only_their_own_history(app) -> None:
    from playwright.sync_api import expect

    prompts = {ALICE: "Alice's lighthouse at dusk.", BOB: "Bob's harbour at dawn."}
    for user, prompt in prompts.items():
        with browser_page(app.url, DESKTOP, login=user) as page:
            _generate(page, prompt, 2)
            expect(page.locator("#h3-status")).to_contain_text("Done")
    for user, prompt in prompts.items():
        # A new browser: History comes from the user's folder, not from the session that made the result.
        with browser_page(app.url, DESKTOP, login=user) as page:
            history = page.locator("#h3-history")
            expect(history.locator("tbody tr", has_text=prompt)).to_have_count(1)
            other = next(text for owner, text in prompts.items() if owner != user)
            assert other not in history.inner_text()


@needs_chromium
def test_browser_a_press_the_full_queue_refuses_says_so_and_generate_works_again(app, tmp_path) -> None:
    from playwright.sync_api import expect

    client = _client(app, tmp_path, BOB)
    with browser_page(app.url, DESKTOP, login=ALICE) as page:
        _generate(page, "Before the rush.", 2)
        expect(page.locator("#h3-status")).to_contain_text("Done")
        running = _submit_once_taken(
            app, client, prompt="A long one.", steps=1000, **SETTINGS, api_name="/t2va"
        )
        waiting = client.submit(prompt="A short one.", steps=2, **SETTINGS, api_name="/t2va")
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while waiting.status().code != Status.IN_QUEUE:
            assert time.monotonic() < deadline, waiting.status()
            time.sleep(0.1)
        _generate(page, "No room.", 2)
        expect(page.locator("#h3-status")).to_have_text(NOT_TAKEN_STATUS)
        expect(page.locator("#t2va-generate")).to_be_enabled()
        # A page loaded while the queue is full still lists its History (light events skip the jobs' queue).
        page.reload()
        expect(page.locator("#h3-history tbody tr", has_text="Before the rush.")).to_have_count(1)
        running.cancel()
        assert waiting.result(timeout=EVENT_TIMEOUT_S)[0].startswith("Done")
        _generate(page, "Room again.", 2)
        expect(page.locator("#h3-status")).to_contain_text("Done")


def test_sigterm_with_a_stopped_rank_ends_the_app_and_every_process_within_10_s(app) -> None:
    """Last in this file: it stops the module's app. A rank that does not answer (SIGSTOP) holds up neither SIGTERM
    nor the exit."""
    started = descendants(app.process.pid)
    ranks = rank_processes(app)
    assert len(ranks) == 2 and set(ranks) <= set(started), (ranks, started)
    os.kill(ranks[1], signal.SIGSTOP)
    terminated_at = time.monotonic()
    exit_code = stop_app(app)
    assert time.monotonic() - terminated_at < 10, app.log_tail()
    assert exit_code == 0, app.log_tail()
    assert still_running(started) == [], app.log_tail()
