"""The page's states as a person meets them (Playwright, Debian's headless chromium, `python app.py` on its tiny
random-weight default), each at 1400 px and at 390 px wide (issue 47):

* the buttons that act on a result (Restore its settings, Rerun, Continue from its last frame, FL2VA's "Use the last
  frame", Remix's "Use the shown result") are disabled on a fresh page, enabled once there is a result, disabled
  again on a page that starts without one, and enabled by a History row's restore;
* a failed event puts no input and no player in Gradio's error state (the red "Error" box that stays until dismissed
  and blocks typing): a result whose files went away, pressed Restore, Rerun (which then presses nothing), Continue,
  "Use the last frame" or its History row, is told in plain words in a toast, and the prompt still takes typing; a
  job refused because the results folder refuses writes says so in the status, and the player stays as it was;
* one toast at a time, the newest (no stack, no count), never drawn over the status line or Cancel, with the status
  at the top of the window or at its bottom;
* a typed duration outside 4-15 s stays as typed (Gradio's slider would clamp it to the range on blur), the canvas
  line and the status say so in plain words, and no job starts; so too after a restore has touched the other tabs'
  inputs (Gradio then preprocesses its session copies of them).

Skips, with the reason, only when /usr/bin/chromium is missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _app_helpers import refusing_writes
from _browser_helpers import (
    DESKTOP,
    PHONE,
    browser_page,
    needs_chromium,
    open_advanced,
    screenshot,
    set_field,
)

from ui.access import BROWSER_COOKIE, owner_folder

pytestmark = needs_chromium
VIEWPORTS = pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
RESULT_BUTTONS = ("#h3-restore-result", "#h3-rerun", "#h3-continue-fl2va")
# Every component Gradio has put in its error state shows this label in its status tracker.
ERROR_STATES = "[data-testid=status-tracker] span.error"
TOAST = "[data-testid=toast-body]"
TOAST_TEXT = "[data-testid=toast-text]"
GONE_SETTINGS = "The result shown is no longer in your history (its files were removed)"
GONE_VIDEO = "The result shown is no longer on the server (its video was removed)"
GONE_ROW = "That result is no longer in your history (its files were removed)"
OUT_OF_RANGE = "the duration must be from 4 to 15 seconds, and {typed} s was typed"
# The intersection of the visible toast with the status line and with Cancel (empty when clear of both).
TOAST_OVER_STATUS_JS = """() => {
    const toast = [...document.querySelectorAll("[data-testid=toast-body]")]
        .find((element) => element.getBoundingClientRect().height > 0);
    if (!toast) return "no toast";
    const box = toast.getBoundingClientRect();
    return ["#h3-status", "#h3-cancel"].filter((selector) => {
        const area = document.querySelector(selector).getBoundingClientRect();
        return box.left < area.right && area.left < box.right && box.top < area.bottom && area.top < box.bottom;
    });
}"""


@pytest.fixture(scope="module")
def app(shared_app):  # noqa: ANN001, ANN201 - the run's app of this test process (conftest.py)
    return shared_app


def _width(viewport: dict[str, int]) -> str:
    return "desktop" if viewport is DESKTOP else "phone"


def _generate(page, prompt: str) -> None:
    """A 2-step T2VA job, pressed as a person does, until it is done and listed in History."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Text").click()
    page.locator("#t2va-prompt textarea").fill(prompt)
    if not page.locator("#t2va-steps input").is_visible():
        open_advanced(page, "t2va")
    set_field(page, "#t2va-steps input", "2")
    button = page.locator("#t2va-generate")
    button.scroll_into_view_if_needed()
    button.click()
    expect(page.locator("#h3-history tbody tr", has_text=prompt)).to_have_count(1)
    expect(page.locator("#h3-status")).to_contain_text("Done")


def _own_results(app, page) -> Path:
    """This browser's results folder (ui.access: named by its h3-browser cookie)."""
    (browser,) = [cookie["value"] for cookie in page.context.cookies() if cookie["name"] == BROWSER_COOKIE]
    return app.outputs_dir / owner_folder(None, None, browser)


def _remove_results(folder: Path) -> None:
    """What a clean-up outside the app does: the results' MP4s and sidecars go."""
    removed = [path for path in folder.iterdir() if path.suffix in (".mp4", ".json")]
    assert removed, f"no result in {folder}"
    for path in removed:
        path.unlink()


def _visible_toast_texts(page) -> list[str]:
    return [text.inner_text() for text in page.locator(TOAST_TEXT).all() if text.is_visible()]


def _toast_came(page) -> None:
    """Until a toast shows, and a moment more: the event that sent it has ended (an error state comes with its end)."""
    from playwright.sync_api import expect

    expect(page.locator(TOAST).first).to_be_visible()
    page.wait_for_timeout(1500)


def _newest_toast_says(page, words: str) -> None:
    from playwright.sync_api import expect

    expect(page.locator(TOAST_TEXT).filter(visible=True).last).to_contain_text(words)


def _told_without_an_error_state(page, words: str, after: str) -> None:
    _toast_came(page)
    _no_error_state(page, after)
    _newest_toast_says(page, words)
    _no_error_state(page, after)


def _no_error_state(page, after: str) -> None:
    marked = page.evaluate(
        """(selector) => [...document.querySelectorAll(selector)]
            .map((label) => label.closest("[id]")?.id || label.closest(".block")?.className || "?")""",
        ERROR_STATES,
    )
    assert marked == [], f"after {after}, in Gradio's error state: {marked}"


def _open_remix(page) -> None:
    if not page.locator("#remix-use-result").is_visible():
        page.locator("#h3-remix").get_by_text("Remix a clip").click()
    page.locator("#remix-use-result").wait_for()


def _assert_result_buttons(page, enabled: bool, when: str) -> None:
    """The result column's buttons, FL2VA's and Remix's (their tab and section are opened to render them)."""
    from playwright.sync_api import expect

    def check(selector: str) -> None:
        button = page.locator(selector)
        try:
            (expect(button).to_be_enabled if enabled else expect(button).to_be_disabled)(timeout=10_000)
        except AssertionError:
            state = "enabled" if enabled else "disabled"
            raise AssertionError(f"{when}: {selector} is not {state}") from None

    for selector in RESULT_BUTTONS:
        check(selector)
    page.get_by_role("tab", name="First / last frame").click()
    check("#fl2va-use-last-frame")
    _open_remix(page)
    check("#remix-use-result")
    page.get_by_role("tab", name="Text").click()


@VIEWPORTS
def test_the_buttons_that_act_on_a_result_wait_for_one(app, viewport) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, viewport) as page:
        _assert_result_buttons(page, enabled=False, when="on a fresh page")
        screenshot(page, f"page-states-fresh-{_width(viewport)}")
        _generate(page, f"Buttons wait ({_width(viewport)}).")
        _assert_result_buttons(page, enabled=True, when="with a result")

        # The same browser again: History lists the result, but the page shows none until a row is restored.
        page.reload()
        page.locator("#h3-status").wait_for()
        row = page.locator("#h3-history tbody tr", has_text=f"Buttons wait ({_width(viewport)}).")
        expect(row).to_have_count(1)
        _assert_result_buttons(page, enabled=False, when="on a reloaded page before a restore")
        row.click()
        expect(page.locator("#h3-status")).to_contain_text("Showing")
        _assert_result_buttons(page, enabled=True, when="after a History row's restore")


@VIEWPORTS
def test_a_failed_event_puts_no_input_or_player_in_an_error_state(app, viewport) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, viewport) as page:
        prompt = f"Gone soon ({_width(viewport)})."
        _generate(page, prompt)
        results = _own_results(app, page)
        _remove_results(results)
        status = page.locator("#h3-status").inner_text()
        made = len(app.mp4_files())

        page.locator("#h3-restore-result").click()
        _told_without_an_error_state(page, GONE_SETTINGS, "Restore")
        page.locator("#h3-rerun").click()
        _told_without_an_error_state(page, GONE_SETTINGS, "Rerun")
        page.locator("#h3-continue-fl2va").click()
        _told_without_an_error_state(page, GONE_VIDEO, "Continue from its last frame")
        page.get_by_role("tab", name="First / last frame").click()
        page.locator("#fl2va-use-last-frame").click()
        _told_without_an_error_state(page, GONE_VIDEO, "Use the last frame")
        page.locator("#h3-history tbody tr", has_text=prompt).click()
        _told_without_an_error_state(page, GONE_ROW, "a History row's restore")
        screenshot(page, f"page-states-result-gone-{_width(viewport)}")

        # Nothing ran (Rerun pressed no Generate), nothing changed, and the inputs take typing.
        assert len(app.mp4_files()) == made
        expect(page.locator("#h3-status")).to_have_text(status)
        page.get_by_role("tab", name="Text").click()
        prompt_box = page.locator("#t2va-prompt textarea")
        prompt_box.click(timeout=5_000)  # a covering error box would take the click
        page.keyboard.type(" Still typing.")
        expect(prompt_box).to_have_value(f"{prompt} Still typing.")

        # A job the results folder refuses: the status says why; the player is not put in an error state.
        with refusing_writes(results):
            button = page.locator("#t2va-generate")
            button.scroll_into_view_if_needed()
            button.click()
            expect(page.locator("#h3-status")).to_contain_text(
                "⚠ Not started: the outputs folder refuses writes"
            )
            page.wait_for_timeout(1000)
            _no_error_state(page, "a refused job")
        expect(page.locator("#t2va-generate")).to_be_enabled()
        assert len(app.mp4_files()) == made

        # Remix's seconds out of range: refused in the status (Gradio's own bounds check failed the event before).
        _open_remix(page)
        page.locator("#remix-prompt textarea").fill("New sound.")
        seconds = page.locator("#remix-seconds input")
        seconds.fill("20")
        seconds.press("Tab")
        page.locator("#remix-generate").click()
        expect(page.locator("#h3-status")).to_contain_text("⚠ Not started")
        page.wait_for_timeout(1000)
        _no_error_state(page, "Remix with 20 s")
        assert len(app.mp4_files()) == made


@VIEWPORTS
def test_one_toast_at_a_time_never_over_the_status_or_cancel(app, viewport) -> None:
    with browser_page(app.url, viewport) as page:
        _generate(page, f"Toasts ({_width(viewport)}).")
        _remove_results(_own_results(app, page))

        page.locator("#h3-restore-result").click()
        _toast_came(page)
        page.locator("#h3-continue-fl2va").click()
        page.wait_for_timeout(2000)
        # The newest only: the one before is gone, with no list and no count of them.
        assert len(_visible_toast_texts(page)) == 1, _visible_toast_texts(page)
        _newest_toast_says(page, GONE_VIDEO)
        counts = [count for count in page.locator(".toast-count").all() if count.is_visible()]
        assert counts == [], [count.inner_text() for count in counts]
        assert page.evaluate(TOAST_OVER_STATUS_JS) == [], "the toast is drawn over the status line or Cancel"
        screenshot(page, f"page-states-toast-{_width(viewport)}")

        # The status line at the bottom of the window, then at its top (the page scrolled, nothing clicked there):
        # a new toast keeps clear of it each time.
        for block, words in (("end", GONE_SETTINGS), ("start", GONE_VIDEO)):
            page.locator("#h3-status").evaluate(f"(status) => status.scrollIntoView({{ block: '{block}' }})")
            page.wait_for_timeout(300)
            button = "#h3-restore-result" if words == GONE_SETTINGS else "#h3-continue-fl2va"
            page.locator(button).dispatch_event("click")  # a click that scrolls nothing
            _newest_toast_says(page, words)
            page.wait_for_timeout(500)  # its way in
            assert len(_visible_toast_texts(page)) == 1, _visible_toast_texts(page)
            over = page.evaluate(TOAST_OVER_STATUS_JS)
            assert over == [], f"status at the window's {block}: the toast is drawn over {over}"
            screenshot(page, f"page-states-toast-status-at-{block}-{_width(viewport)}")


def _type_duration(page, task: str, typed: str) -> None:
    field = page.locator(f"#{task}-duration input[type=number]")
    field.fill(typed)
    field.press("Tab")
    page.wait_for_timeout(500)


@VIEWPORTS
def test_a_typed_duration_out_of_range_is_kept_and_refused_in_plain_words(app, viewport) -> None:
    from playwright.sync_api import expect

    with browser_page(app.url, viewport) as page:
        made = len(app.mp4_files())
        page.locator("#t2va-prompt textarea").fill("A kite, for far too long.")
        for typed in ("20", "2"):
            _type_duration(page, "t2va", typed)
            field = page.locator("#t2va-duration input[type=number]")
            expect(field).to_have_value(typed, timeout=5_000)  # not clamped into 4-15
            words = OUT_OF_RANGE.format(typed=typed)
            expect(page.locator("#t2va-derived")).to_contain_text(words)
            button = page.locator("#t2va-generate")
            button.scroll_into_view_if_needed()
            button.click()
            expect(page.locator("#h3-status")).to_contain_text(f"⚠ Not started: {words}")
            page.wait_for_timeout(1000)
            expect(field).to_have_value(typed)
            expect(page.locator("#h3-status")).not_to_contain_text(re.compile("Starting|Done"))
            _no_error_state(page, f"Generate with {typed} s")
        screenshot(page, f"page-states-duration-{_width(viewport)}")
        assert len(app.mp4_files()) == made, "a job started"

        # After a restore, which hands the other tabs' inputs a skip (Gradio then preprocesses its copies of them).
        _type_duration(page, "t2va", "5")
        _generate(page, f"Duration kept ({_width(viewport)}).")
        page.locator("#h3-restore-result").click()
        expect(page.locator("#h3-status")).to_contain_text("Showing")
        page.get_by_role("tab", name="First / last frame").click()
        _type_duration(page, "fl2va", "16")
        expect(page.locator("#fl2va-duration input[type=number]")).to_have_value("16", timeout=5_000)
        expect(page.locator("#fl2va-derived")).to_contain_text(OUT_OF_RANGE.format(typed="16"))
        _no_error_state(page, "16 s typed after a restore")
