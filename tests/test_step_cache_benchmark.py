"""benchmarks/step_cache.py at tiny size on the CPU: its runs, its JSON, and nothing left in the temporary folder.

One run of `main` with an eager custom preset that skips every forward after the first (no named preset, to keep it
short: "high" computes every forward of so few steps): the runs come in the order off, eager, off; "off" and its
repeat agree bit for bit; the eager run skipped and so changed the latents; the JSON carries the device, versions,
shape, notes (the quality caveat) and the peers' figures.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.step_cache import main, parse_custom

ARGUMENTS = ["--tiny", "--device", "cpu", "--steps", "4", "--duration", "4", "--warmup-steps", "0"]


def test_the_benchmark_runs_at_tiny_size_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    results = tmp_path / "results"
    path = main([*ARGUMENTS, "--presets", "", "--custom", "eager=1,0,10,1,-1", "--output-dir", str(results)])
    assert path.parent == results and path.name.startswith("step_cache_cpu_")
    result = json.loads(path.read_text())
    runs = result["runs"]
    assert [run["preset"] for run in runs] == ["off", "eager", "off"]
    assert all(run["forwards"] == 4 == run["computed"] + run["skipped"] for run in runs)
    off, eager, repeat = runs
    assert off["knobs"] is None and eager["knobs"]["threshold"] == 10.0
    assert (eager["computed"], eager["skipped"]) == (1, 3)
    assert off["errors"]["video_latents_rel_l2"] == 0.0 and result["off_repeat_equal"]
    assert repeat["errors"]["video_latents_rel_l2"] == repeat["errors"]["audio_latents_rel_l2"] == 0.0
    assert eager["errors"]["video_latents_rel_l2"] > 0.0 and eager["errors"]["video_psnr_db"] is not None
    assert all(run["request_s"] > 0 and "denoise_s" in run["timings_s"] for run in runs)
    assert result["gpu"] == "cpu" and result["versions"]["torch"] and result["shape"]["audio_rows"] > 0
    assert any("say nothing about picture quality" in note for note in result["notes"])
    assert any("1.35x" in figure for figure in result["peers_published"].values())
    assert set(result["summary"]) == {"off", "eager", "off (repeat)"}
    assert not list(temporary.iterdir())


def test_a_custom_preset_is_read_or_refused() -> None:
    preset = parse_custom("sweep=1,2,0.06,3,-1")
    assert (preset.name, preset.first_blocks, preset.last_blocks, preset.threshold) == ("sweep", 1, 2, 0.06)
    assert (preset.warmup_steps, preset.max_consecutive) == (3, -1)
    with pytest.raises(ValueError, match="--custom: expected NAME=Fn,Bn,THRESHOLD,WARMUP,MAX_CONSECUTIVE"):
        parse_custom("sweep=1,0,0.06")


def test_a_named_preset_rides_on_the_request_and_each_run_is_saved_as_it_ends(
    tmp_path: Path, monkeypatch
) -> None:
    import benchmarks.step_cache as bench

    saved: list[list[str]] = []
    write = bench.write
    monkeypatch.setattr(
        bench,
        "write",
        lambda path, result: (
            saved.append([r["preset"] for r in result.get("runs", [])]),
            write(path, result),
        ),
    )
    prepared_caches: list[str] = []
    prepare = bench.run_preset

    def recording(engine, request, preset, device):
        output, prepared, record = prepare(engine, request, preset, device)
        prepared_caches.append(str(prepared.cache))
        return output, prepared, record

    monkeypatch.setattr(bench, "run_preset", recording)
    path = main([*ARGUMENTS, "--presets", "high", "--no-repeat-off", "--output-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert [run["preset"] for run in result["runs"]] == ["off", "high"]
    assert saved == [["off"], ["off", "high"], ["off", "high"]]
    assert prepared_caches == ["off", "high"] and result["complete"] and "off_repeat_equal" not in result
    assert result["request"]["gpu_memory_gib"] is None and result["memory_plan"]
