"""The app in a real browser: Playwright drives Debian's headless chromium against `python app.py` on a tiny checkpoint.

What it checks, as a person would see it: started with no checkpoint, the app shows the random-weights banner; FL2VA takes a first and a last image and
the swap button exchanges them; Ref2VA lists added references with the labels the prompt can cite, reorders
them (the labels follow the new order) and inserts a label into the prompt; a generation shows a video element
that has a duration and an audio track and plays; the result appears in the history and clicking it restores its
settings. A screenshot is saved to test-artifacts/.

Skips, with the reason, only when /usr/bin/chromium is missing (.ci/run installs Debian's chromium; Playwright's
own browser download does not work here).
"""

from __future__ import annotations

import re

import pytest
from _app_helpers import ASSETS
from _browser_helpers import ARTIFACTS, browser_page, needs_chromium, open_advanced, set_field

pytestmark = needs_chromium
FIRST_IMAGE = re.compile(r"/first\.png")
LAST_IMAGE = re.compile(r"/last\.png")


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    # No checkpoint given: the app makes and labels its embedded random-weight default (shared: conftest.py).
    return shared_app


@pytest.fixture()
def page(app):
    with browser_page(app.url, {"width": 1400, "height": 1400}) as page:
        yield page


def test_generate_in_the_browser(app, page) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#h3-banner")).to_contain_text("Random weights")

    # Ref2VA: add three references, move the video up, insert its label into the prompt.
    page.get_by_role("tab", name="References").click()
    page.locator("#ref2va-add input[type=file]").set_input_files(
        [
            ASSETS / "ref2va" / "picture1.png",
            ASSETS / "ref2va" / "video1.mp4",
            ASSETS / "ref2va" / "audio1.wav",
        ]
    )
    # Each card's label line, then its name line, in the list's order.
    cards = page.locator("[id^=ref2va-card-][id$=-labels], [id^=ref2va-card-][id$=-name]")
    picture, video, audio = "picture1.png", "video1.mp4 · 3.0 s", "audio1.wav · 3.0 s"
    expect(cards).to_have_text(
        ["1. <Picture 1>", picture, "2. <Audio 1> <Video 1>", video, "3. <Audio 2>", audio],
        use_inner_text=True,
    )
    page.locator("#ref2va-card-1-up").click()
    expect(cards).to_have_text(
        ["1. <Audio 1> <Video 1>", video, "2. <Picture 1>", picture, "3. <Audio 2>", audio],
        use_inner_text=True,
    )
    page.locator("#ref2va-prompt textarea").fill("The robot from")
    page.get_by_role("button", name="Insert <Picture 1>").click()
    expect(page.locator("#ref2va-prompt textarea")).to_have_value("The robot from <Picture 1>")

    # FL2VA: upload the first and the last image, swap them twice (back to the original order), generate.
    page.get_by_role("tab", name="First / last frame").click()
    page.locator("#fl2va-first input[type=file]").set_input_files(ASSETS / "fl2va" / "first.png")
    page.locator("#fl2va-last input[type=file]").set_input_files(ASSETS / "fl2va" / "last.png")
    expect(page.locator("#fl2va-first img")).to_have_attribute("src", FIRST_IMAGE)
    expect(page.locator("#fl2va-last img")).to_have_attribute("src", LAST_IMAGE)
    page.locator("#fl2va-swap").click()
    expect(page.locator("#fl2va-first img")).to_have_attribute("src", LAST_IMAGE)
    expect(page.locator("#fl2va-last img")).to_have_attribute("src", FIRST_IMAGE)
    page.locator("#fl2va-swap").click()
    expect(page.locator("#fl2va-first img")).to_have_attribute("src", FIRST_IMAGE)

    page.locator("#fl2va-prompt textarea").fill("The kite climbs as the sun comes up.")
    open_advanced(page, "fl2va")
    set_field(page, "#fl2va-steps input", "4")
    page.locator("#fl2va-generate").click()

    video = page.locator("#h3-video video")
    expect(video).to_have_attribute("src", re.compile(r"\.mp4"))
    expect(page.locator("#h3-status")).to_contain_text("Done")
    expect(page.locator("#h3-details")).to_contain_text("124 at 24 fps")
    facts = video.evaluate(
        """async (element) => {
            if (element.readyState < 1) {
                await new Promise((resolve) => element.addEventListener("loadedmetadata", resolve, { once: true }));
            }
            await element.play();
            await new Promise((resolve) => setTimeout(resolve, 1500));
            element.pause();
            return {
                duration: element.duration,
                currentTime: element.currentTime,
                audioBytes: element.webkitAudioDecodedByteCount,
                videoBytes: element.webkitVideoDecodedByteCount,
                canPlay: element.canPlayType('video/mp4; codecs="avc1.42E01E, mp4a.40.2"'),
            };
        }"""
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "app_browser.png"), full_page=True)
    assert facts["canPlay"] in ("probably", "maybe"), facts
    assert abs(facts["duration"] - 124 / 24) < 0.05, facts
    assert facts["currentTime"] > 0.2, facts  # it played
    assert facts["audioBytes"] > 0, facts  # and decoded an audio track
    assert facts["videoBytes"] > 0, facts

    # The result is in the history; clicking it restores its settings into its own tab.
    page.locator("#fl2va-prompt textarea").fill("Something else.")
    page.get_by_role("tab", name="Text").click()
    page.locator("#h3-history tbody tr").first.click()
    expect(page.get_by_role("tab", name="First / last frame")).to_have_attribute("aria-selected", "true")
    expect(page.locator("#fl2va-prompt textarea")).to_have_value("The kite climbs as the sun comes up.")
    expect(page.locator("#fl2va-steps input")).to_have_value("4")
