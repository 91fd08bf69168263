"""Past results: the outputs folder, read back through the JSON sidecars the engine writes next to each MP4.

Contract: a result is listed when `<stem>.json` parses and `<stem>.mp4` exists beside it (the engine writes the
MP4 first and both atomically, so a listed result is complete; hidden `.partial` files never match). The list is
read from disk every time, so it survives restarts and includes results of the CLI written into the same folder.
`find_entry(outputs_dir, stem)` takes a stem sent back by the browser and accepts only a plain file stem inside
the outputs folder.

`result_markdown` is the one text shown for a result, live or restored: seed, canvas, frames and per-phase times.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HISTORY_LIMIT = 200
HISTORY_HEADERS = ["Result", "When", "Task", "Prompt", "Seed", "Steps", "Canvas"]
PROMPT_PREVIEW_CHARACTERS = 80
TASK_TITLES = {"t2va": "T2VA", "fl2va": "FL2VA", "ref2va": "Ref2VA"}
# In pipeline order; phases the engine adds later are listed after these under their own key.
PHASE_TITLES = {
    "queue_wait_s": "Queue wait",
    "conditioning_s": "Conditioning inputs",
    "text_encode_s": "Text encode",
    "denoise_s": "Denoise",
    "adaln_tables_computed_s": "AdaLN tables computed",
    "adaln_tables_cached_s": "AdaLN tables read from the cache",
    "video_decode_s": "Video decode",
    "audio_decode_s": "Audio decode",
    "decode_s": "Decode (video tiles over the VAE ranks, audio alongside)",
    "mux_s": "MP4 mux",
    "mux_after_decode_s": "MP4 mux after the video decode",
}
# A phase that ran alongside the others -> the key of its part after them: shown, but only that part is in the total.
RAN_ALONGSIDE = {"mux_s": "mux_after_decode_s"}
# Parts of another phase (shown, never added to the total again) -> that phase.
PART_OF = {"adaln_tables_computed_s": "denoise_s", "adaln_tables_cached_s": "denoise_s"}


@dataclass(frozen=True)
class HistoryEntry:
    stem: str
    video_path: Path
    sidecar_path: Path
    sidecar: dict[str, Any]
    modified: float


def _read_entry(sidecar_path: Path) -> HistoryEntry | None:
    video_path = sidecar_path.with_suffix(".mp4")
    if not video_path.is_file():
        return None
    try:
        sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        logger.warning("history: skipping unreadable sidecar %s", sidecar_path)
        return None
    if not isinstance(sidecar, dict) or not isinstance(sidecar.get("request"), dict):
        return None
    return HistoryEntry(sidecar_path.stem, video_path, sidecar_path, sidecar, video_path.stat().st_mtime)


def list_history(outputs_dir: Path, limit: int = HISTORY_LIMIT) -> list[HistoryEntry]:
    """Newest first."""
    if not outputs_dir.is_dir():
        return []
    entries = [
        entry
        for sidecar_path in outputs_dir.glob("*.json")
        if not sidecar_path.name.startswith(".") and (entry := _read_entry(sidecar_path)) is not None
    ]
    entries.sort(key=lambda entry: entry.modified, reverse=True)
    return entries[:limit]


def find_entry(outputs_dir: Path, stem: Any) -> HistoryEntry | None:
    if not isinstance(stem, str) or not stem or stem.startswith(".") or Path(stem).name != stem:
        return None
    return _read_entry(outputs_dir / f"{stem}.json")


def history_rows(entries: list[HistoryEntry]) -> list[list[str]]:
    rows = []
    for entry in entries:
        request = entry.sidecar["request"]
        geometry = entry.sidecar.get("geometry", {})
        prompt = " ".join(str(request.get("prompt", "")).split())
        if len(prompt) > PROMPT_PREVIEW_CHARACTERS:
            prompt = prompt[: PROMPT_PREVIEW_CHARACTERS - 1] + "…"
        rows.append(
            [
                entry.stem,
                time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.modified)),
                _task_title(request),
                prompt,
                str(entry.sidecar.get("seed", "")),
                str(request.get("steps", "")),
                f"{geometry.get('width', '?')}×{geometry.get('height', '?')}, {geometry.get('frames', '?')} frames",
            ]
        )
    return rows


def step_cache_line(step_cache: Any) -> str | None:
    """A sidecar's `step_cache` entry in words ("**Step cache** high: computed 34 of 50 steps"); None without one
    (cache "off", an older sidecar) or when it is not the shape the engine writes."""
    if not isinstance(step_cache, dict):
        return None
    preset, computed, forwards = (step_cache.get(key) for key in ("preset", "computed", "forwards"))
    if not isinstance(preset, str) or not all(type(value) is int for value in (computed, forwards)):
        return None
    return f"**Step cache** {preset}: computed {computed} of {forwards} steps ({forwards - computed} skipped)"


def sidecar_step_cache(sidecar_path: Path) -> Any:
    """The `step_cache` entry of a sidecar file (None when it has none or cannot be read)."""
    try:
        sidecar = json.loads(Path(sidecar_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return sidecar.get("step_cache") if isinstance(sidecar, dict) else None


def result_markdown(
    seed: int,
    width: int,
    height: int,
    frames: int,
    fps: int,
    timings_s: dict[str, float],
    step_cache: Any = None,
) -> str:
    lines = [
        f"**Seed** {seed} · **Canvas** {width} × {height} · **Frames** {frames} at {fps} fps "
        f"({frames / fps:.2f} s)",
        "",
        "| Phase | Seconds |",
        "|---|---:|",
    ]
    ordered = sorted(
        timings_s, key=lambda name: list(PHASE_TITLES).index(name) if name in PHASE_TITLES else 99
    )
    total = 0.0
    for name in ordered:
        seconds = timings_s[name]
        title = PHASE_TITLES.get(name, name)
        if RAN_ALONGSIDE.get(name) in timings_s:
            title += " (alongside the video decode)"
        elif name in PART_OF:
            title += f" (within {PHASE_TITLES[PART_OF[name]].lower()})"
        else:
            total += seconds
        lines.append(f"| {title} | {seconds:.2f} |")
    lines.append(f"| **Total** | **{total:.2f}** |")
    cache_line = step_cache_line(step_cache)
    if cache_line is not None:
        lines += ["", cache_line]
    return "\n".join(lines)


def entry_markdown(entry: HistoryEntry) -> str:
    geometry = entry.sidecar.get("geometry", {})
    return result_markdown(
        int(entry.sidecar.get("seed", 0)),
        int(geometry.get("width", 0)),
        int(geometry.get("height", 0)),
        int(geometry.get("frames", 0)),
        int(geometry.get("fps", 24)),
        {name: float(value) for name, value in entry.sidecar.get("timings_s", {}).items()},
        entry.sidecar.get("step_cache"),
    )


def _task_title(request: dict) -> str:
    """The task column: a remix says its mode and source file (the sidecar's request records both)."""
    remix = request.get("remix")
    if isinstance(remix, dict):
        source = remix.get("source_video") or remix.get("source_audio") or ""
        return f"Remix {remix.get('mode') or 'masks'} ({Path(str(source)).name})"
    return TASK_TITLES.get(request.get("task"), str(request.get("task")))
