"""With `--auth`, a user's result is served to that user only: another signed-in user, or nobody signed in, asking
for its URL gets nothing (`python app.py` on the tiny checkpoint with two users, over HTTP as a browser would)."""

from __future__ import annotations

import httpx
import pytest
from _app_helpers import RunningApp, start_app, stop_app
from gradio_client import Client

USERS = {"alice": "alice-password", "bob": "bob-password"}
SETTINGS = dict(duration_seconds=5, aspect_ratio="1:1", seed=3, randomize_seed=False, steps=1)


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_native) -> RunningApp:
    arguments = [
        argument for user, password in USERS.items() for argument in ("--auth", f"{user}:{password}")
    ]
    running = start_app(
        tmp_path_factory.mktemp("auth_files"), extra_arguments=arguments, checkpoint=tiny_native
    )
    yield running
    assert stop_app(running) == 0, running.log_tail()


def _signed_in(app: RunningApp, user: str) -> httpx.Client:
    browser = httpx.Client(base_url=app.url, timeout=30)
    answer = browser.post("login", data={"username": user, "password": USERS[user]})
    assert answer.status_code == 200, answer.text
    return browser


def test_a_users_result_is_served_to_that_user_only(app) -> None:
    client = Client(app.url, auth=("alice", USERS["alice"]), verbose=False, download_files=False)
    status, _preview, video, *_rest = client.predict(prompt="Alice's kite.", **SETTINGS, api_name="/t2va")
    client.close()
    assert status.startswith("Done"), status
    url = video["video"]["url"] if "video" in video else video["url"]
    alice, bob = _signed_in(app, "alice"), _signed_in(app, "bob")
    try:
        own = alice.get(url)
        assert own.status_code == 200 and own.content[4:8] == b"ftyp"
        assert bob.get(url).status_code == 404  # another user: as if there were no such file
        assert httpx.get(url).status_code in (401, 404)  # nobody signed in
    finally:
        alice.close()
        bob.close()
