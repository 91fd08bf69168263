"""Shared by the tests that drive the app's /v1 API with the real `openai` SDK: a client for a running app and a
wait for a video's end."""

from __future__ import annotations

import time

import openai
from _app_helpers import RunningApp


def openai_client(app: RunningApp, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}v1", api_key=key, max_retries=0, timeout=60)


def wait_for_video(client: openai.OpenAI, video_id: str, timeout: float = 90) -> openai.types.Video:
    """The video once completed or failed (or as it is after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed") or time.monotonic() > deadline:
            return video
        time.sleep(0.1)
