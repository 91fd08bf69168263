"""H3's sectioned prompt as data: the fields, how they compose into the prompt text and how a text parses back.

The layout follows the official request scripts: T2VA/FL2VA write `integrated_multimodal_description: [Shot 1] ...
[Shot 2] At 00:04.500, ...`, `overall_soundscape: ...`, `non_diegetic_music: ...`, a paragraph each; FL2VA opens
with `For the target video, at 0.00 seconds into the target video, <Picture 1> (from [Shot 1]) is fully
referenced.`; Ref2VA writes `subject_definitions:`, `summary:`, `retention_analysis:`, `detailed_description:` and
the sound sections with each key on its own line. A spoken line ends its shot as `Bolt (S1) says: <d>[English]
Hi!</d>`, (S1) numbering the distinct speakers in order.

Contract: `compose_prompt(fields)` is pure; empty fields leave their section out. For fields without markup of
their own, `parse_prompt(compose_prompt(f), f.task) == f.normalised()`. Other text is never reordered or lost:
where its parse would not compose back (up to whitespace), each description section stays whole in the
description, or else the whole text lands there. No gradio here: the panel that edits the fields is
ui.prompt_builder.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from h3engine.checkpoint.layout import TASKS

# The builder panel's rows; `fit_rows` fits fields to them.
SHOT_ROWS = 6
DIALOGUE_ROWS = 6
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
        shots = [Shot(_milliseconds(shot.start), one_paragraph(shot.text)) for shot in self.shots]
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
        description = one_paragraph(self.description)
        if shots:
            shots = [
                Shot(shot.start, _before_lines(shot.text, [x for x in lines if x.shot == number]))
                for number, shot in enumerate(shots, 1)
            ]
        else:
            description = _before_lines(description, lines)
        keyframes = tuple(
            Keyframe(one_paragraph(keyframe.label), round(max(0.0, finite_or_zero(keyframe.seconds)), 2))
            for keyframe in self.keyframes
        )
        ref2va = task == "ref2va"
        return PromptFields(
            task=task,
            description=description,
            shots=tuple(shots),
            dialogue=tuple(lines),
            soundscape=one_paragraph(self.soundscape),
            music=one_paragraph(self.music),
            keyframes=tuple(k for k in keyframes if k.label) if task == "fl2va" else (),
            subjects=_lines(self.subjects) if ref2va else "",
            summary=one_paragraph(self.summary) if ref2va else "",
            retention=_lines(self.retention) if ref2va else "",
        )


def finite_or_zero(value: Any) -> float:
    """`value` as a float; 0.0 where it is not a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _milliseconds(seconds: Any) -> float:
    return round(max(0.0, finite_or_zero(seconds)) * 1000) / 1000


def one_paragraph(text: Any) -> str:
    """The text with its whitespace (line breaks included) collapsed to single spaces."""
    return " ".join(str(text or "").split())


def _lines(text: Any) -> str:
    return "\n".join(line for line in (one_paragraph(raw) for raw in str(text or "").splitlines()) if line)


def _line_text(text: Any) -> str:
    return one_paragraph(re.sub(r"</?d>", " ", str(text or "")))


def _speaker(text: Any) -> str:
    return one_paragraph(_SPEAKER_DROPPED.sub("", str(text or "")))


def _language(text: Any) -> str:
    return one_paragraph(re.sub(r"[\[\]<>]", "", str(text or ""))) or "English"


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
    return PromptFields(task=task, description=one_paragraph(text)).normalised()


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
