"""Jobs as a person sees them in a browser (Playwright, Debian's chromium, the app on its random-weight default):
the status of the job just started, or why it did not start, is in view where Generate was pressed on every tab, at
1400 x 1000 and at phone width; a new job clears the result shown; every ending (done, cancelled) leaves its own
status; several takes appear side by side and each can be shown, restored and continued from; the demo's players
start muted; the small things (seed before any run, the preview's label, example titles, History's steps).
Screenshots go to test-artifacts/ (README's, with H3_UPDATE_SCREENSHOTS=1, to docs/screenshots/).
"""

from __future__ import annotations

import re

import pytest
from _app_helpers import ASSETS
from _browser_helpers import (
    DESKTOP,
    PHONE,
    browser_page,
    needs_chromium,
    open_advanced,
    screenshot,
    set_field,
    wait_for_video_frame,
    wait_in_view,
)

pytestmark = needs_chromium
TAB_NAMES = {"t2va": "Text", "fl2va": "First / last frame", "ref2va": "References"}
RUNNING = re.compile(r"Starting|Waiting|Generating|Denoising|Decoding")
SEED_COLUMN, STEPS_COLUMN = 4, 5  # in History's table (ui.history.HISTORY_HEADERS)


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


def _press_generate(page, task: str) -> None:
    """As a person does on a tall tab: scroll down to the button, press it."""
    button = page.locator(f"#{task}-generate")
    button.scroll_into_view_if_needed()
    button.click()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_a_refused_job_says_why_in_view_on_every_tab(app, viewport) -> None:
    from playwright.sync_api import expect

    width = "desktop" if viewport is DESKTOP else "phone"
    with browser_page(app.url, viewport) as page:
        for task, title in TAB_NAMES.items():
            page.get_by_role("tab", name=title).click()
            page.locator(f"#{task}-prompt textarea").fill("")
            _press_generate(page, task)
            expect(page.locator("#h3-status")).to_contain_text("Not started: prompt")
            wait_in_view(page, "#h3-status")
            screenshot(page, f"error-{task}-{width}", readme=task == "fl2va")


def test_a_new_job_clears_the_result_and_each_ending_states_itself(app) -> None:
    from playwright.sync_api import expect

    status = "#h3-status"
    with browser_page(app.url, DESKTOP) as page:
        screenshot(page, "idle-t2va-desktop", readme=True)
        page.get_by_role("tab", name=TAB_NAMES["fl2va"]).click()
        page.locator("#fl2va-first input[type=file]").set_input_files(ASSETS / "fl2va" / "first.png")
        page.locator("#fl2va-prompt textarea").fill("The kite climbs as the sun comes up.")
        open_advanced(page, "fl2va")
        set_field(page, "#fl2va-steps input", "4")
        _press_generate(page, "fl2va")
        expect(page.locator(status)).to_contain_text(RUNNING)
        wait_in_view(page, status)
        screenshot(page, "running-fl2va-desktop", readme=True)
        expect(page.locator(status)).to_contain_text("Done")
        expect(page.locator("#h3-video video")).to_have_attribute("src", re.compile(r"\.mp4"))
        wait_for_video_frame(page)
        screenshot(page, "done-fl2va-desktop", readme=True)

        # A long job: the result shown goes at once, and a cancel leaves its own status, which stays. 15 s of video
        # (the longest clip) keeps each step long enough that 1000 of them outlast a slow browser's clicks.
        set_field(page, "#fl2va-steps input", "1000")
        set_field(page, "#fl2va-duration input[type=number]", "15")
        for attempt in range(3):
            _press_generate(page, "fl2va")
            expect(page.locator("#h3-video video")).to_have_count(0)
            expect(page.locator(status)).not_to_contain_text("Done")
            expect(page.locator(status)).to_contain_text("Denoising: step")
            wait_in_view(page, status)
            page.locator("#h3-cancel").click()
            expect(page.locator(status)).to_contain_text(re.compile(r"Cancelled at step \d+ of 1000\."))
            ended = page.locator(status).inner_text()
            page.wait_for_timeout(2000)
            assert page.locator(status).inner_text() == ended, f"attempt {attempt}: the status changed after"
            expect(page.locator("#fl2va-generate")).to_be_enabled()


def test_takes_appear_side_by_side_and_each_can_be_kept(app) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, DESKTOP) as page:
        page.locator("#t2va-prompt textarea").fill("A red kite over green hills.")
        page.locator("#t2va-randomize input").uncheck()
        set_field(page, "#t2va-seed input", "41")
        set_field(page, "#t2va-takes input[type=number]", "3")
        open_advanced(page, "t2va")
        set_field(page, "#t2va-steps input", "2")
        _press_generate(page, "t2va")
        expect(page.locator("#h3-status")).to_contain_text(re.compile(r"Take \d of 3"))
        expect(page.locator("#h3-status")).to_contain_text("Done: 3 of 3 takes done")
        takes = page.locator("#h3-takes")
        for number, seed in enumerate((41, 42, 43), start=1):
            expect(takes).to_contain_text(f"Take {number} · seed {seed}")
        takes.scroll_into_view_if_needed()
        screenshot(page, "takes-t2va-desktop", readme=True)

        takes.get_by_text("Take 3 · seed 43").click()
        expect(page.locator("#h3-seed-used input")).to_have_value("43")
        expect(page.locator("#h3-status")).to_contain_text("Showing")
        rows = page.locator("#h3-history tbody tr", has_text="A red kite over green hills.")
        expect(rows).to_have_count(3)
        assert sorted(row.locator("td").nth(SEED_COLUMN).inner_text().strip() for row in rows.all()) == [
            "41",
            "42",
            "43",
        ]

        page.locator("#t2va-prompt textarea").fill("Something else.")
        page.locator("#h3-restore-result").click()
        expect(page.locator("#t2va-prompt textarea")).to_have_value("A red kite over green hills.")
        expect(page.locator("#t2va-seed input")).to_have_value("43")
        expect(page.locator("#t2va-randomize input")).not_to_be_checked()

        page.locator("#h3-continue-fl2va").click()
        expect(page.get_by_role("tab", name=TAB_NAMES["fl2va"])).to_have_attribute("aria-selected", "true")
        expect(page.locator("#fl2va-first img")).to_have_attribute("src", re.compile(r"last-frame\.png"))


def test_a_run_at_phone_width_shows_its_progress_and_result(app) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, PHONE) as page:
        screenshot(page, "idle-t2va-phone", readme=True)
        page.locator("#t2va-prompt textarea").fill("A red kite over green hills.")
        open_advanced(page, "t2va")
        set_field(page, "#t2va-steps input", "4")
        _press_generate(page, "t2va")
        expect(page.locator("#h3-status")).to_contain_text(RUNNING)
        wait_in_view(page, "#h3-status")
        screenshot(page, "running-t2va-phone", readme=True)
        expect(page.locator("#h3-status")).to_contain_text("Done")
        page.locator("#h3-video").scroll_into_view_if_needed()
        wait_for_video_frame(page)
        screenshot(page, "done-t2va-phone", readme=True)


def test_the_demo_is_muted_and_the_small_things_are_right(app) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, DESKTOP) as page:
        expect(page.locator("#h3-banner")).to_contain_text("sound are noise")
        expect(page.locator("#h3-seed-used")).to_be_hidden()  # no "0" before any run
        # The preview has no label of its own drawn over the picture (its caption sits above it).
        expect(page.locator("#h3-preview [data-testid=block-label]")).to_be_hidden()
        page.get_by_role("tab", name=TAB_NAMES["fl2va"]).click()
        # The keyframe pickers offer what is accepted (Gradio's own picker offers every image type).
        for box in ("#fl2va-first", "#fl2va-last"):
            expect(page.locator(f"{box} input[type=file]")).to_have_attribute(
                "accept", ".jpg,.jpeg,.png,.webp"
            )
        titles = page.locator("#fl2va-examples button")
        expect(titles).to_have_count(3)
        for cell in titles.all():
            cut = cell.evaluate("(element) => element.scrollWidth > element.clientWidth + 1")
            assert not cut, f"example title cut off: {cell.inner_text()!r}"

        page.get_by_role("tab", name=TAB_NAMES["t2va"]).click()
        page.locator("#t2va-prompt textarea").fill("Muted noise.")
        open_advanced(page, "t2va")
        set_field(page, "#t2va-steps input", "3")
        _press_generate(page, "t2va")
        expect(page.locator("#h3-status")).to_contain_text("Done")
        video = page.locator("#h3-video video")
        expect(video).to_have_attribute("src", re.compile(r"\.mp4"))
        # Muted as the file loads (its loadstart event), which comes after the src is set: waited for.
        expect(video).to_have_js_property("muted", True)
        expect(page.locator("#h3-seed-used")).to_be_visible()
        expect(page.locator("#h3-history")).to_contain_text("Steps")
        first_row = page.locator("#h3-history tbody tr").first
        expect(first_row).to_contain_text("Muted noise.")
        expect(first_row.locator("td").nth(STEPS_COLUMN)).to_have_text("3")
