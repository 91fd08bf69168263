"""Generated malformed requests and files: every one ends in an error naming its field, quickly, writing nothing.

Cases are drawn deterministically (a seeded `random.Random`) from three valid requests, one per task, by breaking
one thing at a time: a field set to a value of the wrong type or out of range, a text that is too long or not
UTF-8, an unknown or refused field, an input file that is missing, empty, truncated, not media, too small or too
large, or of the wrong kind. Each case must raise `RequestError` whose message starts with the field it broke,
within `CASE_SECONDS`, and leave its output folder empty:
* requests (our JSON shape and SGLang's) through `from_dict` + `validate` with the media probe;
* the command line through `h3engine.cli.main` in this process (exit 2, one line on stderr naming the flag or field);
  a sample also as real `python -m h3engine` processes, which must not import torch and leave no process behind;
* the app's API through gradio_client: see tests/test_app_api_fuzz.py.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import random
import re
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from h3engine.cli import main as cli
from h3engine.errors import RequestError
from h3engine.media.inputs import probe_media
from h3engine.request.shapes import from_dict
from h3engine.request.validate import validate

REPOSITORY = Path(__file__).resolve().parents[1]
ASSETS = REPOSITORY / "assets"
CASE_SECONDS = 5.0
SEED = 20261203


# --- malformed files --------------------------------------------------------------------------------------------------


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` and whose pixel data is one empty compressed block."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Broken files by the kind of input they pose as (image, video, audio)."""
    folder = tmp_path_factory.mktemp("bad-files")
    picture = (ASSETS / "ref2va" / "picture1.png").read_bytes()
    video = (ASSETS / "ref2va" / "video1.mp4").read_bytes()
    audio = (ASSETS / "ref2va" / "audio1.wav").read_bytes()

    def write(name: str, data: bytes) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    from PIL import Image

    tiny = folder / "one-pixel.png"
    Image.new("RGB", (1, 1)).save(tiny)
    (folder / "a-folder.png").mkdir()
    common = {
        "missing": folder / "missing.file",
        "folder": folder / "a-folder.png",
        "text": write("notes.txt", b"not media at all\n" * 10),
    }
    return {
        "image": {
            **common,
            "empty": write("empty.png", b""),
            "truncated": write("truncated.png", picture[:100]),
            "video-as-image": write("clip.png", video),
            "one-pixel": tiny,
            "huge-header": write("huge.png", png_header_claiming(60_000, 60_000)),
        },
        "video": {
            **common,
            "empty": write("empty.mp4", b""),
            "truncated": write("truncated.mp4", video[:2048]),
            "image-as-video": write("still.mp4", picture),
        },
        "audio": {
            **common,
            "empty": write("empty.wav", b""),
            "truncated": write("truncated.wav", audio[:30]),
            "image-as-audio": write("sound.wav", picture),
        },
    }


# --- generated requests -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    payload: dict
    field: str  # the message must start with this
    # Refused only once the checkpoint is known (an explicit width or height off its canvas multiple): the CLI
    # checks it after the checkpoint loads, so the command-line tests leave these out.
    needs_checkpoint: bool = False


BASE = {
    "t2va": {
        "task": "t2va",
        "prompt": "A red kite climbs over green hills.",
        "duration_seconds": 5,
        "seed": 1,
    },
    "fl2va": {
        "task": "fl2va",
        "prompt": "The kite climbs as the sun comes up.",
        "keyframes": [{"path": str(ASSETS / "fl2va" / "first.png"), "position": "first"}],
    },
    "ref2va": {
        "task": "ref2va",
        "prompt": "<Picture 1> speaks in the voice of <Audio 1>.",
        "duration_seconds": 5,
        "references": [
            {"kind": "image", "path": str(ASSETS / "ref2va" / "picture1.png")},
            {"kind": "audio", "path": str(ASSETS / "ref2va" / "audio1.wav")},
        ],
    },
}
WRONG_TYPES = [None, "5", [], {}, True, 1j.__class__.__name__]
BAD_VALUES = {
    "duration_seconds": [-1, 0, 3.9, 15.5, 1e308, math.nan, math.inf, 10**30],
    "short_edge": [-768, 0, 100_000, 2**40],
    "width": [-32, 0, 100_000, 33],
    "height": [-32, 0, 100_000, 31],
    "seed": [-1, 2**64, 1.5],
    "steps": [0, -5, 5000, 10**12, 2.5],
    "flow_shift": [0, -12, math.nan, math.inf, 1e9],
    "audio_flow_shift": [0, -3, math.nan, -math.inf, 1e9],
    "aspect_ratio": ["", "16/9", "0:9", "9:0", "1000:1", "auto ", "abc"],
    "recipe": ["", "SGLANG", "comfy"],
    "task": ["", "T2VA", "t2v", "i2v"],
}
BAD_PROMPTS = [
    "",
    "   \n\t ",
    "x" * 40_000,
    "bad \udcff byte",
    "lone \ud800 surrogate",
    "<|vision_start|> smuggled",
    "a <|image_pad|> b",
]
REFUSED_FIELDS = [
    "guidance_scale",
    "negative_prompt",
    "fps",
    "num_frames",
    "cfg",
    "frames",
    "colour",
    "Prompt",
]


def generated_request_cases(bad_files: dict[str, dict[str, Path]], count: int) -> list[Case]:
    chooser = random.Random(SEED)
    cases: list[Case] = []

    def add(name: str, payload: dict, field: str, needs_checkpoint: bool = False) -> None:
        cases.append(Case(f"{len(cases):03d}-{name}", payload, field, needs_checkpoint))

    for task, base in BASE.items():
        for field, values in BAD_VALUES.items():
            if field in ("width", "height"):
                for value in values:
                    payload = {**base, "width": 64, "height": 64, field: value}
                    add(f"{task}-{field}={value!r}", payload, field, needs_checkpoint=value in (31, 33))
                continue
            # None is a valid short edge (the checkpoint's own rule).
            wrong_types = [value for value in WRONG_TYPES if value is not None or field != "short_edge"]
            for value in values + [chooser.choice(wrong_types)]:
                add(f"{task}-{field}={value!r}"[:80], {**base, field: value}, field)
        for prompt in BAD_PROMPTS:
            add(f"{task}-prompt", {**base, "prompt": prompt}, "prompt")
        for name in REFUSED_FIELDS:
            add(f"{task}-extra-{name}", {**base, name: 1}, name)
    picture = BASE["ref2va"]["references"][0]
    for kind in ("image", "video", "audio"):
        for problem, path in bad_files[kind].items():
            payload = {
                "task": "ref2va",
                "prompt": "Cite the reference.",
                "duration_seconds": 5,
                # An audio reference needs a picture or a clip beside it.
                "references": [picture, {"kind": kind, "path": str(path)}],
            }
            add(f"ref2va-{kind}-{problem}", payload, "references[1]")
    for problem, path in bad_files["image"].items():
        add(
            f"fl2va-keyframe-{problem}",
            {**BASE["fl2va"], "keyframes": [{"path": str(path), "position": "first"}]},
            "keyframes[0]",
        )
    structural = [
        ("fl2va-no-keyframes", {**BASE["fl2va"], "keyframes": []}, "keyframes"),
        (
            "fl2va-bad-position",
            {**BASE["fl2va"], "keyframes": [{"path": "x.png", "position": "middle"}]},
            "keyframes",
        ),
        ("t2va-with-keyframes", {**BASE["t2va"], "keyframes": BASE["fl2va"]["keyframes"]}, "keyframes"),
        ("t2va-with-references", {**BASE["t2va"], "references": BASE["ref2va"]["references"]}, "references"),
        ("ref2va-no-references", {**BASE["ref2va"], "references": []}, "references"),
        (
            "ref2va-kind",
            {**BASE["ref2va"], "references": [{"kind": "text", "path": "x"}]},
            "references[0].kind",
        ),
        (
            "ref2va-remote",
            {**BASE["ref2va"], "references": [{"kind": "image", "path": "https://x/y.png"}]},
            "references[0].path",
        ),
        (
            "ref2va-image-start",
            {**BASE["ref2va"], "references": [{**BASE["ref2va"]["references"][0], "start_seconds": 1}]},
            "references[0].start_seconds",
        ),
        (
            "ref2va-ten-pictures",
            {**BASE["ref2va"], "references": [BASE["ref2va"]["references"][0]] * 10},
            "references",
        ),
        ("ref2va-references-not-list", {**BASE["ref2va"], "references": "picture1.png"}, "references"),
        ("payload-not-object", ["t2va"], "request"),
    ]
    for name, payload, field in structural:
        add(name, payload, field)
    # Fill up to `count` with two faults at once: the first one checked is named, so only the prefix family is fixed.
    numeric = [field for field in BAD_VALUES if field not in ("width", "height", "task")]
    while len(cases) < count:
        task = chooser.choice(sorted(BASE))
        first, second = chooser.sample(numeric, 2)
        payload = {
            **BASE[task],
            first: chooser.choice(BAD_VALUES[first]),
            second: chooser.choice(BAD_VALUES[second]),
        }
        add(f"{task}-{first}+{second}", payload, f"({first}|{second})")
    return cases


def field_pattern(field: str) -> re.Pattern[str]:
    prefix = field if field.startswith("(") else re.escape(field)
    return re.compile(rf"^(error: )?(--[a-z-]+: )?{prefix}(?![A-Za-z_])")


@contextlib.contextmanager
def timed(case: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    assert elapsed < CASE_SECONDS, f"{case}: took {elapsed:.1f} s"


def test_three_hundred_generated_requests_each_end_in_an_error_naming_their_field(
    bad_files, tmp_path
) -> None:
    cases = generated_request_cases(bad_files, 300)
    assert len(cases) >= 300 and len({case.name for case in cases}) == len(cases)
    for case in cases:
        with timed(case.name), pytest.raises(RequestError) as raised:
            validate(from_dict(case.payload), probe_media, canvas_multiple=16)
        assert field_pattern(case.field).match(raised.value.field), f"{case.name}: {raised.value}"
    assert list(tmp_path.iterdir()) == []


# --- the command line -------------------------------------------------------------------------------------------------


CLI_FLAGS = {
    "references": "--ref",
    "duration_seconds": "--duration",
    "short_edge": "--short-edge",
    "width": "--width",
    "height": "--height",
    "seed": "--seed",
    "steps": "--steps",
    "flow_shift": "--flow-shift",
    "audio_flow_shift": "--audio-flow-shift",
    "aspect_ratio": "--aspect-ratio",
    "recipe": "--recipe",
    "task": "--task",
}


def cli_argv(payload: dict, checkpoint: str, out: Path) -> list[str] | None:
    """The command line of a payload in our shape, or None where the CLI has no flag for what is broken."""
    argv = ["generate", "--checkpoint", checkpoint, "--out", str(out)]
    for key, value in payload.items():
        if key == "prompt":
            argv += ["--prompt", value]
        elif key == "keyframes":
            if any(keyframe.get("position") not in ("first", "last") for keyframe in value):
                return None
            for keyframe in value:
                argv += [f"--{keyframe['position']}-frame", keyframe["path"]]
        elif key == "references":
            if not isinstance(value, list) or not all(
                isinstance(reference, dict) and set(reference) == {"kind", "path"} for reference in value
            ):
                return None
            argv += [f"--ref={reference['kind']}:{reference['path']}" for reference in value]
        elif key in CLI_FLAGS and isinstance(value, int | float) and not isinstance(value, bool):
            argv += [f"{CLI_FLAGS[key]}={value}"]
        elif key in ("aspect_ratio", "recipe", "task") and isinstance(value, str):
            argv += [f"{CLI_FLAGS[key]}={value}"]
        else:
            return None
    return argv


def cli_names(field: str) -> str:
    """A pattern for what the CLI may name for a field: the field itself or its flag (either of two fields)."""
    fields = field.strip("()").split("|")
    flags = [CLI_FLAGS.get(name.split("[")[0], "") for name in fields]
    return "|".join(re.escape(name) for name in fields + [flag for flag in flags if flag])


def run_cli_in_process(argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, stderr.getvalue()


def test_generated_command_lines_exit_2_with_one_line_naming_the_field(bad_files, tmp_path) -> None:
    out_folder = tmp_path / "out"
    out_folder.mkdir()
    ran = 0
    for case in generated_request_cases(bad_files, 300):
        if not isinstance(case.payload, dict) or case.needs_checkpoint:
            continue
        argv = cli_argv(case.payload, str(tmp_path / "no-checkpoint"), out_folder / "clip.mp4")
        if argv is None:
            continue
        with timed(case.name):
            code, stderr = run_cli_in_process(argv)
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1, f"{case.name}: exit {code}, stderr {stderr!r}"
        named = re.compile(rf"^error: (argument )?({cli_names(case.field)})(?![A-Za-z_])")
        assert named.match(lines[0]), f"{case.name}: {lines[0]}"
        ran += 1
    assert ran >= 150, f"only {ran} cases had a command line"
    assert list(out_folder.iterdir()) == []


def children_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(line) for line in found.stdout.split()]


def test_a_sample_of_command_lines_as_processes_fail_fast_without_torch(bad_files, tmp_path) -> None:
    out_folder = tmp_path / "out"
    out_folder.mkdir()
    chooser = random.Random(SEED + 1)
    cases = [
        case
        for case in generated_request_cases(bad_files, 300)
        if isinstance(case.payload, dict) and not case.needs_checkpoint
    ]
    sample = [
        argv
        for argv in (
            cli_argv(case.payload, str(tmp_path / "no-checkpoint"), out_folder / "clip.mp4") for case in cases
        )
        if argv is not None
    ]
    probe = "import sys, runpy; sys.argv = ['h3engine', *sys.argv[1:]]\n" + (
        "try:\n    runpy.run_module('h3engine', run_name='__main__')\n"
        "finally:\n    print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
    )
    # Earlier tests may leave long-lived helpers (multiprocessing's resource tracker): only new children count.
    children_before = set(children_of(os.getpid()))
    for argv in chooser.sample(sample, 12):
        started = time.perf_counter()
        finished = subprocess.run(
            [sys.executable, "-c", probe, *argv], cwd=REPOSITORY, capture_output=True, text=True, timeout=60
        )
        elapsed = time.perf_counter() - started
        lines = finished.stderr.strip().splitlines()
        assert finished.returncode == 2, finished.stderr
        assert lines[-1] == "no torch" and len(lines) == 2 and lines[0].startswith("error: "), finished.stderr
        assert elapsed < CASE_SECONDS, f"{argv}: {elapsed:.1f} s"
    assert set(children_of(os.getpid())) <= children_before
    # Nor anything started by the runs that outlived them (it would carry the output folder in its command line).
    assert subprocess.run(["pgrep", "-f", str(out_folder)], capture_output=True).stdout == b""
    assert list(out_folder.iterdir()) == []
