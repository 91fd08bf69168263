"""The CLI's flag values read into entries of our request shape: `--ref KIND:PATH[@START]`, `--lora PATH[:STRENGTH]`,
rungs and `--dmd-steps` (RequestError naming the flag). Used by `generate` and by the validation commands."""

from __future__ import annotations

from pathlib import Path

from h3engine.errors import RequestError
from h3engine.request.checks import parse_rungs
from h3engine.request.model import REFERENCE_KINDS


def parse_dmd_steps(text: str | None, flag: str = "--dmd-steps") -> list[int] | None:
    """`999,750,500,250` -> the rungs (None when not given; RequestError naming `flag` for anything else)."""
    return None if text is None else list(parse_rungs(text, flag))


def parse_reference_spec(spec: str) -> dict[str, object]:
    """`KIND:PATH[@START_SECONDS]` -> a reference entry of our request shape.

    Only a video takes a start time: the text after its last `@` when that reads as a number. Otherwise (and for
    images and audio) an `@` belongs to the path.
    """
    kind, separator, rest = spec.partition(":")
    if not separator or kind not in REFERENCE_KINDS or not rest:
        raise RequestError(
            "--ref",
            f"expected KIND:PATH[@START_SECONDS] with KIND one of {', '.join(REFERENCE_KINDS)}, got '{spec}'",
        )
    path, at, start_text = rest.rpartition("@")
    if kind == "video" and at and path:
        try:
            return {"kind": kind, "path": path, "start_seconds": float(start_text)}
        except ValueError:
            pass
    return {"kind": kind, "path": rest}


def parse_lora_spec(spec: str, target: str | None) -> dict[str, object]:
    """`PATH[:STRENGTH]` -> a LoRA entry of our request shape. The text after the last `:` is the strength when it
    reads as a number; otherwise it belongs to the path, if that path exists (else RequestError naming --lora)."""
    path, colon, strength_text = spec.rpartition(":")
    if colon and path:
        try:
            return {"path": path, "strength": float(strength_text), "target": target}
        except ValueError:
            if not Path(spec).exists():
                raise RequestError(
                    "--lora", f"expected PATH[:STRENGTH] with STRENGTH a number such as 0.8, got '{spec}'"
                ) from None
    return {"path": spec, "strength": 1.0, "target": target}
