"""The prompt builder (ui/prompt_sections.py, ui/prompt_builder.py): composition, parsing, the round trip, the panel
and its events.

* Composition is checked section by section against the layouts of the official request scripts (our own texts).
* The round trip runs on seeded random field sets of every task: `parse(compose(f)) == f.normalised()`.
* Text that is not in the builder's layout lands whole in the description (so clicking any example fills it).
* The panel is built inside a `gr.Blocks`; its registered Compose and Fill handlers are called directly, and so is
  the whole app's example click (a UI built on a stand-in replica), which must fill the builder too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr
import pytest

from h3engine.checkpoint.facts import CheckpointFacts
from h3engine.checkpoint.layout import CanvasRules
from h3engine.runtime.front import EngineFront
from ui.prompt_builder import LANGUAGES, PromptBuilderPanel, build_prompt_builder, wire_prompt_builder
from ui.prompt_sections import (
    DialogueLine,
    Keyframe,
    PromptFields,
    Shot,
    compose_prompt,
    fit_rows,
    format_cut_time,
    parse_prompt,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = json.loads((REPO_ROOT / "assets" / "examples.json").read_text(encoding="utf-8"))["examples"]


def test_t2va_sections_come_in_the_official_order_one_paragraph_each() -> None:
    fields = PromptFields(
        task="t2va",
        music="A slow cello line.",
        soundscape="Rain on a tin roof.",
        shots=(Shot(0, "A lighthouse at dusk."), Shot(4.5, "the camera cuts to the keeper's lamp.")),
        description="Live-action, muted colours.",
    )
    assert compose_prompt(fields) == (
        "integrated_multimodal_description: Live-action, muted colours. [Shot 1] A lighthouse at dusk. "
        "[Shot 2] At 00:04.500, the camera cuts to the keeper's lamp.\n\n"
        "overall_soundscape: Rain on a tin roof.\n\n"
        "non_diegetic_music: A slow cello line."
    )


def test_fl2va_opens_with_the_keyframe_sentences_naming_the_shot_of_each_time() -> None:
    fields = PromptFields(
        task="fl2va",
        keyframes=(Keyframe("<Picture 1>", 0), Keyframe("<Picture 2>", 5.125)),
        shots=(Shot(0, "A door opens."), Shot(2, "A cat walks in.")),
    )
    assert compose_prompt(fields) == (
        "For the target video, at 0.00 seconds into the target video, <Picture 1> (from [Shot 1]) is fully "
        "referenced. For the target video, at 5.12 seconds into the target video, <Picture 2> (from [Shot 2]) is "
        "fully referenced.\n\n"
        "integrated_multimodal_description: [Shot 1] A door opens. [Shot 2] At 00:02.000, A cat walks in."
    )
    # Another task takes no keyframe sentence.
    assert compose_prompt(PromptFields(task="t2va", keyframes=fields.keyframes, description="x")) == (
        "integrated_multimodal_description: x"
    )


def test_ref2va_writes_each_key_on_its_own_line_and_its_own_sections() -> None:
    fields = PromptFields(
        task="ref2va",
        subjects="<Subject 1> is the fox in <Picture 1>.\n\n   <Audio 1> is its voice.  ",
        summary="[reference generation] The fox talks.",
        retention="<Subject 1>: fully_preserved - fur and ears.",
        description="The target video is a cartoon.",
        shots=(Shot(0, "The fox sits."), Shot(1.25, "Close-up.")),
        dialogue=(DialogueLine("Hello there.", "<Subject 1>", "English", 2),),
        soundscape="Birds.",
        music="N/A",
    )
    assert compose_prompt(fields) == (
        "subject_definitions:\n<Subject 1> is the fox in <Picture 1>.\n<Audio 1> is its voice.\n\n"
        "summary:\n[reference generation] The fox talks.\n\n"
        "retention_analysis:\n<Subject 1>: fully_preserved - fur and ears.\n\n"
        "detailed_description:\nThe target video is a cartoon.\n[Shot 1] The fox sits.\n"
        "[Shot 2] At 00:01.250, Close-up. <Subject 1> (S1) says: <d>[English] Hello there.</d>\n\n"
        "overall_soundscape:\nBirds.\n\n"
        "non_diegetic_music:\nN/A"
    )


def test_empty_fields_leave_their_sections_out() -> None:
    assert compose_prompt(PromptFields()) == ""
    assert compose_prompt(PromptFields(task="t2va", soundscape="  Wind. ")) == "overall_soundscape: Wind."
    assert (
        compose_prompt(PromptFields(task="ref2va", music="Harp.", subjects=" \n "))
        == "non_diegetic_music:\nHarp."
    )
    # An empty shot row (no text, no line spoken in it) is dropped; the next one becomes Shot 1, at 0 s.
    fields = PromptFields(task="t2va", shots=(Shot(0, " "), Shot(3, "A boat."), Shot(5, "")))
    assert compose_prompt(fields) == "integrated_multimodal_description: [Shot 1] A boat."


def test_dialogue_syntax_numbers_speakers_and_ends_the_sentence_before_a_named_speaker() -> None:
    fields = PromptFields(
        task="t2va",
        shots=(Shot(0, "Two friends at a table"),),
        dialogue=(
            DialogueLine("Ready?", "Mr. Lee", "English"),
            DialogueLine("Oui!", "<Audio 2>", "French"),
            DialogueLine("Go.", "Mr. Lee", "[Japanese]"),
            DialogueLine("   ", "Nobody", "English"),
            DialogueLine("Hush.", "", ""),
        ),
    )
    assert compose_prompt(fields) == (
        "integrated_multimodal_description: [Shot 1] Two friends at a table. "
        "Mr Lee (S1) says: <d>[English] Ready?</d> <Audio 2> (S2) says: <d>[French] Oui!</d> "
        "Mr Lee (S1) says: <d>[Japanese] Go.</d> <d>[English] Hush.</d>"
    )
    # Without shots the lines end the description; without a speaker, a line is its <d> alone.
    assert compose_prompt(
        PromptFields(description="A bell rings", dialogue=(DialogueLine("Ding", shot=3),))
    ) == ("integrated_multimodal_description: A bell rings <d>[English] Ding</d>")
    assert LANGUAGES[0] == "English"


def test_lines_follow_their_shots_whatever_order_they_were_given_in() -> None:
    fields = PromptFields(
        shots=(Shot(0, "One."), Shot(2, "Two.")),
        dialogue=(
            DialogueLine("b", "B", shot=2),
            DialogueLine("a", "A", shot=1),
            DialogueLine("c", "C", shot=9),
        ),
    )
    assert compose_prompt(fields) == (
        "integrated_multimodal_description: [Shot 1] One. A (S1) says: <d>[English] a</d> "
        "[Shot 2] At 00:02.000, Two. B (S2) says: <d>[English] b</d> C (S3) says: <d>[English] c</d>"
    )


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0, "00:00.000"),
        (4.5, "00:04.500"),
        (2.0004, "00:02.000"),
        (9.9996, "00:10.000"),
        (75.25, "01:15.250"),
    ],
)
def test_cut_times_are_minutes_seconds_and_milliseconds(seconds: float, written: str) -> None:
    assert format_cut_time(seconds) == written
    text = compose_prompt(PromptFields(shots=(Shot(0, "a"), Shot(seconds, "b"))))
    assert text == f"integrated_multimodal_description: [Shot 1] a [Shot 2] At {written}, b"
    assert parse_prompt(text).shots[1].start == pytest.approx(seconds, abs=5e-4)


WORDS = "the a fox red kite runs slowly over hills, bright sky; laughs near river <Picture 1> <Audio 2> café 夜".split()


def _words(rng: random.Random, most: int, least: int = 0) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(least, most)))
    return text + rng.choice(["", ".", "!", "?", ""]) if text else text


def _random_fields(rng: random.Random, task: str) -> PromptFields:
    shots = tuple(
        Shot(rng.randint(0, 20_000) / 1000, _words(rng, 12, least=rng.choice([0, 1])))
        for _ in range(rng.randint(0, 5))
    )
    dialogue = tuple(
        DialogueLine(
            _words(rng, 6, least=1),
            rng.choice(["", "The child", "<Subject 1>", "<Audio 2>", "Old Sam", "Mr. Fox"]),
            rng.choice([*LANGUAGES[:5], "Klingon", ""]),
            rng.randint(0, 6),
        )
        for _ in range(rng.randint(0, 4))
    )
    keyframes = tuple(
        Keyframe(rng.choice(["<Picture 1>", "<Picture 2>"]), rng.randint(0, 800) / 100)
        for _ in range(rng.randint(0, 2))
    )
    lines = "\n".join(_words(rng, 8) for _ in range(rng.randint(0, 3)))
    return PromptFields(
        task=task,
        description=_words(rng, 10) if rng.random() < 0.6 else "",
        shots=shots,
        dialogue=dialogue,
        soundscape=_words(rng, 10),
        music=_words(rng, 6),
        keyframes=keyframes,
        subjects=lines,
        summary=_words(rng, 8),
        retention=lines[::-1],
    )


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_parse_inverts_compose_on_random_field_sets(task: str) -> None:
    rng = random.Random(f"prompt-builder-{task}")
    for _ in range(400):
        fields = _random_fields(rng, task)
        text = compose_prompt(fields)
        assert parse_prompt(text, task) == fields.normalised(), text
        assert compose_prompt(parse_prompt(text, task)) == text
        assert fields.normalised().normalised() == fields.normalised()


def test_text_in_the_official_layouts_parses_into_its_sections() -> None:
    # Our own words in the official scripts' layouts (T2VA: sections on single line breaks; Ref2VA: lines
    # spoken in the middle of a shot, which stay in the shot's text).
    t2va = (
        "integrated_multimodal_description: [Shot 1] A tram crosses a bridge. [Shot 2] At 00:03.250, the camera "
        "cuts to a passenger.\noverall_soundscape: Rails clatter.\nnon_diegetic_music: Soft jazz."
    )
    fields = parse_prompt(t2va, "t2va")
    assert fields.shots == (
        Shot(0.0, "A tram crosses a bridge."),
        Shot(3.25, "the camera cuts to a passenger."),
    )
    assert (fields.soundscape, fields.music, fields.description) == ("Rails clatter.", "Soft jazz.", "")
    ref2va = (
        "subject_definitions:\n<Subject 1> is the girl in <Picture 1>.\n\ndetailed_description:\nA cartoon.\n"
        "[Shot 1] <Subject 1> (S1) says, <d>[English] Hi.</d> Then she waves.\n\noverall_soundscape:\nWind."
    )
    fields = parse_prompt(ref2va, "ref2va")
    assert fields.subjects == "<Subject 1> is the girl in <Picture 1>."
    assert fields.description == "A cartoon."
    assert fields.shots == (Shot(0.0, "<Subject 1> (S1) says, <d>[English] Hi.</d> Then she waves."),)
    assert fields.dialogue == ()
    assert compose_prompt(fields) == ref2va


@pytest.mark.parametrize(
    "text",
    [
        "A red kite over green hills. The child shouts <d>[English] Look!</d>",
        "Line one.\n\nLine two with [Shot 3] inside.",
        "overall_soundscape is not a key here: it is mid-text",
        "For the target video, at 0.00 seconds into the target video, <Picture 1> (from [Shot 1]) is fully referenced.",
    ],
)
def test_free_text_lands_whole_in_the_description(text: str) -> None:
    fields = parse_prompt(text, "t2va")
    assert fields == PromptFields(task="t2va", description=" ".join(text.split()))


def test_sections_that_do_not_compose_back_keep_their_text_in_the_description() -> None:
    # Speaker numbers the builder would not write (S2 first): the section parses, its shots and lines do not.
    text = "integrated_multimodal_description: [Shot 1] Hi. Ann (S2) says: <d>[English] Yo</d>\n\noverall_soundscape: Hum."
    fields = parse_prompt(text, "t2va")
    assert fields.description == "[Shot 1] Hi. Ann (S2) says: <d>[English] Yo</d>"
    assert (fields.shots, fields.dialogue, fields.soundscape) == ((), (), "Hum.")
    # A shot out of sequence stays in the description section's text too.
    fields = parse_prompt("integrated_multimodal_description: [Shot 2] z", "t2va")
    assert (fields.description, fields.shots) == ("[Shot 2] z", ())
    # A Ref2VA layout given to the T2VA builder lands whole in the description.
    other = "subject_definitions:\nx\n\nsummary:\ny"
    assert parse_prompt(other, "t2va") == PromptFields(task="t2va", description=" ".join(other.split()))


@pytest.mark.parametrize("example", EXAMPLES, ids=[example["name"] for example in EXAMPLES])
def test_every_example_prompt_round_trips_through_the_builder(example: dict[str, Any]) -> None:
    prompt, task = example["request"]["prompt"], example["request"]["task"]
    fields = parse_prompt(prompt, task)
    assert compose_prompt(fields) == prompt
    # Structured: shots parsed out of the description section, not left whole in it.
    assert fields.shots and not fields.description


def test_rows_that_do_not_fit_are_written_into_the_last_row_and_compose_the_same() -> None:
    shots = tuple(Shot(number, f"shot {number}.") for number in range(9))
    lines = tuple(DialogueLine(f"line {n}", f"Speaker {n % 3}", shot=n + 1) for n in range(9))
    fields = PromptFields(task="ref2va", shots=shots, dialogue=lines)
    fitted = fit_rows(fields, 6, 4)
    assert len(fitted.shots) == 6 and len(fitted.dialogue) == 4
    assert compose_prompt(fitted).split() == compose_prompt(fields).split()


def _panel(task: str) -> tuple[gr.Blocks, PromptBuilderPanel, gr.Textbox]:
    with gr.Blocks() as demo:
        prompt = gr.Textbox()
        panel = build_prompt_builder(task)
        wire_prompt_builder(panel, prompt)
    return demo, panel, prompt


def _handler(demo: gr.Blocks, trigger: gr.components.Component) -> Any:
    (function,) = [fn for fn in demo.fns.values() if (trigger._id, "click") in fn.targets]
    assert function.api_visibility == "private" and not function.queue
    return function.fn


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_the_panel_builds_closed_and_its_compose_click_writes_the_composed_text(task: str) -> None:
    demo, panel, prompt = _panel(task)
    assert panel.accordion.label == "Prompt builder" and panel.accordion.open is False
    assert (panel.subjects is not None) == (task == "ref2va") and bool(panel.keyframes) == (task == "fl2va")
    values = {component: component.value for component in panel.inputs}
    values[panel.shots[0].text] = "A lantern glows."
    values[panel.shots[1].start], values[panel.shots[1].text] = 2.5, "It flickers out"
    line = panel.dialogue[0]
    values[line.shot], values[line.speaker], values[line.language], values[line.text] = (
        2,
        "The girl",
        "Korean",
        "Oh",
    )
    values[panel.soundscape] = "Crickets."
    if task == "fl2va":
        values[panel.keyframes[0].label] = "<Picture 1>"
    compose = _handler(demo, panel.compose)
    text = compose(*(values[component] for component in panel.inputs))
    expected = PromptFields(
        task=task,
        shots=(Shot(0, "A lantern glows."), Shot(2.5, "It flickers out")),
        dialogue=(DialogueLine("Oh", "The girl", "Korean", 2),),
        soundscape="Crickets.",
        keyframes=(Keyframe("<Picture 1>", 0),),
    )
    assert text == compose_prompt(expected)
    assert "[Shot 2] At 00:02.500, It flickers out. The girl (S1) says: <d>[Korean] Oh</d>" in text
    # All fields empty: the prompt box is left as it is.
    assert compose(*(component.value for component in panel.inputs)) == gr.skip()


@pytest.mark.parametrize("example", EXAMPLES, ids=[example["name"] for example in EXAMPLES])
def test_fill_from_a_prompt_sets_the_values_that_compose_it_again(example: dict[str, Any]) -> None:
    task = example["request"]["task"]
    demo, panel, prompt = _panel(task)
    updates = _handler(demo, panel.fill)(example["request"]["prompt"])
    assert set(updates) == set(panel.inputs)
    assert (
        panel.compose_text(*(updates[component] for component in panel.inputs))
        == example["request"]["prompt"]
    )


class StandInReplica:
    """Enough of a replica to build the whole UI (no job is ever run)."""

    facts = CheckpointFacts(
        tasks=("t2va", "fl2va", "ref2va"), canvas=CanvasRules(), vae_spatial_ratio=16, patch=2
    )

    def run(self, handle: Any, replica_index: int, preview_every: int) -> Any:
        raise AssertionError("no job runs in this test")

    def close(self) -> None:
        pass


def test_clicking_an_example_in_the_app_fills_each_tab_builder(tmp_path: Path) -> None:
    from ui.blocks import UiOptions, build_ui

    front = EngineFront([StandInReplica()], tmp_path / "outputs")
    try:
        options = UiOptions(
            tmp_path / "outputs", REPO_ROOT / "assets" / "examples.json", REPO_ROOT, "stand-in"
        )
        demo = build_ui(front, options)
    finally:
        front.shutdown()
    for task in ("t2va", "fl2va", "ref2va"):
        dataset = next(block for block in demo.blocks.values() if block.elem_id == f"{task}-examples")
        (click,) = [fn for fn in demo.fns.values() if (dataset._id, "click") in fn.targets]
        builder = next(block for block in demo.blocks.values() if block.elem_id == f"{task}-builder-shot-0")
        compose = next(block for block in demo.blocks.values() if block.elem_id == f"{task}-builder-compose")
        assert any((compose._id, "click") in fn.targets for fn in demo.fns.values())
        example = next(example for example in EXAMPLES if example["request"]["task"] == task)
        updates = click.fn(0)
        assert updates[builder] == parse_prompt(example["request"]["prompt"], task).shots[0].text != ""


def test_restoring_a_result_fills_its_tab_builder(tmp_path: Path) -> None:
    """A History row puts the result's prompt in its tab and in that tab's builder."""
    from ui.access import owner_folder
    from ui.blocks import UiOptions, build_ui

    outputs = tmp_path / "outputs"
    front = EngineFront([StandInReplica()], outputs)
    try:
        demo = build_ui(
            front, UiOptions(outputs, REPO_ROOT / "assets" / "examples.json", REPO_ROOT, "stand-in")
        )
    finally:
        front.shutdown()
    example = next(example for example in EXAMPLES if example["request"]["task"] == "t2va")
    caller = SimpleNamespace(username=None, session_hash="session-1")
    results = outputs / owner_folder(None, "session-1")
    results.mkdir(parents=True)
    (results / "t2va-1.mp4").write_bytes(b"\0")
    (results / "t2va-1.json").write_text(json.dumps({"request": example["request"], "seed": 1}))
    history = next(block for block in demo.blocks.values() if block.elem_id == "h3-history")
    (click,) = [fn for fn in demo.fns.values() if (history._id, "click") in fn.targets]
    builder = next(block for block in demo.blocks.values() if block.elem_id == "t2va-builder-shot-0")
    updates = click.fn(["t2va-1"], caller)
    assert updates[builder] == parse_prompt(example["request"]["prompt"], "t2va").shots[0].text != ""


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium")
def test_the_panel_in_a_browser_composes_into_the_prompt_and_fills_from_it() -> None:
    from playwright.sync_api import expect, sync_playwright

    with gr.Blocks() as demo:
        prompt = gr.Textbox(label="Prompt", elem_id="fl2va-prompt")
        panel = build_prompt_builder("fl2va")
        wire_prompt_builder(panel, prompt)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        expect.set_options(timeout=30_000)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.locator("#fl2va-prompt-builder").get_by_text("Prompt builder").click()
            page.locator("#fl2va-builder-keyframe-0 input").click()
            page.get_by_role("option", name="<Picture 1>").click()
            page.locator("#fl2va-builder-shot-0 textarea").fill("A lantern glows.")
            page.locator("#fl2va-builder-shot-1-start input").fill("2.5")
            page.locator("#fl2va-builder-shot-1 textarea").fill("It flickers out.")
            page.locator("#fl2va-builder-line-0 textarea").fill("Oh no")
            page.locator("#fl2va-builder-soundscape textarea").fill("Crickets.")
            # Untouched by the builder until the click.
            expect(page.locator("#fl2va-prompt textarea")).to_have_value("")
            page.locator("#fl2va-builder-compose").click()
            expect(page.locator("#fl2va-prompt textarea")).to_have_value(
                "For the target video, at 0.00 seconds into the target video, <Picture 1> (from [Shot 1]) is fully "
                "referenced.\n\nintegrated_multimodal_description: [Shot 1] A lantern glows. <d>[English] Oh no</d> "
                "[Shot 2] At 00:02.500, It flickers out.\n\noverall_soundscape: Crickets."
            )
            page.screenshot(path=str(_artifacts() / "prompt_builder_fl2va.png"), full_page=True)
            page.locator("#fl2va-prompt textarea").fill(
                "integrated_multimodal_description: [Shot 1] A tram. [Shot 2] At 00:01.000, A bell. "
                "The driver (S1) says: <d>[German] Halt!</d>\n\nnon_diegetic_music: Jazz."
            )
            page.locator("#fl2va-builder-fill").click()
            expect(page.locator("#fl2va-builder-shot-1 textarea")).to_have_value("A bell.")
            expect(page.locator("#fl2va-builder-line-0 textarea")).to_have_value("Halt!")
            expect(page.locator("#fl2va-builder-music textarea")).to_have_value("Jazz.")
            expect(page.locator("#fl2va-builder-soundscape textarea")).to_have_value("")
            browser.close()
    finally:
        demo.close()


def _artifacts() -> Path:
    folder = REPO_ROOT / "test-artifacts"
    folder.mkdir(exist_ok=True)
    return folder
