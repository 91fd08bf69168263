"""The prompt builder panel: the closed "Prompt builder" accordion under a task tab's prompt, which edits the
fields of H3's sectioned prompt (ui.prompt_sections) and writes the prompt box only on its Compose click.

Kept apart from the text side so the composition and parsing stay pure and testable without gradio; this module
holds the panel's components, the handlers that turn their values into fields and back, and the wiring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from ui.prompt_sections import (
    DIALOGUE_ROWS,
    SHOT_ROWS,
    DialogueLine,
    Keyframe,
    PromptFields,
    Shot,
    compose_prompt,
    finite_or_zero,
    fit_rows,
    one_paragraph,
    parse_prompt,
)

LANGUAGES = (
    "English", "Chinese", "Cantonese", "Japanese", "Korean", "Spanish", "French", "German", "Italian",
    "Portuguese", "Russian", "Arabic", "Hindi", "Indonesian", "Vietnamese", "Thai", "Turkish", "Dutch", "Polish",
)  # fmt: skip
KEYFRAME_ROWS = 2
SPEAKER_SUGGESTIONS = {
    "t2va": ("The man", "The woman", "The child", "The narrator"),
    "fl2va": ("The man", "The woman", "The child", "The narrator"),
    "ref2va": (
        "<Subject 1>",
        "<Subject 2>",
        "<Picture 1>",
        "<Picture 2>",
        "<Video 1>",
        "<Audio 1>",
        "<Audio 2>",
    ),
}


@dataclass
class ShotRow:
    start: gr.Number
    text: gr.Textbox


@dataclass
class DialogueRow:
    shot: gr.Dropdown
    speaker: gr.Dropdown
    language: gr.Dropdown
    text: gr.Textbox


@dataclass
class KeyframeRow:
    label: gr.Dropdown
    seconds: gr.Number


@dataclass
class PromptBuilderPanel:
    """The builder's components for one task tab; `inputs` lists them in the order the handlers take them."""

    task: str
    accordion: gr.Accordion
    description: gr.Textbox
    shots: list[ShotRow]
    dialogue: list[DialogueRow]
    soundscape: gr.Textbox
    music: gr.Textbox
    fill: gr.Button
    compose: gr.Button
    keyframes: list[KeyframeRow] = field(default_factory=list)  # FL2VA only
    subjects: gr.Textbox | None = None  # Ref2VA only, from here on
    summary: gr.Textbox | None = None
    retention: gr.Textbox | None = None

    def named(self) -> list[tuple[str, gr.components.Component]]:
        pairs: list[tuple[str, gr.components.Component]] = []
        for index, keyframe in enumerate(self.keyframes):
            pairs += [
                (f"keyframe.{index}.label", keyframe.label),
                (f"keyframe.{index}.seconds", keyframe.seconds),
            ]
        for name in ("subjects", "summary", "retention", "description"):
            if getattr(self, name) is not None:
                pairs.append((name, getattr(self, name)))
        for index, shot in enumerate(self.shots):
            pairs += [(f"shot.{index}.start", shot.start), (f"shot.{index}.text", shot.text)]
        for index, line in enumerate(self.dialogue):
            pairs += [
                (f"line.{index}.{part}", getattr(line, part))
                for part in ("shot", "speaker", "language", "text")
            ]
        return [*pairs, ("soundscape", self.soundscape), ("music", self.music)]

    @property
    def inputs(self) -> list[gr.components.Component]:
        return [component for _, component in self.named()]

    def fields_from_values(self, values: Sequence[Any]) -> PromptFields:
        """The fields the panel's values (in `inputs` order) hold."""
        value = dict(zip((name for name, _ in self.named()), values, strict=True))
        return PromptFields(
            task=self.task,
            description=value["description"] or "",
            shots=tuple(
                Shot(finite_or_zero(value[f"shot.{index}.start"]), value[f"shot.{index}.text"] or "")
                for index in range(len(self.shots))
            ),
            dialogue=tuple(
                DialogueLine(
                    value[f"line.{index}.text"] or "",
                    value[f"line.{index}.speaker"] or "",
                    value[f"line.{index}.language"] or "",
                    int(finite_or_zero(value[f"line.{index}.shot"]) or 1),
                )
                for index in range(len(self.dialogue))
            ),
            soundscape=value["soundscape"] or "",
            music=value["music"] or "",
            keyframes=tuple(
                Keyframe(
                    value[f"keyframe.{index}.label"] or "", finite_or_zero(value[f"keyframe.{index}.seconds"])
                )
                for index in range(len(self.keyframes))
            ),
            subjects=value.get("subjects") or "",
            summary=value.get("summary") or "",
            retention=value.get("retention") or "",
        )

    def compose_text(self, *values: Any) -> Any:
        """The "Compose into the prompt" handler: the composed text, or no change where every field is empty."""
        text = compose_prompt(self.fields_from_values(values))
        return text if text else gr.skip()

    def builder_values(self, prompt_text: str | None) -> dict[gr.components.Component, Any]:
        """Every builder component's value for a prompt (an example's, or the prompt box's)."""
        fields = parse_prompt(prompt_text or "", self.task)
        if len(fields.keyframes) > len(self.keyframes):
            fields = PromptFields(task=self.task, description=one_paragraph(prompt_text))
        fields = fit_rows(fields, len(self.shots), len(self.dialogue))
        value: dict[str, Any] = {
            "description": fields.description,
            "soundscape": fields.soundscape,
            "music": fields.music,
            "subjects": fields.subjects,
            "summary": fields.summary,
            "retention": fields.retention,
        }
        for index in range(len(self.keyframes)):
            keyframe = fields.keyframes[index] if index < len(fields.keyframes) else Keyframe("", 0.0)
            value.update(
                {f"keyframe.{index}.label": keyframe.label, f"keyframe.{index}.seconds": keyframe.seconds}
            )
        for index in range(len(self.shots)):
            shot = fields.shots[index] if index < len(fields.shots) else None
            start = shot.start if shot else (0.0 if index == 0 else None)
            value.update({f"shot.{index}.start": start, f"shot.{index}.text": shot.text if shot else ""})
        for index in range(len(self.dialogue)):
            line = fields.dialogue[index] if index < len(fields.dialogue) else DialogueLine("")
            parts = {"shot": line.shot, "speaker": line.speaker, "language": line.language, "text": line.text}
            value.update({f"line.{index}.{part}": part_value for part, part_value in parts.items()})
        return {component: value[name] for name, component in self.named()}


def _row_text(label: str, placeholder: str, index: int, **layout: Any) -> gr.Textbox:
    """A row's text box; only the first row shows its label (the rows below read as a table)."""
    return gr.Textbox(label=label, show_label=index == 0, placeholder=placeholder, lines=1, **layout)


def _shot_row(task: str, index: int) -> ShotRow:
    """A shot's start and text; only the first row shows the labels (the rows below read as a table)."""
    with gr.Row(equal_height=True):
        start = gr.Number(
            value=0.0 if index == 0 else None,
            minimum=0,
            label="Starts at (s)",
            show_label=index == 0,
            placeholder="seconds",
            interactive=index > 0,
            scale=1,
            min_width=100,
            elem_id=f"{task}-builder-shot-{index}-start",
        )
        text = _row_text(
            "Shots (the first starts at 0 s; a later one is a cut at its start time)",
            f"Shot {index + 1}",
            index,
            scale=5,
            elem_id=f"{task}-builder-shot-{index}",
        )
    return ShotRow(start, text)


def _typed_choice(
    choices: list[tuple[str, str]], value: str, label: str, show_label: bool, **layout: Any
) -> gr.Dropdown:
    """A dropdown that also takes a typed value."""
    return gr.Dropdown(
        choices=choices, value=value, allow_custom_value=True, label=label, show_label=show_label, **layout
    )


def _dialogue_row(task: str, index: int) -> DialogueRow:
    """A spoken line: the shot it ends, its speaker (free text or a label), language and text."""
    with gr.Row(equal_height=True):
        shot = gr.Dropdown(
            choices=[(f"Shot {number}", number) for number in range(1, SHOT_ROWS + 1)],
            value=1,
            label="Spoken in",
            show_label=index == 0,
            scale=1,
            min_width=100,
        )
        speaker = _typed_choice(
            [("none", ""), *((name, name) for name in SPEAKER_SUGGESTIONS[task])],
            "",
            "Speaker (type a name or pick a label)",
            index == 0,
            scale=2,
            min_width=130,
        )
        language = _typed_choice(
            [(name, name) for name in LANGUAGES], "English", "Language", index == 0, scale=1, min_width=110
        )
        text = _row_text(
            "Spoken lines, as <d>[Language] text</d>",
            f"Line {index + 1}",
            index,
            scale=4,
            elem_id=f"{task}-builder-line-{index}",
        )
    return DialogueRow(shot, speaker, language, text)


def build_prompt_builder(task: str) -> PromptBuilderPanel:
    """The closed "Prompt builder" accordion for `task`'s tab, made where it is called (under the prompt)."""
    with gr.Accordion("Prompt builder", open=False, elem_id=f"{task}-prompt-builder") as accordion:
        gr.Markdown(
            "H3 was trained on long prompts in sections. Fill what you need (empty fields leave their section "
            "out), then **Compose into the prompt**: the text lands in the prompt box for editing. "
            "Clicking an example fills the builder from its prompt.",
            elem_classes="h3-builder-help",
        )
        keyframes = []
        if task == "fl2va":
            with gr.Row():
                for index in range(KEYFRAME_ROWS):
                    label = gr.Dropdown(
                        choices=[
                            ("none", ""),
                            ("<Picture 1>", "<Picture 1>"),
                            ("<Picture 2>", "<Picture 2>"),
                        ],
                        value="",
                        allow_custom_value=True,
                        label=f"Keyframe {index + 1}: picture fully referenced",
                        info="<Picture 1> is the first frame given, <Picture 2> the last (with both)",
                        elem_id=f"{task}-builder-keyframe-{index}",
                    )
                    seconds = gr.Number(value=0.0, minimum=0, label="at (seconds)", min_width=100)
                    keyframes.append(KeyframeRow(label, seconds))
        sections = {}
        if task == "ref2va":
            sections["subjects"] = gr.Textbox(
                label="Subject definitions (one a line)",
                lines=2,
                placeholder="<Subject 1> is the robot in <Picture 1>.",
                elem_id=f"{task}-builder-subjects",
            )
            sections["summary"] = gr.Textbox(label="Summary", lines=1, elem_id=f"{task}-builder-summary")
            sections["retention"] = gr.Textbox(
                label="Retention analysis (one a line)", lines=1, elem_id=f"{task}-builder-retention"
            )
        description = gr.Textbox(
            label="Scene description (style, place, subjects: what comes before the shots)",
            lines=2,
            elem_id=f"{task}-builder-description",
        )
        with gr.Group():
            shots = [_shot_row(task, index) for index in range(SHOT_ROWS)]
        with gr.Group():
            dialogue = [_dialogue_row(task, index) for index in range(DIALOGUE_ROWS)]
        soundscape = gr.Textbox(label="Overall soundscape", lines=2, elem_id=f"{task}-builder-soundscape")
        music = gr.Textbox(label="Non-diegetic music", lines=1, elem_id=f"{task}-builder-music")
        with gr.Row():
            fill = gr.Button("Fill from the prompt", size="sm", elem_id=f"{task}-builder-fill")
            compose = gr.Button("Compose into the prompt", size="sm", elem_id=f"{task}-builder-compose")
    return PromptBuilderPanel(
        task, accordion, description, shots, dialogue, soundscape, music, fill, compose, keyframes, **sections
    )


def wire_prompt_builder(panel: PromptBuilderPanel, prompt_box: gr.Textbox) -> None:
    """Compose writes the prompt box (only on that click); Fill reads it into the builder. Both private."""
    panel.compose.click(
        panel.compose_text, inputs=panel.inputs, outputs=prompt_box, queue=False, api_visibility="private"
    )
    panel.fill.click(
        panel.builder_values, inputs=prompt_box, outputs=panel.inputs, queue=False, api_visibility="private"
    )
