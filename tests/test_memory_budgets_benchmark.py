"""benchmarks/memory_budgets.py at tiny size on the CPU: its run order, its JSON, and what it leaves behind.

One run of the module's `main` (`--tiny --device cpu --budgets 120,24 --weights bf16,fp8 --steps 2 --switch`, plus
one whole request of 2 steps) makes 11 child processes (forked from the engine's rank server, under the test's
TMPDIR). What is checked: the interleaved order R B B R per weight format, each configuration's record (plan, step
times, host peaks, no CUDA figures on the CPU, stream counters with no restarts and bytes copied by the streamed DiT
only), the streamed bf16 outputs equal to the resident ones bit for bit, the FP8 error between 0 and 1, both step-
time ratios of budget 24, both switch variants timed, the whole request, and a `--resume` that runs nothing again.
Nothing is left in the temporary folder the run was given (its TMPDIR), and no child process outlives it. The memory
options: the flags parse; `--host-limit` is refused with a reason where cgroup v2 cannot be used, and in a stand-in
cgroup tree (tmp_path) the parent writes memory.max, the child its pid, and the folder goes; `--drop-caches` says when
it could not; a child its cgroup's OOM killer ends is "killed for memory"; `--real-bytes` with a host budget below the
streamed models' size reads their layers from the files (read_bytes > 0), AdaLN tables computed, then cached.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.memory_budgets as memory_budgets
from benchmarks.memory_budgets import (
    GIB,
    KILLED_FOR_MEMORY,
    budget_runs,
    caveats,
    drop_caches,
    main,
    make_cgroup,
    parse_arguments,
)
from h3engine.memory.plan import ModelPlacement
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


def test_the_memory_flags_parse_and_a_time_limit_stops_before_any_child(tmp_path: Path) -> None:
    args = parse_arguments(
        [
            "--tiny",
            "--host-limit",
            "12.5",
            "--drop-caches",
            "--real-bytes",
            "--adaln-cache",
            "off",
            "--disk-read-gbps",
            "1.9",
            "--activation-chunks",
            "4",
            "--host-memory",
            "8",
        ]
    )
    assert (args.host_limit, args.drop_caches, args.adaln_cache) == (12.5, True, "off")
    assert (args.disk_read_gbps, args.activation_chunks, args.host_memory) == ("1.9", "4", 8.0)
    assert args.real_bytes == "dit,text_encoder,video_vae"
    assert parse_arguments(["--real-bytes", "video_vae,dit"]).real_bytes == "dit,video_vae"
    assert parse_arguments([]).real_bytes is None and parse_arguments([]).host_limit is None
    for wrong in (["--real-bytes", "dit,nope"], ["--checkpoint", "x", "--real-bytes"], ["--host-limit", "0"]):
        with pytest.raises(SystemExit) as exit_:
            parse_arguments(wrong)
        assert exit_.value.code == 2
    # --time-limit below any child's estimate: nothing runs (no checkpoint made), the JSON says where it stopped.
    path = main(
        ["--tiny", "--device", "cpu", "--budgets", "24", "--time-limit", "1", "--output-dir", str(tmp_path)]
    )
    result = json.loads(path.read_text())
    assert (
        result["configurations"] == [] and result["invocations"][-1]["stopped_before"] == "budget:bf16:24:0"
    )
    assert result["settings"]["engine_options"]["adaln_cache"].startswith("a folder per child")


def test_host_limit_and_drop_caches_say_why_where_the_machine_refuses(tmp_path: Path) -> None:
    folder, why = make_cgroup("h3-bench-test", GIB, root=tmp_path / "no-cgroup2")
    assert folder is None and "no cgroup v2" in why
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu pids\n")
    folder, why = make_cgroup("h3-bench-test", GIB, root=tmp_path / "v2")
    assert folder is None and "memory controller is not available" in why
    assert list((tmp_path / "v2").iterdir()) == [tmp_path / "v2" / "cgroup.controllers"]
    refused = drop_caches(tmp_path / "no-proc" / "drop_caches")
    assert refused["done"] is False and "drop_caches" in refused["why"]


def test_caveats_name_the_hole_files_a_plan_reads_layers_from() -> None:
    streamed = ModelPlacement(layers="streamed", home="mapped", ring_depth=2)
    partly = ModelPlacement(layers="streamed", home="pinned", ring_depth=2, mapped_layers=3)
    plan = SimpleNamespace(
        models={"dit": partly, "text_encoder": streamed, "audio_vae": ModelPlacement()}, adaln_home="device"
    )
    engine = SimpleNamespace(plan=plan)
    (line,) = caveats({"placeholder": True, "real_bytes": []}, engine)
    assert "(dit, text_encoder)" in line and "--real-bytes" in line
    (line,) = caveats({"placeholder": True, "real_bytes": ["dit"]}, engine)
    assert "(text_encoder)" in line
    assert caveats({"placeholder": True, "real_bytes": ["dit", "text_encoder"]}, engine) == []
    assert caveats({"placeholder": False, "real_bytes": []}, engine) == []


def fake_cgroup_root(tmp_path: Path) -> Path:
    """A stand-in for /sys/fs/cgroup: cgroup v2 with the memory controller available, not yet enabled for children."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("\n")
    return root


def test_a_child_its_cgroup_kills_is_recorded_as_killed_for_memory(
    tmp_path: Path, private_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory_budgets, "CGROUP_ROOT", fake_cgroup_root(tmp_path))

    def killed(spec: dict, name: str, timeout: float, cgroup: Path | None) -> tuple[int, float, int]:
        assert cgroup is not None and spec["cgroup"] == str(cgroup)
        (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
        return -signal.SIGKILL, 0.5, 3 * GIB

    monkeypatch.setattr(memory_budgets, "start_child", killed)
    arguments = [
        "--tiny",
        "--device",
        "cpu",
        "--budgets",
        "24",
        "--weights",
        "bf16",
        "--host-limit",
        "2",
        "--output-dir",
        str(tmp_path),
    ]
    path = main(arguments)
    (record,) = json.loads(path.read_text())["configurations"]
    assert record["outcome"] == KILLED_FOR_MEMORY and "traceback" not in record
    assert record["host_limit"]["enforced"] is True and record["host_limit"]["oom_kills"] == 1
    assert record["host_limit"]["peak_bytes"] == 3 * GIB and record["host_limit"]["removed"] is True
    # A result, not a failure: a resumed run does not start it again.
    again = json.loads(main([*arguments, "--resume", str(path)]).read_text())
    assert again["invocations"][-1]["ran"] == [] and again["configurations"] == [record]
    assert sorted(entry.name for entry in (tmp_path / "cgroup").iterdir()) == [
        "cgroup.controllers",
        "cgroup.subtree_control",
    ]
    assert list(private_temp.iterdir()) == []


def test_real_bytes_in_a_stand_in_cgroup_read_layers_from_the_files(
    tmp_path: Path, private_temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier_children = set(child_processes())
    root = fake_cgroup_root(tmp_path)
    monkeypatch.setattr(memory_budgets, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory_budgets, "DROP_CACHES_PATH", tmp_path / "no-proc" / "drop_caches")
    seen: dict[str, dict[str, str]] = {}
    remove = memory_budgets.remove_cgroup

    def remove_and_remember(folder: Path, wait_s: float = 5.0) -> str | None:
        seen[folder.name] = {entry.name: entry.read_text() for entry in folder.iterdir()}
        return remove(folder, wait_s)

    monkeypatch.setattr(memory_budgets, "remove_cgroup", remove_and_remember)
    path = main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--budgets",
            "24",
            "--weights",
            "bf16",
            "--steps",
            "2",
            "--real-bytes",
            # Below the tiny streamed models' layers (~110 kB): the CPU plan reads them all from the files.
            "--host-memory",
            "0.000001",
            "--host-limit",
            "8",
            "--drop-caches",
            "--output-dir",
            str(tmp_path / "results"),
        ]
    )
    result = json.loads(path.read_text())
    assert (
        result["real_bytes"] == ["dit", "text_encoder", "video_vae"] and "real bytes" in result["checkpoint"]
    )
    (record,) = result["configurations"]
    assert record["outcome"] == "done", record.get("traceback")
    assert record["caveats"] == [] and result["warnings"] == []

    # The cgroup: memory.max by the parent, the child's own pid by the child, the folder gone afterwards.
    limit = record["host_limit"]
    assert limit["enforced"] is True and limit["gib"] == 8 and limit["removed"] is True
    name = Path(limit["cgroup"]).name
    assert name.startswith(f"h3-bench-{os.getpid()}-") and Path(limit["cgroup"]).parent == root
    assert seen[name]["memory.max"] == str(8 * GIB) and seen[name]["cgroup.procs"] == str(record["pid"])
    assert (root / "cgroup.subtree_control").read_text() == "+memory" and not (root / name).exists()
    assert record["drop_caches"]["done"] is False and "drop_caches" in record["drop_caches"]["why"]

    # Layers read from the real-bytes files by the streams' reader threads.
    assert {name for name, model in record["plan"]["models"].items() if model["home"] == "mapped"} == {
        "dit",
        "text_encoder",
        "video_vae",
    }
    dit = record["streams"]["dit"]
    assert dit["read_bytes"] > 0 and dit["layer_reads"] > 0 and dit["file_home_layers"] == dit["layers"]
    assert dit["host_bytes"] == 0 and dit["host_ring_buffers"] > 0 and dit["restarts"] == 0
    assert record["disk"]["stream_read_bytes_per_step"] >= record["disk"]["dit_read_bytes_per_step"] > 0
    assert record["warm_up"]["streams"]["text_encoder"]["read_bytes"] > 0  # it encodes in the warm-up only
    assert record["disk"]["block_device_read_bytes"] is None or record["disk"]["block_device_read_bytes"] >= 0
    assert record["adaln_tables"] == {"first": "computed", "later": "cache"}
    assert record["later"]["latents_equal_to_first"] is True and len(record["later"]["steps_s"]) == 2
    assert record["rss_peak_bytes"] > 0 and "Cached" in record["page_cache"]["source"]
    assert record["predicted_step_s"] is not None and "disk_bytes_per_second" in record["plan"]["context"]

    assert list(private_temp.iterdir()) == []
    assert set(child_processes()) - earlier_children == set()
