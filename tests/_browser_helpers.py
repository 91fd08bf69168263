"""Shared by the browser tests: Debian's headless chromium through Playwright, pages at the sizes people use, the
few page actions every test repeats, and screenshots (test artifacts; with H3_UPDATE_SCREENSHOTS=1 also the small
PNGs README shows, under docs/screenshots/)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _app_helpers import REPOSITORY_ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # Lets the test start playback from script; a person's click is a user gesture and needs no flag.
    "--autoplay-policy=no-user-gesture-required",
]
ARTIFACTS = REPOSITORY_ROOT / "test-artifacts"
README_SCREENSHOTS = REPOSITORY_ROOT / "docs" / "screenshots"
README_SCREENSHOT_WIDTH = 900
TIMEOUT_MS = 60_000
DESKTOP = {"width": 1400, "height": 1000}
PHONE = {"width": 390, "height": 844}

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed at /usr/bin/chromium (.ci/run installs it)",
)


# One Playwright driver and one chromium per test process, started at the first page and kept until the process's
# last test (conftest.py): a page gets a browser context of its own (its own cookies and storage: a fresh profile, as
# a new browser would have), which costs a fraction of a second where launching both costs about 1.5 s of CPU.
# Between test files the browser is parked: after each call Playwright's sync API marks its event loop as running on
# this thread (wait_for_future in playwright/_impl/_greenlets.py), which the next file's asyncio.run() and Ray's sync
# calls refuse. Parking clears that mark; the next page sets it again before Playwright runs its loop.
_SHARED: dict[str, object] = {}


def _unpark() -> None:
    if "loop" in _SHARED:
        asyncio._set_running_loop(_SHARED["loop"])


def park_shared_browser() -> None:
    """Leave this process's browser running, its event loop no longer marked as running (see above)."""
    if "loop" in _SHARED and asyncio._get_running_loop() is _SHARED["loop"]:
        asyncio._set_running_loop(None)


def _shared_browser():  # noqa: ANN202
    from playwright.sync_api import sync_playwright

    browser = _SHARED.get("browser")
    if browser is not None and browser.is_connected():
        _unpark()
        return browser
    close_shared_browser()  # a browser that crashed: start again
    playwright = sync_playwright().start()
    _SHARED["playwright"] = playwright
    _SHARED["loop"] = asyncio._get_running_loop()  # Playwright's, marked running by its start
    _SHARED["browser"] = playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
    )
    return _SHARED["browser"]


def close_shared_browser() -> None:
    """Close this process's browser and its Playwright driver, if started."""
    _unpark()
    browser, playwright = _SHARED.pop("browser", None), _SHARED.pop("playwright", None)
    _SHARED.pop("loop", None)
    try:
        if browser is not None:
            browser.close()
    finally:
        if playwright is not None:
            playwright.stop()


@contextmanager
def browser_page(
    url: str, viewport: dict[str, int] = DESKTOP, login: tuple[str, str] | None = None
) -> Iterator[object]:
    """A page of a fresh browser context (its own session) showing the app at `url`; `login`: (user, password) for
    Gradio's login page, which an app started with --auth shows first."""
    from playwright.sync_api import expect

    # Assertions wait as long as page actions: Playwright's `expect` keeps its own 5 s default otherwise, shorter
    # than a 4-step generation with decode and mux can take on a loaded 2-core machine (seen twice).
    expect.set_options(timeout=TIMEOUT_MS)
    context = _shared_browser().new_context(viewport=viewport)
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url)
        if login is not None:
            page.get_by_label("username").fill(login[0])
            page.get_by_label("password").fill(login[1])
            page.get_by_role("button", name="Login").click()
        page.locator("#h3-status").wait_for()
        yield page
    finally:
        context.close()


def set_field(page, selector: str, value: str) -> None:
    """Type into a number field as a person does. Gradio commits it on blur; under load a field can still be
    mounting when the first keystrokes arrive (seen once in CI), so type again until the value holds."""
    from playwright.sync_api import expect

    field = page.locator(selector)
    for _attempt in range(5):
        field.fill(value)
        field.press("Tab")
        if field.input_value() == value:
            page.wait_for_timeout(300)
            if field.input_value() == value:
                break
        page.wait_for_timeout(500)
    expect(field).to_have_value(value)


def open_advanced(page, task: str) -> None:
    page.locator(f"#{task}-advanced").get_by_text("Advanced").click()
    page.locator(f"#{task}-steps input").wait_for()


def wait_in_view(page, selector: str) -> None:
    """Until the element lies wholly inside the window as it is scrolled (the page may still be scrolling to it)."""
    page.wait_for_function(
        """(selector) => {
            const box = document.querySelector(selector)?.getBoundingClientRect();
            return box !== undefined && box.height > 0 && box.top >= 0 && box.bottom <= window.innerHeight;
        }""",
        arg=selector,
    )


def screenshot(page, name: str, readme: bool = False, full_page: bool = False) -> Path:
    """Into test-artifacts/; `readme`: also, shrunk, into docs/screenshots/ when H3_UPDATE_SCREENSHOTS=1."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    if readme and os.environ.get("H3_UPDATE_SCREENSHOTS") == "1":
        from PIL import Image

        README_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as image:
            scale = min(1.0, README_SCREENSHOT_WIDTH / image.width)
            small = image.convert("RGB").resize((round(image.width * scale), round(image.height * scale)))
            small.quantize(colors=128).save(README_SCREENSHOTS / f"{name}.png", optimize=True)
    return path


def wait_for_video_frame(page, selector: str = "#h3-video video") -> None:
    """Until the player has decoded a frame to show (a screenshot taken earlier shows an empty player)."""
    page.locator(selector).evaluate(
        """async (video) => {
            if (video.readyState >= 2) return;
            await new Promise((resolve) => video.addEventListener("loadeddata", resolve, { once: true }));
        }"""
    )
