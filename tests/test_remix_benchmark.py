"""benchmarks/remix.py at tiny size on the CPU: every mode runs, its held rows equal its sources', the JSON says so."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.remix import main


def test_the_tiny_run_times_every_mode_and_keeps_the_held_rows(tmp_path: Path) -> None:
    arguments = ["--tiny", "--device", "cpu", "--steps", "1", "--duration", "4", "--warmup-steps", "0"]
    path = main([*arguments, "--output-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert result["complete"] and list(result["runs"]) == ["t2va", "v2a", "a2v", "extend"]
    runs = result["runs"]
    assert runs["t2va"]["held_rows_equal_source"] is None and runs["t2va"]["ratio_to_t2va"] == 1.0
    for mode in ("v2a", "a2v", "extend"):
        assert runs[mode]["held_rows_equal_source"] is True, mode
        assert runs[mode]["ratio_to_t2va"] > 0, mode
    # v2a keeps the 5 s source on its grid (120 frames: 107); extend's window puts its overlap before its 4 s and
    # its output is the source and then the window after the overlap.
    assert runs["v2a"]["output_frames"] == 107
    assert runs["extend"]["shape"]["frames"] > runs["t2va"]["shape"]["frames"]
    assert runs["extend"]["output_frames"] > 120
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [path.name]
