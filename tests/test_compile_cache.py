"""The entry points keep TorchInductor's cache out of the system temp folder.

Importing transformers' Qwen3-VL modeling (the text encoder's) makes TorchInductor's cache folder, by default
`torchinductor_<user>` in the system temp folder; the app and the CLI call `disk.keep_compile_caches_in` with the
engine's cache folder first. Checked in a fresh interpreter whose temp folder is an empty one of the test's: with the
call it stays empty and the cache is under H3_CACHE_DIR; without it (the control) the folder appears there, so the
test would fail if the variable did not steer it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IMPORT_TEXT_ENCODER = "import transformers.models.qwen3_vl.modeling_qwen3_vl"
KEEP = "from h3engine.memory import disk; disk.keep_compile_caches_in(disk.default_cache_folder()); "


def run_in(tmp_path: Path, name: str, code: str) -> tuple[Path, Path]:
    temp, cache = tmp_path / name / "temp", tmp_path / name / "cache"
    temp.mkdir(parents=True)
    environment = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    environment |= {"TMPDIR": str(temp), "H3_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", code], env=environment, check=True, timeout=300)
    return temp, cache


def test_the_compile_cache_goes_to_the_engines_cache_folder(tmp_path) -> None:
    temp, cache = run_in(tmp_path, "kept", KEEP + IMPORT_TEXT_ENCODER)
    assert list(temp.iterdir()) == []
    assert (cache / "torchinductor").is_dir()
    control, _ = run_in(tmp_path, "control", IMPORT_TEXT_ENCODER)
    assert [path.name for path in control.iterdir() if path.name.startswith("torchinductor")]
