"""Examples shown under each tab, read once at start-up from assets/examples.json.

Contract: the file holds `{"examples": [{"name", "title", "request": {...}}]}` with requests in h3engine's own
shape (`h3engine.request.shapes.from_dict`) and media paths relative to the repository root. `load_examples` returns
them grouped by task with absolute paths. A missing file gives no examples; an entry that does not parse is
skipped with a warning in the log, never a failed start. Clicking an example only fills the inputs: nothing is
generated at start-up or on click.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from h3engine.checkpoint.layout import TASKS
from h3engine.errors import RequestError
from h3engine.request.model import GenerationRequest
from h3engine.request.shapes import from_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    name: str
    title: str
    request: GenerationRequest


def _absolute(path: str, root: Path) -> str:
    return str(Path(path) if Path(path).is_absolute() else root / path)


def load_examples(examples_path: Path, root: Path) -> dict[str, list[Example]]:
    grouped: dict[str, list[Example]] = {task: [] for task in TASKS}
    if not examples_path.is_file():
        return grouped
    try:
        entries = json.loads(examples_path.read_text(encoding="utf-8"))["examples"]
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("examples: %s is not readable; no examples are shown", examples_path)
        return grouped
    for entry in entries:
        try:
            request = from_dict(entry["request"])
            name, title = str(entry["name"]), str(entry.get("title", entry["name"]))
        except (RequestError, KeyError, TypeError) as error:
            logger.warning("examples: skipping an entry of %s (%s)", examples_path, error)
            continue
        request = dataclasses.replace(
            request,
            keyframes=tuple(
                dataclasses.replace(keyframe, path=_absolute(keyframe.path, root))
                for keyframe in request.keyframes
            ),
            references=tuple(
                dataclasses.replace(reference, path=_absolute(reference.path, root))
                for reference in request.references
            ),
        )
        if request.task in grouped:
            grouped[request.task].append(Example(name, title, request))
    return grouped
