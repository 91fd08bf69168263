"""The three task tabs: each one builds only the inputs its task takes, plus the settings every task shares.

Contract: `build_t2va_tab`, `build_fl2va_tab`, `build_ref2va_tab` are called inside a `gr.Tabs` and return a
`TaskTab` holding their components; `TaskTab.inputs` is the ordered input list of the task's generate endpoint,
matching the parameters of the handler for that task (prompt, the task's media, then `SettingsControls.inputs`).
Nothing here attaches events (ui.blocks wires them), so the layout can be read on its own.

The prompt and the settings are "as sent" and the file inputs "as uploaded" (ui.components): the handlers and their
validators get what the client sent, so that the request's own checks name the field and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from h3engine.engine.lora.library import LoraLibrary
from h3engine.request.geometry import PRESET_ASPECT_RATIOS
from h3engine.request.limits import MAX_DURATION_SECONDS, MIN_DURATION_SECONDS
from h3engine.request.model import CACHE_PRESETS, VERIFIED_SHORT_EDGE
from ui.components import as_sent, as_uploaded
from ui.loras import LoraPanel, build_lora_panel
from ui.prompt_builder import PromptBuilderPanel, build_prompt_builder
from ui.references import ReferenceGallery, build_reference_gallery
from ui.takes import MAX_TAKES

# Every endpoint parameter's default, by name (the components start with these values).
DEFAULT_VALUES = {
    "prompt": "",
    "first_image": None,
    "last_image": None,
    "references": [],
    "duration_from_reference": False,
    "duration_seconds": 5.0,
    "aspect_ratio": "auto",
    "seed": 0,
    "randomize_seed": True,
    "steps": 50,
    "flow_shift": 12.0,
    "audio_flow_shift": 3.0,
    # None: the checkpoint's own canvas rule. The field cannot be empty in a browser (Gradio shows and sends 0), so a
    # tab starts at that rule's own short edge (ui.blocks), which resolves to the same canvas.
    "short_edge": None,
    "takes": 1,
    "rungs": "",
    "loras": [],
    "cache": "off",
}
# The step-cache presets as the Advanced section names them (h3engine.engine.sampling.step_cache.PRESETS).
CACHE_LABELS = {
    "off": "off (every block of every step)",
    "high": "high (the peers' conservative setting)",
    "fast": "fast (more aggressive)",
}
AUTO_ASPECT_LABELS = {
    "t2va": "auto (16:9)",
    "fl2va": "auto (follow the image)",
    "ref2va": "auto (16:9)",
}
# A task endpoint's parameters (ui.task_values.parameter_names): the prompt, the task's media, then the settings.
SETTINGS_PARAMETERS = (
    "duration_seconds",
    "aspect_ratio",
    "seed",
    "randomize_seed",
    "steps",
    "flow_shift",
    "audio_flow_shift",
    "short_edge",
    "takes",
    "rungs",
    "loras",
    "cache",
)
MEDIA_PARAMETERS = {
    "t2va": (),
    "fl2va": ("first_image", "last_image"),
    "ref2va": ("references", "duration_from_reference"),
}
PROMPT_PLACEHOLDERS = {
    "t2va": "Describe the shot, the motion and the sound. Spoken lines: <d>[English] Hello!</d>",
    "fl2va": "Describe what happens between the first and the last frame, and what it sounds like.",
    "ref2va": "Cite the references by their labels, e.g. The robot from <Picture 1> speaks in the voice of <Audio 1>.",
}


@dataclass
class SettingsControls:
    duration_seconds: gr.Slider
    aspect_ratio: gr.Dropdown
    derived: gr.Markdown
    seed: gr.Number
    randomize_seed: gr.Checkbox
    steps: gr.Number
    flow_shift: gr.Number
    audio_flow_shift: gr.Number
    short_edge: gr.Number
    takes: gr.Slider
    rungs: gr.Textbox
    cache: gr.Dropdown
    lora_panel: LoraPanel

    @property
    def loras(self) -> gr.JSON:
        return self.lora_panel.loras

    @property
    def inputs(self) -> list[gr.components.Component]:
        return [getattr(self, name) for name in SETTINGS_PARAMETERS]

    @property
    def canvas_inputs(self) -> list[gr.components.Component]:
        """The settings the derived canvas and frame count depend on."""
        return [self.duration_seconds, self.aspect_ratio, self.short_edge]


@dataclass
class TaskTab:
    task: str
    prompt: gr.Textbox
    settings: SettingsControls
    generate: gr.Button
    examples: gr.Dataset | None
    # FL2VA only
    first_image: gr.Image | None = None
    last_image: gr.Image | None = None
    swap: gr.Button | None = None
    use_last_frame: gr.Button | None = None
    # Ref2VA only
    references: gr.File | None = None  # hidden: the ordered list (the gallery's drop zone adds to it)
    duration_from_reference: gr.Checkbox | None = None
    reference_gallery: ReferenceGallery | None = None
    # The closed "Prompt builder" accordion right under the prompt (ui.prompt_builder).
    prompt_builder: PromptBuilderPanel | None = None

    @property
    def media(self) -> list[gr.components.Component]:
        """The task's media inputs, in the order of its endpoint's parameters."""
        return [getattr(self, name) for name in MEDIA_PARAMETERS[self.task]]

    @property
    def inputs(self) -> list[gr.components.Component]:
        return [self.prompt, *self.media, *self.settings.inputs]


def _settings_controls(
    task: str, derived_text: str, library: LoraLibrary, steps: int, short_edge: int
) -> SettingsControls:
    duration, aspect_ratio = _canvas_controls(task)
    derived = gr.Markdown(derived_text, elem_classes="h3-derived", elem_id=f"{task}-derived")
    seed, randomize_seed, takes = _seed_controls(task)
    lora_panel = build_lora_panel(task, library)
    with gr.Accordion("Advanced", open=False, elem_id=f"{task}-advanced"):
        steps, short_edge, flow_shift, audio_flow_shift = _schedule_controls(task, steps, short_edge)
        rungs, cache = _step_controls(task)
    return SettingsControls(
        duration,
        aspect_ratio,
        derived,
        seed,
        randomize_seed,
        steps,
        flow_shift,
        audio_flow_shift,
        short_edge,
        takes,
        rungs,
        cache,
        lora_panel,
    )


def _canvas_controls(task: str) -> tuple[gr.Slider, gr.Dropdown]:
    """The duration and aspect ratio, side by side."""
    with gr.Row():
        duration = as_sent(
            gr.Slider(
                MIN_DURATION_SECONDS,
                MAX_DURATION_SECONDS,
                value=DEFAULT_VALUES["duration_seconds"],
                step=0.5,
                label="Duration (seconds)",
                elem_id=f"{task}-duration",
                # Its number box keeps what was typed: no silent clamping (ui.theme).
                elem_classes="h3-typed",
            )
        )
        aspect_ratio = as_sent(
            gr.Dropdown(
                choices=[(AUTO_ASPECT_LABELS[task], "auto"), *PRESET_ASPECT_RATIOS],
                value=DEFAULT_VALUES["aspect_ratio"],
                label="Aspect ratio",
                elem_id=f"{task}-aspect",
            )
        )
    return duration, aspect_ratio


def _seed_controls(task: str) -> tuple[gr.Number, gr.Checkbox, gr.Slider]:
    """The seed, whether to draw one, and the takes (jobs with consecutive seeds), in one row."""
    with gr.Row():
        seed = as_sent(
            gr.Number(value=DEFAULT_VALUES["seed"], precision=0, label="Seed", elem_id=f"{task}-seed")
        )
        randomize_seed = as_sent(
            gr.Checkbox(
                value=DEFAULT_VALUES["randomize_seed"], label="Random seed", elem_id=f"{task}-randomize"
            )
        )
        takes = as_sent(
            gr.Slider(
                1,
                MAX_TAKES,
                value=DEFAULT_VALUES["takes"],
                step=1,
                label="Takes",
                info="jobs with consecutive seeds",
                elem_id=f"{task}-takes",
                elem_classes="h3-typed",
            )
        )
    return seed, randomize_seed, takes


def _schedule_controls(
    task: str, steps: int, short_edge: int
) -> tuple[gr.Number, gr.Number, gr.Number, gr.Number]:
    """Advanced: the steps and short edge, then the video and audio flow shifts, a row each."""
    with gr.Row():
        steps_box = as_sent(gr.Number(value=steps, precision=0, label="Steps", elem_id=f"{task}-steps"))
        short_edge_box = as_sent(
            gr.Number(
                value=short_edge,
                precision=0,
                label="Short edge (px)",
                info=f"starts at the checkpoint's own ({VERIFIED_SHORT_EDGE} for the release, the verified "
                "setting)",
            )
        )
    with gr.Row():
        flow_shift = as_sent(gr.Number(value=DEFAULT_VALUES["flow_shift"], label="Video flow shift"))
        audio_flow_shift = as_sent(
            gr.Number(value=DEFAULT_VALUES["audio_flow_shift"], label="Audio flow shift")
        )
    return steps_box, short_edge_box, flow_shift, audio_flow_shift


def _step_controls(task: str) -> tuple[gr.Textbox, gr.Dropdown]:
    """Advanced: the rungs of a step-distilled adapter and the step cache."""
    rungs = as_sent(
        gr.Textbox(
            value=DEFAULT_VALUES["rungs"],
            label="Rungs (step-distilled adapters)",
            placeholder="e.g. 999,750,500,250; empty: the usual grid of Steps",
            info="one denoising step at each timestep (1000 is pure noise); Steps must equal their count",
            elem_id=f"{task}-rungs",
        )
    )
    cache = as_sent(
        gr.Dropdown(
            choices=[(CACHE_LABELS[name], name) for name in CACHE_PRESETS],
            value=DEFAULT_VALUES["cache"],
            label="Step cache (full-step runs)",
            info="skips the middle DiT blocks of steps that barely changed: faster, slightly different; "
            "not with rungs (Turbo)",
            elem_id=f"{task}-cache",
        )
    )
    return rungs, cache


def _prompt(task: str) -> tuple[gr.Textbox, PromptBuilderPanel]:
    """The prompt box and, right under it, its prompt builder."""
    prompt = as_sent(
        gr.Textbox(label="Prompt", lines=4, placeholder=PROMPT_PLACEHOLDERS[task], elem_id=f"{task}-prompt")
    )
    return prompt, build_prompt_builder(task)


def _examples(task: str, titles: list[str]) -> gr.Dataset | None:
    if not titles:
        return None
    return gr.Dataset(
        components=["textbox"],
        samples=[[title] for title in titles],
        headers=["Example (fills the inputs)"],
        type="index",
        label="Examples",
        elem_id=f"{task}-examples",
        elem_classes="h3-examples",
    )


def _task_tab(
    task: str,
    prompt: gr.Textbox,
    derived_text: str,
    example_titles: list[str],
    library: LoraLibrary,
    steps: int,
    short_edge: int,
    **controls: Any,
) -> TaskTab:
    """A tab's settings, Generate button and examples, made under its prompt and its own controls (the task's
    `TaskTab` fields); `steps` and `short_edge`: the first values of those fields (a step-distilled checkpoint's
    count, the checkpoint's own short edge)."""
    settings = _settings_controls(task, derived_text, library, steps, short_edge)
    generate = gr.Button("Generate", variant="primary", elem_id=f"{task}-generate")
    return TaskTab(task, prompt, settings, generate, _examples(task, example_titles), **controls)


def build_t2va_tab(
    derived_text: str,
    example_titles: list[str],
    library: LoraLibrary,
    steps: int = DEFAULT_VALUES["steps"],
    short_edge: int = VERIFIED_SHORT_EDGE,
) -> TaskTab:
    prompt, builder = _prompt("t2va")
    return _task_tab(
        "t2va", prompt, derived_text, example_titles, library, steps, short_edge, prompt_builder=builder
    )


def build_fl2va_tab(
    derived_text: str,
    example_titles: list[str],
    library: LoraLibrary,
    steps: int = DEFAULT_VALUES["steps"],
    short_edge: int = VERIFIED_SHORT_EDGE,
) -> TaskTab:
    prompt, builder = _prompt("fl2va")
    with gr.Row(equal_height=True):
        # Gradio's Image picker offers any image/*; what is accepted (h3engine.media.formats) is checked.
        first_image = as_uploaded(
            gr.Image(
                type="filepath", label="First frame", sources=["upload", "clipboard"], elem_id="fl2va-first"
            )
        )
        last_image = as_uploaded(
            gr.Image(
                type="filepath", label="Last frame", sources=["upload", "clipboard"], elem_id="fl2va-last"
            )
        )
    with gr.Row():
        swap = gr.Button("⇄ Swap first and last", size="sm", elem_id="fl2va-swap")
        # Disabled until there is a result (ui.blocks enables it).
        use_last_frame = gr.Button(
            "Use the last frame of the previous result",
            size="sm",
            interactive=False,
            elem_id="fl2va-use-last-frame",
        )
    controls = dict(first_image=first_image, last_image=last_image, swap=swap, use_last_frame=use_last_frame)
    return _task_tab(
        "fl2va",
        prompt,
        derived_text,
        example_titles,
        library,
        steps,
        short_edge,
        prompt_builder=builder,
        **controls,
    )


def build_ref2va_tab(
    derived_text: str,
    example_titles: list[str],
    library: LoraLibrary,
    steps: int = DEFAULT_VALUES["steps"],
    short_edge: int = VERIFIED_SHORT_EDGE,
) -> TaskTab:
    prompt, builder = _prompt("ref2va")
    gallery = build_reference_gallery()  # its events and cards are wired by ui.blocks
    duration_from_reference = as_sent(
        gr.Checkbox(
            value=DEFAULT_VALUES["duration_from_reference"],
            label="Take the duration from the one reference that carries audio",
            elem_id="ref2va-duration-from-reference",
        )
    )
    controls = dict(
        references=gallery.references,
        duration_from_reference=duration_from_reference,
        reference_gallery=gallery,
    )
    return _task_tab(
        "ref2va",
        prompt,
        derived_text,
        example_titles,
        library,
        steps,
        short_edge,
        prompt_builder=builder,
        **controls,
    )
