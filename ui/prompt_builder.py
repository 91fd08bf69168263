"""The prompt builder: H3's sectioned prompt composed from fields, parsed back, and the panel that edits the fields.

The layout follows the official request scripts: T2VA/FL2VA write `integrated_multimodal_description: [Shot 1] ...
[Shot 2] At 00:04.500, ...`, `overall_soundscape: ...`, `non_diegetic_music: ...`, a paragraph each; FL2VA opens
with `For the target video, at 0.00 seconds into the target video, <Picture 1> (from [Shot 1]) is fully
referenced.`; Ref2VA writes `subject_definitions:`, `summary:`, `retention_analysis:`, `detailed_description:` and
the sound sections with each key on its own line. A spoken line ends its shot as `Bolt (S1) says: <d>[English]
Hi!</d>`, (S1) numbering the distinct speakers in order.

Contract: `compose_prompt(fields)` is pure; empty fields leave their section out. For fields without markup of
their own, `parse_prompt(compose_prompt(f), f.task) == f.normalised()`. Other text is never reordered or lost:
where its parse would not compose back (up to whitespace), each description section stays whole in the
description, or else the whole text lands there. The panel writes the prompt box only on its Compose click.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from h3engine.request.limits import TASKS

LANGUAGES = (
    "English", "Chinese", "Cantonese", "Japanese", "Korean", "Spanish", "French", "German", "Italian",
    "Portuguese", "Russian", "Arabic", "Hindi", "Indonesian", "Vietnamese", "Thai", "Turkish", "Dutch", "Polish",
)  # fmt: skip
SHOT_ROWS = 6
DIALOGUE_ROWS = 6
KEYFRAME_ROWS = 2
# Section keys in the order they are written, and the field each one holds ("scene": description, shots, dialogue).
SECTIONS = {
    "t2va": (
        ("integrated_multimodal_description", "scene"),
        ("overall_soundscape", "soundscape"),
        ("non_diegetic_music", "music"),
    ),
    "ref2va": (
        ("subject_definitions", "subjects"),
        ("summary", "summary"),
        ("retention_analysis", "retention"),
        ("detailed_description", "scene"),
        ("overall_soundscape", "soundscape"),
        ("non_diegetic_music", "music"),
    ),
}
SECTIONS["fl2va"] = SECTIONS["t2va"]
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

_KEYFRAME = re.compile(
    r"For the target video, at (\d+(?:\.\d+)?) seconds into the target video, (<[^<>]+>) "
    r"\(from \[Shot \d+\]\) is fully referenced\."
)
_SHOT_MARK = re.compile(r"\[Shot (\d+)\]")
_CUT = re.compile(r"At (\d+):(\d\d)\.(\d\d\d),(?:\s+|$)")
_DIALOGUE = re.compile(r"<d>\[([^\]<>]*)\] (.*?)</d>", re.S)
_SAYS = re.compile(r"\s*\(S\d+\)\s+says:\s*$")
# Where a sentence ends: a speaker's name starts after the last one (a speaker never holds these characters).
_SENTENCE_END = re.compile(r"[.!?…:;][\"'”’)]*\s+")
_ENDS_SENTENCE = re.compile(r"[.!?…:;][\"'”’)]*$")
_SPEAKER_DROPPED = re.compile(r"</?d>|[.!?…:;]")


@dataclass(frozen=True)
class Shot:
    start: float  # seconds into the clip; the first shot starts at 0 and its time is not written
    text: str


@dataclass(frozen=True)
class DialogueLine:
    text: str
    # Free text ("The child") or a reference label ("<Audio 2>"), without the characters that end a sentence
    # (.!?…:; are dropped from it); empty: no speaker named.
    speaker: str = ""
    language: str = "English"
    shot: int = 1  # the shot (1-based) whose end it is spoken at; without shots, the description's end


@dataclass(frozen=True)
class Keyframe:
    label: str  # "<Picture 1>"
    seconds: float


@dataclass(frozen=True)
class PromptFields:
    task: str = "t2va"
    description: str = ""  # the scene description, before the shots
    shots: tuple[Shot, ...] = ()
    dialogue: tuple[DialogueLine, ...] = ()
    soundscape: str = ""
    music: str = ""
    keyframes: tuple[Keyframe, ...] = ()  # FL2VA only
    subjects: str = ""  # Ref2VA only, from here on
    summary: str = ""
    retention: str = ""

    def normalised(self) -> PromptFields:
        """Whitespace collapsed (kept as line breaks in the one-a-line sections), empty shots and lines dropped,
        the first shot at 0 s, times to the millisecond, lines in shot order, a text followed by a named
        speaker ended as a sentence, and the fields the task does not take emptied."""
        task = self.task if self.task in TASKS else "t2va"
        lines = [
            DialogueLine(
                _line_text(line.text), _speaker(line.speaker), _language(line.language), int(line.shot)
            )
            for line in self.dialogue
        ]
        lines = [line for line in lines if line.text]
        shots = [Shot(_milliseconds(shot.start), _paragraph(shot.text)) for shot in self.shots]
        used = {line.shot for line in lines}
        kept = [number for number, shot in enumerate(shots, 1) if shot.text or number in used]
        renumbered = {old: new for new, old in enumerate(kept, 1)}
        shots = [shots[number - 1] for number in kept]
        if shots:
            shots[0] = Shot(0.0, shots[0].text)

        def shot_of(line: DialogueLine) -> int:
            if line.shot in renumbered:
                return renumbered[line.shot]
            return len(shots) if shots and line.shot > len(self.shots) else 1

        lines = sorted(
            (dataclasses.replace(line, shot=shot_of(line)) for line in lines), key=lambda x: x.shot
        )
        description = _paragraph(self.description)
        if shots:
            shots = [
                Shot(shot.start, _before_lines(shot.text, [x for x in lines if x.shot == number]))
                for number, shot in enumerate(shots, 1)
            ]
        else:
            description = _before_lines(description, lines)
        keyframes = tuple(
            Keyframe(_paragraph(keyframe.label), round(max(0.0, _finite(keyframe.seconds)), 2))
            for keyframe in self.keyframes
        )
        ref2va = task == "ref2va"
        return PromptFields(
            task=task,
            description=description,
            shots=tuple(shots),
            dialogue=tuple(lines),
            soundscape=_paragraph(self.soundscape),
            music=_paragraph(self.music),
            keyframes=tuple(k for k in keyframes if k.label) if task == "fl2va" else (),
            subjects=_lines(self.subjects) if ref2va else "",
            summary=_paragraph(self.summary) if ref2va else "",
            retention=_lines(self.retention) if ref2va else "",
        )


def _finite(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _milliseconds(seconds: Any) -> float:
    return round(max(0.0, _finite(seconds)) * 1000) / 1000


def _paragraph(text: Any) -> str:
    return " ".join(str(text or "").split())


def _lines(text: Any) -> str:
    return "\n".join(line for line in (_paragraph(raw) for raw in str(text or "").splitlines()) if line)


def _line_text(text: Any) -> str:
    return _paragraph(re.sub(r"</?d>", " ", str(text or "")))


def _speaker(text: Any) -> str:
    return _paragraph(_SPEAKER_DROPPED.sub("", str(text or "")))


def _language(text: Any) -> str:
    return _paragraph(re.sub(r"[\[\]<>]", "", str(text or ""))) or "English"


def _before_lines(text: str, lines: Sequence[DialogueLine]) -> str:
    """The text a shot's lines follow, ended as a sentence where parsing would otherwise not find its end."""
    if not text or not lines or _ENDS_SENTENCE.search(text):
        return text
    return f"{text}." if lines[0].speaker or text.endswith("</d>") else text


def format_cut_time(seconds: float) -> str:
    """`MM:SS.mmm`, as the official prompts write a cut ("At 00:04.500, ...")."""
    total = round(_milliseconds(seconds) * 1000)
    minutes, rest = divmod(total, 60_000)
    return f"{minutes:02d}:{rest // 1000:02d}.{rest % 1000:03d}"


def _speaker_numbers(lines: Sequence[DialogueLine]) -> dict[str, int]:
    numbers: dict[str, int] = {}
    for line in lines:
        if line.speaker and line.speaker not in numbers:
            numbers[line.speaker] = len(numbers) + 1
    return numbers


def _spoken(line: DialogueLine, numbers: dict[str, int]) -> str:
    spoken = f"<d>[{line.language}] {line.text}</d>"
    return f"{line.speaker} (S{numbers[line.speaker]}) says: {spoken}" if line.speaker else spoken


def _body(text: str, lines: Sequence[DialogueLine], numbers: dict[str, int]) -> str:
    return " ".join([*([text] if text else []), *(_spoken(line, numbers) for line in lines)])


def _shot_number_at(shots: Sequence[Shot], seconds: float) -> int:
    return max(1, sum(1 for shot in shots if shot.start <= seconds))


def _scene(fields: PromptFields) -> str:
    numbers = _speaker_numbers(fields.dialogue)
    if not fields.shots:
        return _body(fields.description, fields.dialogue, numbers)
    parts = [fields.description] if fields.description else []
    for number, shot in enumerate(fields.shots, 1):
        body = _body(shot.text, [line for line in fields.dialogue if line.shot == number], numbers)
        cut = f"At {format_cut_time(shot.start)}, " if number > 1 else ""
        parts.append(f"[Shot {number}] {cut}{body}".rstrip())
    return ("\n" if fields.task == "ref2va" else " ").join(parts)


def compose_prompt(fields: PromptFields) -> str:
    """The prompt text the fields make, in the task's official layout (see the module docstring)."""
    fields = fields.normalised()
    paragraphs = []
    if fields.keyframes:
        paragraphs.append(
            " ".join(
                f"For the target video, at {keyframe.seconds:.2f} seconds into the target video, {keyframe.label} "
                f"(from [Shot {_shot_number_at(fields.shots, keyframe.seconds)}]) is fully referenced."
                for keyframe in fields.keyframes
            )
        )
    for key, name in SECTIONS[fields.task]:
        value = _scene(fields) if name == "scene" else getattr(fields, name)
        if value:
            paragraphs.append(f"{key}:\n{value}" if fields.task == "ref2va" else f"{key}: {value}")
    return "\n\n".join(paragraphs)


def _speaker_and_text(region: str) -> tuple[str, str]:
    """(the speaker, the text before it) of what precedes a `<d>`: `... Bolt (S1) says: ` or just the text."""
    says = _SAYS.search(region)
    if not says:
        return "", region.rstrip()
    before = region[: says.start()]
    ends = list(_SENTENCE_END.finditer(before))
    cut = ends[-1].end() if ends else 0
    return before[cut:].strip(), before[:cut].rstrip()


def _parse_body(body: str) -> tuple[str, list[DialogueLine]]:
    """(the text, its spoken lines) of a shot's body: the lines are the `<d>` runs that end it, each preceded by
    nothing but its speaker; an earlier `<d>` stays in the text."""
    body = body.strip()
    matches = list(_DIALOGUE.finditer(body))
    if not matches or matches[-1].end() != len(body):
        return body, []
    lines: list[DialogueLine] = []
    for index in reversed(range(len(matches))):
        start = matches[index - 1].end() if index else 0
        speaker, text = _speaker_and_text(body[start : matches[index].start()])
        lines.insert(0, DialogueLine(matches[index].group(2), speaker, matches[index].group(1)))
        if index == 0 or text.strip():
            break
    return (body[:start] + text).strip(), lines


def _parse_scene(value: str, fields: dict[str, Any]) -> bool:
    """Fills description, shots and dialogue from a description section; False where its shots are not numbered
    1, 2, ... or a later shot has no cut time."""
    pieces = _SHOT_MARK.split(value)
    shots: list[Shot] = []
    lines: list[DialogueLine] = []
    for number, (mark, body) in enumerate(zip(pieces[1::2], pieces[2::2], strict=True), 1):
        start = 0.0
        if int(mark) != number:
            return False
        if number > 1:
            cut = _CUT.match(body.strip())
            if cut is None:
                return False
            minutes, seconds, millis = (int(group) for group in cut.groups())
            start, body = (minutes * 60_000 + seconds * 1000 + millis) / 1000, body.strip()[cut.end() :]
        text, shot_lines = _parse_body(body)
        shots.append(Shot(start, text))
        lines += [dataclasses.replace(line, shot=number) for line in shot_lines]
    if shots:
        fields["description"] = pieces[0]
    else:
        fields["description"], lines = _parse_body(pieces[0])
    fields["shots"], fields["dialogue"] = tuple(shots), tuple(lines)
    return True


def _parse_sections(text: str, task: str, scene_parts: bool) -> PromptFields | None:
    keys = dict(SECTIONS[task])
    heads = list(re.finditer(rf"^({'|'.join(keys)}):", text, re.M))
    if not heads:
        return None
    fields: dict[str, Any] = {}
    preamble = text[: heads[0].start()].strip()
    if preamble:
        sentences = list(_KEYFRAME.finditer(preamble))
        if task != "fl2va" or "".join(preamble.split()) != "".join(
            "".join(m.group(0) for m in sentences).split()
        ):
            return None
        fields["keyframes"] = tuple(Keyframe(match.group(2), float(match.group(1))) for match in sentences)
    for head, following in zip(heads, [*heads[1:], None], strict=True):
        name = keys[head.group(1)]
        value = text[head.end() : following.start() if following else len(text)].strip()
        if name == "scene" and scene_parts:
            if not _parse_scene(value, fields):
                return None
        else:
            fields["description" if name == "scene" else name] = value
    return PromptFields(task=task, **fields).normalised()


def parse_prompt(text: str, task: str = "t2va") -> PromptFields:
    """The fields of a prompt in the builder's layout for `task`; see the module docstring for any other text."""
    task, text = (task if task in TASKS else "t2va"), str(text or "")
    for scene_parts in (True, False):
        fields = _parse_sections(text, task, scene_parts)
        if fields is not None and compose_prompt(fields).split() == text.split():
            return fields
    return PromptFields(task=task, description=_paragraph(text)).normalised()


def fit_rows(
    fields: PromptFields, shot_rows: int = SHOT_ROWS, line_rows: int = DIALOGUE_ROWS
) -> PromptFields:
    """Fields with at most `shot_rows` shots and `line_rows` spoken lines that compose to the same text (up to
    whitespace): the lines of the last shots are written into their shot's text, then the shots past the last
    row into that row's text."""
    fields = fields.normalised()
    numbers = _speaker_numbers(fields.dialogue)
    shots, lines, description = list(fields.shots), list(fields.dialogue), fields.description

    def fold(number: int) -> None:
        nonlocal description
        spoken = [line for line in lines if line.shot == number]
        if shots:
            shots[number - 1] = Shot(shots[number - 1].start, _body(shots[number - 1].text, spoken, numbers))
        else:
            description = _body(description, spoken, numbers)
        lines[:] = [line for line in lines if line.shot != number]

    if len(shots) > shot_rows:
        for number in range(shot_rows, len(shots) + 1):
            fold(number)
        merged = [shots[shot_rows - 1].text]
        for number in range(shot_rows + 1, len(shots) + 1):
            merged.append(
                f"[Shot {number}] At {format_cut_time(shots[number - 1].start)}, {shots[number - 1].text}"
            )
        shots[shot_rows - 1 :] = [Shot(shots[shot_rows - 1].start, " ".join(merged))]
    while len(lines) > line_rows:
        fold(lines[-1].shot)
    return dataclasses.replace(fields, description=description, shots=tuple(shots), dialogue=tuple(lines))


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
                Shot(_finite(value[f"shot.{index}.start"]), value[f"shot.{index}.text"] or "")
                for index in range(len(self.shots))
            ),
            dialogue=tuple(
                DialogueLine(
                    value[f"line.{index}.text"] or "",
                    value[f"line.{index}.speaker"] or "",
                    value[f"line.{index}.language"] or "",
                    int(_finite(value[f"line.{index}.shot"]) or 1),
                )
                for index in range(len(self.dialogue))
            ),
            soundscape=value["soundscape"] or "",
            music=value["music"] or "",
            keyframes=tuple(
                Keyframe(value[f"keyframe.{index}.label"] or "", _finite(value[f"keyframe.{index}.seconds"]))
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
            fields = PromptFields(task=self.task, description=_paragraph(prompt_text))
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
