"""Errors in a real browser (Playwright, Debian's headless chromium, `python app.py` on a tiny checkpoint).

What it checks, as a person would see it: a 0-byte PNG as FL2VA's first frame is refused at the First frame box in
one message that names the user's own file name ('empty.png', no temporary path), the frame and the formats
accepted; no error toast appears (Gradio's own image decoding used to fail first, once for the canvas line's
event and once for Generate, with temporary paths); a Ref2VA prompt citing `<Audio 1>` with only a picture is
refused at the prompt, naming the label and the labels the references define. Screenshots go to test-artifacts/.

Skips, with the reason, only when /usr/bin/chromium is missing (.ci/run installs Debian's chromium).
"""

from __future__ import annotations

import pytest
from _app_helpers import ASSETS
from _browser_helpers import browser_page, needs_chromium, screenshot

pytestmark = needs_chromium
TOASTS = "[data-testid=toast-body]"
EMPTY_FRAME = (
    "'empty.png' (first frame): the image file is empty; accepted: a JPEG, PNG or WEBP image "
    "(.jpg, .jpeg, .png, .webp)"
)


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


@pytest.fixture()
def page(app):
    with browser_page(app.url) as page:
        yield page


def test_a_broken_keyframe_is_one_message_at_its_box_naming_the_users_file(page, tmp_path) -> None:
    from playwright.sync_api import expect

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    page.get_by_role("tab", name="First / last frame").click()
    page.locator("#fl2va-first input[type=file]").set_input_files(empty)
    # The upload updates the canvas line, which now says what is wrong instead of failing in Gradio's decoder.
    expect(page.locator("#fl2va-derived")).to_contain_text(EMPTY_FRAME)
    page.locator("#fl2va-prompt textarea").fill("A kite.")
    page.locator("#fl2va-generate").click()
    expect(page.locator("#fl2va-first")).to_contain_text(EMPTY_FRAME)
    page.wait_for_timeout(2000)  # a toast would have arrived by now
    screenshot(page, "error-empty-frame-desktop")
    assert page.locator(TOASTS).count() == 0, page.locator(TOASTS).all_inner_texts()
    text = page.locator("body").inner_text()
    assert "preprocess" not in text and "/tmp" not in text and str(tmp_path) not in text
    # At the First frame box, in the canvas line and in the status (which says the job did not start).
    assert text.count("the image file is empty") == 3


def test_a_prompt_citing_a_label_no_reference_defines_is_refused_at_the_prompt(page) -> None:
    from playwright.sync_api import expect

    page.get_by_role("tab", name="References").click()
    page.locator("#ref2va-add input[type=file]").set_input_files([ASSETS / "ref2va" / "picture1.png"])
    expect(page.locator("#ref2va-card-0-name")).to_contain_text("picture1.png")
    page.locator("#ref2va-prompt textarea").fill(
        "The robot from <Picture 1> sings in the voice of <Audio 1>."
    )
    page.locator("#ref2va-generate").click()
    expect(page.locator("#ref2va-prompt")).to_contain_text(
        "cites <Audio 1>, which no input defines: the references define <Picture 1>"
    )
    screenshot(page, "error-undefined-label-desktop")
    assert page.locator(TOASTS).count() == 0
    expect(page.locator("#h3-status")).not_to_contain_text("Done")
