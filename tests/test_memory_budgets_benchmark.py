"""benchmarks/memory_budgets.py at tiny size on the CPU: its run order, its JSON, and what it leaves behind.

One run of the module's `main` (`--tiny --device cpu --budgets 120,24 --weights bf16,fp8 --steps 2 --switch`, plus
one whole request of 2 steps) makes 11 child processes (forked from the engine's rank server, under the test's
TMPDIR). What is checked: the interleaved order R B B R per weight format, each configuration's record (plan, step
times, host peaks, no CUDA figures on the CPU, stream counters with no restarts and bytes copied by the streamed DiT
only), the streamed bf16 outputs equal to the resident ones bit for bit, the FP8 error between 0 and 1, both step-
time ratios of budget 24, both switch variants timed, the whole request, and a `--resume` that runs nothing again.
Nothing is left in the temporary folder the run was given (its TMPDIR), and no child process outlives it.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import tempfile
from pathlib import Path

import pytest

from benchmarks.memory_budgets import budget_runs, main
from h3engine.runtime.rank_process import rank_context

ARGUMENTS = [
    "--tiny",
    "--device",
    "cpu",
    "--budgets",
    "120,24",
    "--weights",
    "bf16,fp8",
    "--steps",
    "2",
    "--switch",
    "--whole-request",
    "2",
    "--whole-budgets",
    "24",
]


def child_processes() -> list[int]:
    """Processes whose parent is this one (the benchmark's children, if any were left running)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            children.append(int(entry.name))
    return children


def test_the_run_order_interleaves_each_budget_with_resident_runs() -> None:
    runs = budget_runs([120.0, 24.0, 16.0], ["bf16"])
    assert [run["run_id"] for run in runs] == [
        "budget:bf16:120:0",
        "budget:bf16:24:0",
        "budget:bf16:24:1",
        "budget:bf16:120:1",
        "budget:bf16:16:0",
        "budget:bf16:16:1",
        "budget:bf16:120:2",
    ]
    neighbours = {run["run_id"]: run.get("neighbour") for run in runs}
    assert neighbours["budget:bf16:24:0"] == "budget:bf16:120:0"
    assert neighbours["budget:bf16:24:1"] == "budget:bf16:120:1"
    assert neighbours["budget:bf16:16:0"] == "budget:bf16:120:1"
    assert neighbours["budget:bf16:16:1"] == "budget:bf16:120:2"
    assert len(budget_runs([120.0, 80.0, 48.0, 32.0, 24.0, 16.0], ["bf16", "fp8"])) == 32
    assert [run["run_id"] for run in budget_runs([24.0], ["fp8"])] == ["budget:fp8:24:0"]


@pytest.fixture
def fork_server() -> None:
    """The fork server the children start from, running before the test's own TMPDIR is set: its socket folder is
    this test process's (removed when it exits), as in a whole suite where ranks started it earlier."""
    rank_context()
    multiprocessing.forkserver.ensure_running()


@pytest.fixture
def private_temp(fork_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TMPDIR of the test's own, for this process and the children it starts."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_the_benchmark_at_tiny_size_on_the_cpu(tmp_path: Path, private_temp: Path) -> None:
    # Processes this one had before (in a whole suite: multiprocessing's resource tracker, Ray's) are not ours.
    earlier_children = set(child_processes())
    output_dir = tmp_path / "results"
    path = main([*ARGUMENTS, "--output-dir", str(output_dir)])
    assert path is not None and path.parent == output_dir and path.name.startswith("memory_budgets_cpu_")
    result = json.loads(path.read_text())

    assert result["device"] == "cpu" and result["versions"]["torch"]
    assert result["budget_mapping"]["120"] == "resident" and "streamed" in result["budget_mapping"]["other"]
    shape = result["shape"]
    assert shape["task"] == "t2va" and shape["width"] > shape["height"] > 0
    assert min(shape["text_rows"], shape["video_rows"], shape["audio_rows"]) > 0

    records = {record["run_id"]: record for record in result["configurations"]}
    expected = [run["run_id"] for run in budget_runs([120.0, 24.0], ["bf16", "fp8"])]
    assert list(records) == expected and result["run_order"][: len(expected)] == expected
    for run_id, record in records.items():
        assert "error" not in record, (run_id, record.get("traceback"))
        assert record["plan"]["profile"] == ("resident" if record["budget_gib"] == 120 else "streamed")
        assert record["plan"]["summary_lines"]
        assert len(record["timed"]["steps_s"]) == 2 and record["step_s"] > 0
        assert len(record["warm_up"]["steps_s"]) == 1
        timed = record["memory"]["timed"]
        assert timed["max_reserved_bytes"] is None and timed["nvidia_smi_gpu_peak_mib"] is None
        assert timed["host_peak_bytes"] > 0 and record["checks"] is None
        assert record["restarts"] == 0
        dit = record["streams"]["dit"]
        if record["budget_gib"] == 120:
            assert dit is None
        else:
            assert dit["restarts"] == 0 and dit["visits"] > 0 and dit["copied_bytes_per_step"] > 0
        if record["weights"] == "bf16":
            assert record["equal_to_resident"] is True, run_id

    fp8_errors = result["fp8_error"]["per_configuration"]
    assert set(fp8_errors) == {"budget:fp8:120:0", "budget:fp8:24:0"}
    for error in fp8_errors.values():
        assert 0 < error["video_latents"] < 1 and 0 < error["audio_latents"] < 1
    for weights in ("bf16", "fp8"):
        ratio = result["ratios"][weights]["24"]
        assert len(ratio["pairs"]) == 2 and ratio["median"] > 0
        assert all(pair["same_machine"] for pair in ratio["pairs"])

    switches = {record["run_id"]: record for record in result["switch"]}
    assert set(switches) == {"switch:warm_host", "switch:disk"}
    for record in switches.values():
        assert "error" not in record, record.get("traceback")
        assert [step["task"] for step in record["sequence"]] == ["t2va", "ref2va", "t2va"]
        assert [step["partition_after"] for step in record["sequence"]] == ["fl2va", "ref2va", "fl2va"]
        assert record["to_ref2va_s"] >= 0 and record["back_to_t2va_s"] >= 0
        assert all(step["request"]["wall_s"] > 0 for step in record["sequence"])

    (whole,) = result["whole_request"]
    assert "error" not in whole, whole.get("traceback")
    assert [request["steps"] for request in whole["requests"]] == [2]
    assert whole["requests"][0]["mp4_bytes"] > 0 and "mux_s" in whole["requests"][0]["timings_s"]

    # A resumed run finds everything measured: it starts no child and keeps the records.
    resumed = main([*ARGUMENTS, "--output-dir", str(tmp_path / "again"), "--resume", str(path)])
    assert resumed is not None and resumed.name == path.name
    again = json.loads(resumed.read_text())
    assert again["configurations"] == result["configurations"] and again["invocations"][-1]["ran"] == []

    assert list(private_temp.iterdir()) == []
    assert set(child_processes()) - earlier_children == set()
