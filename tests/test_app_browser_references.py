"""The Ref2VA references gallery in chromium (headless, Playwright), at 1400 x 1000 and 390 x 844.

What it checks, as a person would see it: files dropped in two goes join the end of one ordered list of cards; each
card shows its labels (`<Picture i>`, a sounding video's `<Audio j>` and `<Video k>`, `<Audio j>`), a thumbnail of
the image and a poster frame of the video (an <img> that decoded: natural width > 0), a player and length for the
audio clip, and the file name; ↑ / ↓ reorder and the labels follow the new order; ✕ removes; "Insert <label>" puts
the label into the prompt; a file that does not decode shows one line naming it; an example fills the same list.
On the phone-sized window the cards stack and every button lies inside the window. Screenshots: test-artifacts/.

Skips, with the reason, only when /usr/bin/chromium is missing (.ci/run installs Debian's chromium).
"""

from __future__ import annotations

import pytest
from _app_helpers import ASSETS
from _browser_helpers import DESKTOP, PHONE, browser_page, needs_chromium, screenshot

pytestmark = needs_chromium
VIEWPORTS = {"desktop": DESKTOP, "phone": PHONE}
LABELS = "[id^=ref2va-card-][id$=-labels]"
NAMES = "[id^=ref2va-card-][id$=-name]"


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


@pytest.fixture(params=sorted(VIEWPORTS))
def page(app, request):
    with browser_page(app.url, VIEWPORTS[request.param]) as page:
        page.viewport_name = request.param
        yield page


def open_ref2va_tab(page) -> None:
    from playwright.sync_api import expect

    page.get_by_role("tab", name="References").click()
    expect(page.locator("#ref2va-add")).to_be_visible()


def _expect_cards(page, labels: list[str], names: list[str]) -> None:
    """The cards' label lines and name lines, in order (waits for the list to re-render after a change)."""
    from playwright.sync_api import expect

    expect(page.locator(LABELS)).to_have_text(labels, use_inner_text=True)
    expect(page.locator(NAMES)).to_have_text(names, use_inner_text=True)


def _wait_for_decoded_image(page, selector: str) -> int:
    """The natural width of the <img> under `selector`, once the browser has decoded it."""
    page.wait_for_function(
        "(selector) => { const image = document.querySelector(selector);"
        " return image !== null && image.complete && image.naturalWidth > 0; }",
        arg=f"{selector} img",
    )
    return page.locator(f"{selector} img").evaluate("(image) => image.naturalWidth")


def _assert_buttons_inside_the_window(page) -> None:
    width = page.viewport_size["width"]
    for button in page.locator("#ref2va-cards button").all():
        box = button.bounding_box()
        assert box is not None and box["width"] >= 20 and box["height"] >= 20, (button.inner_text(), box)
        assert box["x"] >= 0 and box["x"] + box["width"] <= width, (button.inner_text(), box)


def test_the_references_gallery(page, tmp_path) -> None:
    from playwright.sync_api import expect

    open_ref2va_tab(page)
    expect(page.locator("#ref2va-cards-empty")).to_contain_text("No references yet")
    drop = page.locator("#ref2va-add input[type=file]")
    drop.set_input_files([ASSETS / "ref2va" / "picture1.png", ASSETS / "ref2va" / "video1.mp4"])
    _expect_cards(page, ["1. <Picture 1>", "2. <Audio 1> <Video 1>"], ["picture1.png", "video1.mp4 · 3.0 s"])
    drop.set_input_files(ASSETS / "ref2va" / "audio1.wav")  # a second drop joins the end
    _expect_cards(
        page,
        ["1. <Picture 1>", "2. <Audio 1> <Video 1>", "3. <Audio 2>"],
        ["picture1.png", "video1.mp4 · 3.0 s", "audio1.wav · 3.0 s"],
    )
    # The image's thumbnail and the video's poster frame decoded; the audio clip has a player that knows its length.
    assert _wait_for_decoded_image(page, "#ref2va-card-0-thumbnail") > 0
    assert _wait_for_decoded_image(page, "#ref2va-card-1-thumbnail") > 0
    expect(page.locator("#ref2va-card-2-player")).to_be_visible()
    expect(page.locator("#ref2va-card-2-player #duration")).to_have_text("0:03")
    expect(page.locator("#ref2va-add input[type=file]")).to_have_count(
        1
    )  # the drop zone emptied for the next drop

    cards = [page.locator(f"#ref2va-card-{index}").bounding_box() for index in range(3)]
    if page.viewport_name == "phone":  # one card a row, each inside the window
        assert cards[0]["y"] + cards[0]["height"] <= cards[1]["y"] <= cards[2]["y"], cards
    else:  # side by side
        assert cards[0]["y"] == cards[1]["y"] == cards[2]["y"] and cards[0]["x"] < cards[1]["x"], cards
    _assert_buttons_inside_the_window(page)
    page.locator("#ref2va-cards").scroll_into_view_if_needed()
    screenshot(page, f"ref2va-gallery-{page.viewport_name}", readme=True)

    # Reorder: the video moves up, and the labels follow the new order.
    expect(page.locator("#ref2va-card-0-up")).to_be_disabled()
    page.locator("#ref2va-card-1-up").click()
    _expect_cards(
        page,
        ["1. <Audio 1> <Video 1>", "2. <Picture 1>", "3. <Audio 2>"],
        ["video1.mp4 · 3.0 s", "picture1.png", "audio1.wav · 3.0 s"],
    )
    page.locator("#ref2va-card-1-down").click()
    _expect_cards(
        page,
        ["1. <Audio 1> <Video 1>", "2. <Audio 2>", "3. <Picture 1>"],
        ["video1.mp4 · 3.0 s", "audio1.wav · 3.0 s", "picture1.png"],
    )
    expect(page.locator("#ref2va-card-2-down")).to_be_disabled()

    # Insert a label into the prompt.
    page.locator("#ref2va-prompt textarea").fill("The robot from")
    page.get_by_role("button", name="Insert <Picture 1>").click()
    expect(page.locator("#ref2va-prompt textarea")).to_have_value("The robot from <Picture 1>")
    page.get_by_role("button", name="Insert <Audio 2>").click()
    expect(page.locator("#ref2va-prompt textarea")).to_have_value("The robot from <Picture 1> <Audio 2>")

    # Remove the video: the audio clip becomes <Audio 1>.
    page.locator("#ref2va-card-0-remove").click()
    _expect_cards(page, ["1. <Audio 1>", "2. <Picture 1>"], ["audio1.wav · 3.0 s", "picture1.png"])

    # A file that does not decode shows its card with one line naming it, instead of a picture.
    broken = tmp_path / "broken clip.mp4"
    broken.write_bytes(b"not a video" * 100)
    drop.set_input_files(broken)
    _expect_cards(
        page,
        ["1. <Audio 1>", "2. <Picture 1>", "3. <Video 1>"],
        ["audio1.wav · 3.0 s", "picture1.png", "broken clip.mp4"],
    )
    expect(page.locator("#ref2va-card-2-error")).to_contain_text(
        "references: 'broken clip.mp4' does not open as a video clip"
    )
    expect(page.locator("#ref2va-card-2-thumbnail")).to_have_count(0)
    _assert_buttons_inside_the_window(page)
    screenshot(page, f"ref2va-gallery-{page.viewport_name}-edited", full_page=True)

    # An example fills the same ordered list (as restoring a result from History does): its cards replace these.
    page.locator("#ref2va-examples").get_by_text("all kinds").click()
    _expect_cards(
        page,
        ["1. <Picture 1>", "2. <Picture 2>", "3. <Audio 1> <Video 1>", "4. <Audio 2>"],
        ["picture1.png", "picture2.jpg", "video1.mp4 · 3.0 s", "audio1.wav · 3.0 s"],
    )
    assert _wait_for_decoded_image(page, "#ref2va-card-1-thumbnail") > 0
