"""The stage-layout benchmark (benchmarks.stage_layouts) in its tiny CPU mode: both layouts serve the queued
requests, and the JSON holds the versions, each request's latency (measured and extrapolated), the split layout's
handoff bytes per step and the peak memory of every worker process."""

from __future__ import annotations

import json
import time

from benchmarks import stage_layouts


def test_the_tiny_run_writes_both_layouts(tmp_path) -> None:
    arguments = ["--tiny", "--devices", "cpu", "--requests", "2", "--timed-steps", "1", "--steps", "4"]
    path = stage_layouts.main([*arguments, "--seconds", "4", "--output-dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["versions"]["torch"] and record["request"]["steps_extrapolated_to"] == 4
    colocated, split = record["results"]
    assert (colocated["layout"], split["layout"]) == ("colocated", "split")
    for result in (colocated, split):
        measured, extrapolated = result["measured"], result["extrapolated_to_4_steps"]
        assert len(measured["latency_s"]) == 2 and measured["makespan_s"] > 0
        assert all(e > m for e, m in zip(extrapolated["latency_s"], measured["latency_s"], strict=True))
        assert all(peak > 0 for peaks in result["peak_memory_mib"].values() for peak in peaks)
        assert result["warm_up_s"] > 0 and result["peak_gpu_used_mib"] is None  # CPU: no GPU to sample
    assert set(split["peak_memory_mib"]) == {"vae", "encoder", "dit"}
    steps = {(entry["request"], entry["step"]) for entry in split["handoff"]}
    assert steps == {
        (request, step) for request in (0, 1) for step in ("prepare", "encode", "denoise", "decode")
    }
    assert all(entry["sent_bytes"] > 0 for entry in split["handoff"] if entry["step"] != "decode")
    assert "handoff_denoise_s" in split["timings_s"][0]


def test_extrapolation_adds_the_uncontended_steps_of_every_request_so_far() -> None:
    # Request 1's denoise shared the GPU (4 s for 2 steps); the steps left cost the uncontended 1 s each.
    result = stage_layouts.extrapolate([10.0, 20.0], [2.0, 4.0], timed_steps=2, steps=5)
    assert result["step_s"] == 1.0
    assert result["latency_s"] == [13.0, 26.0] and result["makespan_s"] == 26.0
    assert result["throughput_per_min"] == 60 * 2 / 26.0


def test_the_memory_sampler_keeps_each_process_peak_and_the_whole_gpu_peak(monkeypatch) -> None:
    readings = iter(
        [
            (["1000"], ["11, 500", "99, 7000"]),  # pid 99 is not ours
            (["3000"], ["11, 2500", "12, 400"]),
            (["2000"], ["11, 1200", "12, 900"]),
        ]
    )
    answers: list[list[str]] = []

    def fake_nvidia_smi(query: str) -> list[str]:
        if query == "--query-gpu=memory.used":
            try:
                whole, apps = next(readings)
            except StopIteration:
                return []
            answers.append(apps)
            return whole
        return answers[-1] if answers else []

    monkeypatch.setattr(stage_layouts, "nvidia_smi", fake_nvidia_smi)
    monkeypatch.setattr(stage_layouts, "MEMORY_SAMPLE_S", 0.01)
    sampler = stage_layouts.MemorySampler([11, 12], gpu=True)
    while len(answers) < 3:
        time.sleep(0.01)
    time.sleep(0.05)
    assert sampler.stop() == {11: 2500.0, 12: 900.0}
    assert sampler.peak_gpu_used_mib == 3000.0
