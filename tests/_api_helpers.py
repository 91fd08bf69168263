"""Shared by the tests that drive the app's /v1 API with the real `openai` SDK: a client for a running app and a
wait for a video's end."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
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


class InProcessApi:
    """The /v1/videos API over `front` in this process (no server, no port): `post` a create, `create_and_wait`
    for its end. A context manager; the job service is closed when it exits."""

    def __init__(self, front: object, folder: Path) -> None:
        from starlette.applications import Starlette

        from h3engine.serving.options import ServingOptions
        from h3engine.serving.server import start_serving
        from h3engine.serving.store import JobStore

        self.runtime = start_serving(
            front,
            JobStore.open(folder / "state"),
            folder / "outputs",
            ServingOptions(),
            "127.0.0.1",
            2**26,
            4,
        )
        self.transport = httpx.ASGITransport(app=Starlette(routes=self.runtime.routes()))

    def __enter__(self) -> InProcessApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime.stop_taking()
        self.runtime.close()

    def post(self, **kwargs: object) -> httpx.Response:
        """POST /v1/videos with httpx's `data`, `files` or `json`."""

        async def post() -> httpx.Response:
            async with httpx.AsyncClient(transport=self.transport, base_url="http://127.0.0.1") as client:
                return await client.post("/v1/videos", **kwargs)

        return asyncio.run(post())

    def create_and_wait(self, timeout: float = 120, **kwargs: object) -> dict:
        """The Video object of a create, once its job ended (completed or failed)."""

        async def create_and_wait() -> dict:
            async with httpx.AsyncClient(transport=self.transport, base_url="http://127.0.0.1") as client:
                created = await client.post("/v1/videos", **kwargs)
                assert created.status_code == 200, created.text
                video = created.json()
                deadline = time.monotonic() + timeout
                while video["status"] not in ("completed", "failed"):
                    assert time.monotonic() < deadline, f"the job did not end in {timeout:g} s"
                    await asyncio.sleep(0.1)
                    video = (await client.get(f"/v1/videos/{video['id']}")).json()
                return video

        return asyncio.run(create_and_wait())
