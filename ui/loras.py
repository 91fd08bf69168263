"""The LoRA panel of each tab: adapters from the app's `--lora-dir`, each with a strength, and the Turbo preset.

Contract:
* `build_lora_panel(task, library)` makes a closed "LoRA adapters" accordion: `LORA_SLOTS` rows of (adapter,
  strength), shown one more than are filled; "Turbo preset"; "Rescan the folder"; and the hidden `loras` JSON, the
  endpoint parameter (`[{"name": "style.safetensors", "strength": 0.8}]`: names as the folder lists them).
* The rows write `loras` on user input only; `loras` redraws the rows whenever it changes (a restore, an example),
  so the two never loop. `wire_lora_panel` attaches these events and the two buttons (private: not in the API).
* `h3engine.engine.lora.library.lora_choices` (the API's too) turns the parameter into the request's LoraChoice entries
  (each on the tab's DiT); `lora_values(request, library)` is its inverse for History (adapters no longer listed are
  left out).

Danger: names come from clients; only `LoraLibrary.entry` turns a name into a path, never the name itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from h3engine.engine.lora.library import LoraLibrary, turbo_settings
from h3engine.errors import RequestError
from h3engine.request.model import LORA_TARGET_OF_TASK, MAX_LORA_STRENGTH, MAX_LORAS, GenerationRequest
from ui.components import as_sent

LORA_SLOTS = MAX_LORAS
NO_ADAPTER = ""


@dataclass
class LoraPanel:
    task: str
    library: LoraLibrary
    accordion: gr.Accordion
    note: gr.Markdown
    rows: list[gr.Row]
    names: list[gr.Dropdown]
    strengths: list[gr.Slider]
    turbo: gr.Button
    rescan: gr.Button
    loras: gr.JSON  # hidden: the endpoint parameter

    @property
    def slots(self) -> list[gr.components.Component]:
        return [component for pair in zip(self.names, self.strengths, strict=True) for component in pair]


def _choices(library: LoraLibrary, task: str) -> list[tuple[str, str]]:
    usable = library.usable(LORA_TARGET_OF_TASK[task])
    return [("none", NO_ADAPTER), *((entry.label(), entry.name) for entry in usable)]


def _note(library: LoraLibrary, task: str) -> str:
    if library.folder is None:
        return "No LoRA folder: start the app with `--lora-dir DIR` to pick adapters (`.safetensors`) here."
    usable = library.usable(LORA_TARGET_OF_TASK[task])
    unusable = [entry.label() for entry in library.entries if entry.problem is not None]
    text = (
        f"{len(usable)} of {len(library.entries)} adapter(s) in `{library.folder.name}` fit this tab's DiT "
        f"({LORA_TARGET_OF_TASK[task]})."
    )
    if unusable:
        text += " Not usable: " + "; ".join(unusable[:4]) + (" …" if len(unusable) > 4 else "")
    return text


def build_lora_panel(task: str, library: LoraLibrary) -> LoraPanel:
    with gr.Accordion("LoRA adapters", open=False, elem_id=f"{task}-loras") as accordion:
        note = gr.Markdown(_note(library, task), elem_id=f"{task}-lora-note")
        rows, names, strengths = [], [], []
        for slot in range(LORA_SLOTS):
            with gr.Row(visible=slot == 0, elem_id=f"{task}-lora-row-{slot}") as row:
                names.append(
                    gr.Dropdown(
                        choices=_choices(library, task),
                        value=NO_ADAPTER,
                        label=f"Adapter {slot + 1}",
                        scale=3,
                        elem_id=f"{task}-lora-{slot}",
                    )
                )
                strengths.append(
                    gr.Slider(
                        -MAX_LORA_STRENGTH,
                        MAX_LORA_STRENGTH,
                        value=1.0,
                        step=0.05,
                        label="Strength",
                        scale=2,
                        elem_id=f"{task}-lora-strength-{slot}",
                    )
                )
            rows.append(row)
        with gr.Row():
            turbo = gr.Button("Turbo preset", size="sm", elem_id=f"{task}-turbo")
            rescan = gr.Button("↻ Rescan the folder", size="sm", elem_id=f"{task}-lora-rescan")
        loras = as_sent(gr.JSON(value=[], visible=False, elem_id=f"{task}-loras-value"))
    return LoraPanel(task, library, accordion, note, rows, names, strengths, turbo, rescan, loras)


def rows_to_loras(*slots: Any) -> list[dict[str, Any]]:
    """The rows' (adapter, strength) pairs as the `loras` parameter: the chosen ones, in order."""
    pairs = zip(slots[0::2], slots[1::2], strict=True)
    return [{"name": name, "strength": strength} for name, strength in pairs if name]


def loras_to_rows(value: Any) -> list[Any]:
    """Updates of the rows for a `loras` value: each filled slot, then one empty row to add another."""
    entries = value if isinstance(value, list) else []
    entries = [entry for entry in entries if isinstance(entry, dict)][:LORA_SLOTS]
    rows, slots = [], []
    for slot in range(LORA_SLOTS):
        entry = entries[slot] if slot < len(entries) else {}
        rows.append(gr.Row(visible=slot <= len(entries)))
        slots += [entry.get("name", NO_ADAPTER), entry.get("strength", 1.0)]
    return [*rows, *slots]


def lora_values(request: GenerationRequest, library: LoraLibrary) -> list[dict[str, Any]]:
    """A past request's adapters as the `loras` parameter (those no longer in the folder are left out)."""
    values = []
    for lora in request.loras:
        name = library.name_of(lora.path)
        if name is not None:
            values.append({"name": name, "strength": lora.strength})
    return values


def wire_lora_panel(panel: LoraPanel, steps: Any, flow_shift: Any, audio_flow_shift: Any, rungs: Any) -> None:
    gr.on(
        [component.input for component in panel.slots],
        rows_to_loras,
        inputs=panel.slots,
        outputs=panel.loras,
        queue=False,
        api_visibility="private",
    )
    panel.loras.change(
        loras_to_rows,
        inputs=panel.loras,
        outputs=[*panel.rows, *panel.slots],
        queue=False,
        api_visibility="private",
    )

    def turbo(value: Any) -> tuple[Any, ...]:
        try:
            entries = [panel.library.entry(choice, "loras") for choice in _names(value)]
        except RequestError as error:
            # In the panel's note, not raised: Gradio would put every output (the settings) in its error state.
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), f"⚠ No Turbo preset: {error}"
        settings = turbo_settings([entry.turbo for entry in entries])
        note = f"Turbo preset: {settings.describe()}. Steps, flow shifts and rungs are under Advanced."
        rung_text = ",".join(map(str, settings.rungs))
        return settings.steps, settings.flow_shift, settings.audio_flow_shift, rung_text, note

    panel.turbo.click(
        turbo,
        inputs=panel.loras,
        outputs=[steps, flow_shift, audio_flow_shift, rungs, panel.note],
        queue=False,
        api_visibility="private",
    )

    def rescan() -> list[Any]:
        panel.library.rescan()
        choices = _choices(panel.library, panel.task)
        return [
            gr.Markdown(_note(panel.library, panel.task)),
            *(gr.Dropdown(choices=choices) for _ in panel.names),
        ]

    panel.rescan.click(rescan, outputs=[panel.note, *panel.names], queue=False, api_visibility="private")


def _names(value: Any) -> list[str]:
    entries = value if isinstance(value, list) else []
    return [entry["name"] for entry in entries if isinstance(entry, dict) and entry.get("name")]
