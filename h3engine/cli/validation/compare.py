"""Two captures, boundary by boundary: relative L2, max abs, cosine, PSNR for frames, SNR for audio.

`compare_captures(a, b, tolerances)` walks `a`'s boundaries in order, finds each in `b` by name and step, and rates
every tensor against that boundary's tolerance (`TOLERANCES`: a preset's per-boundary bound and its reason, "fp32"
for runs at full precision on one machine, "bf16" for the release's precision; `name=VALUE` overrides one). The
first boundary beyond its bound is the divergence: everything after it inherits it. `format_table` renders one row
per tensor and the verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3engine.engine.trace import BOUNDARIES, INDEX_NAME

# Per boundary: (the bound on relative L2 at fp32, at bf16, the reason). 0.0: bit-exact (integers, seeded draws).
# The bf16 bounds are set from a bf16 run against the fp32 reference on the tiny checkpoints (text states 2.7%,
# DiT predictions 0.5%, frames 0.2%, waveform 0.4%) with head room; nothing at the released size measured them.
TOLERANCES: dict[str, tuple[float, float, str]] = {
    "processor_tokens": (0.0, 0.0, "token ids and the processor's pixels: exact or wrong"),
    "text_states": (1e-5, 5e-2, "50 encoder layers: fp32 rounding / bf16 (2.7% on the tiny checkpoint)"),
    "condition_rows": (1e-5, 2e-2, "one VAE encode plus one noising step"),
    "initial_noise": (0.0, 0.0, "the seed's CPU draw: identical bits on every machine"),
    "packed_layout": (0.0, 0.0, "tags, indices and the rotary grid are exact"),
    "dit_prediction": (1e-4, 5e-2, "one DiT forward on the step's rows; bf16 matmuls drift a few percent"),
    "scheduler_output": (
        1e-4,
        3e-2,
        "the Euler update of fp32 rows (errors carried from the step's prediction)",
    ),
    "final_latents": (1e-4, 5e-2, "the last step's rows, denormalized"),
    "decoded_frames": (1e-4, 5e-2, "the video VAE decode (PSNR shown)"),
    "waveform": (1e-4, 1e-1, "the audio VAE decode (SNR shown)"),
}
PRESETS = ("fp32", "bf16")


class CaptureError(Exception):
    """A capture folder is missing, unreadable or not a capture (the message names the file)."""


@dataclass
class Row:
    boundary: str
    step: int | None
    tensor: str
    relative_l2: float
    max_abs: float
    cosine: float
    quality: str  # PSNR (frames) / SNR (audio) / ""
    bound: float
    ok: bool
    note: str = ""


def parse_tolerances(texts: list[str]) -> dict[str, float]:
    """`--tol fp32|bf16|BOUNDARY=VALUE ...` -> each boundary's bound (ValueError naming the bad part)."""
    preset = 0
    overrides: dict[str, float] = {}
    for text in texts:
        if text in PRESETS:
            preset = PRESETS.index(text)
            continue
        name, equals, value = text.partition("=")
        if not equals or name not in TOLERANCES:
            raise ValueError(
                f"'{text}' is not fp32, bf16 or BOUNDARY=VALUE with BOUNDARY one of {', '.join(BOUNDARIES)}"
            )
        try:
            overrides[name] = float(value)
        except ValueError:
            raise ValueError(f"'{text}': {value!r} is not a number") from None
        if not overrides[name] >= 0:
            raise ValueError(f"'{text}': a tolerance is a non-negative number")
    return {name: overrides.get(name, bounds[preset]) for name, bounds in TOLERANCES.items()}


def read_index(folder: Path) -> dict[str, Any]:
    path = Path(folder) / INDEX_NAME
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        index["boundaries"]  # noqa: B018 - a capture's index has them
    except FileNotFoundError:
        raise CaptureError(f"{path}: file is missing (not a capture folder)") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CaptureError(f"{path}: unreadable capture index ({error})") from None
    return index


def _tensors(folder: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(folder) / entry["file"]
    try:
        return load_file(str(path))
    except Exception as error:
        raise CaptureError(f"{path}: unreadable boundary file ({error})") from None


def _squeezed(tensor: torch.Tensor) -> torch.Tensor:
    while tensor.ndim > 1 and tensor.shape[0] == 1:
        tensor = tensor[0]
    return tensor


def measure(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, str]:
    """(relative L2 of a against b, max abs difference, cosine, PSNR / SNR text)."""
    a, b = _squeezed(a).double(), _squeezed(b).double()
    difference = a - b
    norm = float(b.norm())
    error = float(difference.norm())
    relative = error / norm if norm > 0 else (0.0 if error == 0 else math.inf)
    max_abs = float(difference.abs().max()) if difference.numel() else 0.0
    denominator = float(a.norm()) * norm
    cosine = float((a.flatten() @ b.flatten()) / denominator) if denominator > 0 else float(error == 0)
    quality = ""
    mean_square = float(difference.pow(2).mean()) if difference.numel() else 0.0
    if name == "decoded_frames":
        quality = "PSNR inf" if mean_square == 0 else f"PSNR {10 * math.log10(1.0 / mean_square):.1f} dB"
    elif name == "waveform":
        signal = float(b.pow(2).mean())
        quality = (
            "SNR inf"
            if mean_square == 0
            else f"SNR {10 * math.log10(max(signal, 1e-30) / mean_square):.1f} dB"
        )
    return relative, max_abs, cosine, quality


REQUEST_FIELDS = ("task", "prompt", "seed", "steps", "recipe", "flow_shift", "audio_flow_shift")


def _describe(index: dict[str, Any]) -> str:
    request = index.get("request") or {}
    fields = ", ".join(f"{name}={request.get(name)!r}" for name in REQUEST_FIELDS if name != "prompt")
    return f"{index.get('runner', '?')}: {fields}"


def request_differences(a: Path, b: Path) -> list[str]:
    """The request fields two captures disagree on (a reason to expect a divergence, not a failure)."""
    first, second = read_index(a).get("request") or {}, read_index(b).get("request") or {}
    return [name for name in REQUEST_FIELDS if first.get(name) != second.get(name)]


def compare_captures(
    a: Path, b: Path, bounds: dict[str, float], runs: list[str] | None = None
) -> tuple[list[Row], Row | None]:
    """Every tensor of `a` against `b`; the rows and the first one beyond its bound (None: all within). `runs`
    receives one line describing each capture's run."""
    runs = [] if runs is None else runs
    index_a, index_b = read_index(a), read_index(b)
    runs.extend([_describe(index_a), _describe(index_b)])
    others = {(entry["name"], entry["step"]): entry for entry in index_b["boundaries"]}
    rows: list[Row] = []
    first: Row | None = None
    for entry in index_a["boundaries"]:
        name, step = entry["name"], entry["step"]
        bound = bounds.get(name, 0.0)
        other = others.get((name, step))
        if other is None:
            rows.append(
                Row(name, step, "*", math.nan, math.nan, math.nan, "", bound, True, "not in B: skipped")
            )
            continue
        mine, theirs = _tensors(a, entry), _tensors(b, other)
        for key in sorted(mine.keys() | theirs.keys()):
            if key not in mine or key not in theirs:
                row = Row(
                    name, step, key, math.inf, math.inf, math.nan, "", bound, False, "missing on one side"
                )
            elif _squeezed(mine[key]).shape != _squeezed(theirs[key]).shape:
                shapes = f"shape {list(mine[key].shape)} vs {list(theirs[key].shape)}"
                row = Row(name, step, key, math.inf, math.inf, math.nan, "", bound, False, shapes)
            else:
                relative, max_abs, cosine, quality = measure(name, mine[key], theirs[key])
                row = Row(name, step, key, relative, max_abs, cosine, quality, bound, relative <= bound)
            rows.append(row)
            if not row.ok and first is None:
                first = row
    return rows, first


def _label(row: Row) -> str:
    return row.boundary if row.step is None else f"{row.boundary}[{row.step}]"


def format_table(rows: list[Row], first: Row | None) -> str:
    """One line per tensor, then the verdict line."""
    lines = [
        f"{'boundary':<24} {'tensor':<14} {'rel L2':>10} {'max abs':>10} {'cosine':>10} {'bound':>8}  {'':<16} verdict"
    ]
    for row in rows:
        verdict = "ok" if row.ok else "DIVERGED"
        if row.note:
            verdict += f" ({row.note})"
        lines.append(
            f"{_label(row):<24} {row.tensor:<14} {row.relative_l2:>10.3g} {row.max_abs:>10.3g} {row.cosine:>10.6f} "
            f"{row.bound:>8.0e}  {row.quality:<16} {verdict}"
        )
    skipped = sum(1 for row in rows if row.note.startswith("not in B"))
    if first is None:
        lines.append(
            "verdict: MATCH - every boundary within its tolerance"
            + (f" ({skipped} of A's boundaries not in B, not compared)" if skipped else "")
        )
    else:
        reason = TOLERANCES.get(first.boundary, (0, 0, ""))[2]
        lines.append(
            f"verdict: DIVERGED first at {_label(first)} ({first.tensor}: relative L2 {first.relative_l2:.3g} > "
            f"{first.bound:.0e}; {reason})"
        )
    return "\n".join(lines)
