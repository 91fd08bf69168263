"""Tensor channel (h3engine.runtime.channel) between processes, on shared memory and on CUDA IPC.

Two scenarios of two processes per device, each run once for the module. The CPU's processes are forked from this
test process's fork server, as the engine's ranks are (conftest.py; a spawned one imports torch again: ~1.5 s of
CPU); the CUDA ones are spawned, as the CUDA tests of tests/test_channel_gpu.py are:
* exchange: a producer and a consumer process. Every dtype/shape case (fp32 with NaN/inf/-0.0, bf16, fp16, fp64,
  int64, int32, uint8, bool, 0-d, empty, transposed, strided, expanded) arrives byte for byte, packed together and
  one per send; 24 sends of 4 KB - 1.2 MB over 3 slots, the producer scribbling over its source after each send
  and the consumer holding two batches and checking them again just before it releases them; a send that times
  out while the consumer holds every slot, then blocks until it releases one; teardown consumer -> producer ->
  channel with nothing left behind.
* peer death: a survivor and a process that dies (os._exit) holding a slot, with one channel each way; the
  survivor's blocked send and its receive fail with ChannelPeerGone within seconds, and its endpoints close at once.
The CUDA variants run the same scenarios through CUDA IPC on one GPU; they skip without a GPU. The rest runs on
the CPU in this process (there the channel allows both ends in one process): argument checks, timeouts, tags,
closing while blocked, the size of what crosses the queue.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _channel_helpers import (
    BACKPRESSURE_TIMEOUT_S,
    DEATH_SLOTS,
    DOOMED_EXIT_CODE,
    EXCHANGE_SLOTS,
    HOLD_S,
    REUSE_SENDS,
    SEED,
    WORKER_TIMEOUT_S,
    case_tensors,
    doomed,
    exchange_consumer,
    exchange_producer,
    survivor,
)
from _runtime_helpers import still_running

from h3engine.runtime.channel import TensorChannel
from h3engine.runtime.channel_errors import ChannelClosed, ChannelError, ChannelTimeout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
COLLECT_TIMEOUT_S = 90.0
# A death or a closing flag is seen within the channel's 50 ms poll; this leaves room for a loaded machine.
DETECTION_LIMIT_S = 3.0
SHARED_MEMORY = Path("/dev/shm")


# --------------------------------------------------------------------------------------------------------------
# Running workers and looking for leftovers
# --------------------------------------------------------------------------------------------------------------


def shared_memory_entries() -> set[str]:
    return set(os.listdir(SHARED_MEMORY)) if SHARED_MEMORY.is_dir() else set()


def mapped_shared_memory(entries: set[str]) -> set[str]:
    """Those of `entries` (in /dev/shm) that this process has mapped, its segments and named semaphores, matched
    by inode (a semaphore is mapped under the temporary name it was made with): with other test processes running
    beside this one, a new entry in /dev/shm may be theirs."""
    with open("/proc/self/maps") as maps:
        inodes = {int(fields[4]) for fields in (line.split() for line in maps) if len(fields) > 5}
    mapped = set()
    for name in entries:
        try:
            if (SHARED_MEMORY / name).stat().st_ino in inodes:
                mapped.add(name)
        except OSError:
            continue
    return mapped


def child_pids() -> set[int]:
    """Live children of this process, except multiprocessing's resource tracker and fork server (one each per test
    process, not ours)."""
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, parent = stat[stat.rindex(b")") + 2 :].split()[:2]
        if (
            int(parent) == os.getpid()
            and state != b"Z"
            and b"resource_tracker" not in command
            and b"forkserver" not in command
        ):
            children.add(int(entry.name))
    return children


@dataclass
class WorkerRun:
    reports: dict[str, dict]
    exit_codes: dict[str, int | None]
    channels_closed_cleanly: list[bool]
    leftover_shared_memory: set[str]
    leftover_children: set[int]

    def report(self, role: str) -> dict:
        report = self.reports.get(role)
        assert report is not None, f"the {role} sent no report (exit codes {self.exit_codes})"
        assert "error" not in report, f"the {role} failed:\n{report['error']}"
        return report


def run_workers(
    make_channels: Callable[[], list[TensorChannel]],
    workers: dict[str, Callable],
    extra_arguments: Callable[[mp.context.BaseContext], tuple],
    device: str,
) -> WorkerRun:
    """Start one process per worker with (channels..., reports, extras...), collect one report from each, join
    them, close the channels in this (the engine's) process, and look for shared memory and children left over."""
    shared_memory_before = shared_memory_entries()
    children_before = child_pids()
    context = mp.get_context("forkserver" if device == "cpu" else "spawn")
    channels = make_channels()
    reports_queue = context.Queue()
    extras = extra_arguments(context)
    # Whatever the channel and the queues created here must be gone once they are closed and dropped.
    created_here = mapped_shared_memory(shared_memory_entries() - shared_memory_before)
    processes = {
        role: context.Process(target=target, args=(*channels, reports_queue, *extras), name=f"channel-{role}")
        for role, target in workers.items()
    }
    for process in processes.values():
        process.start()
    reports: dict[str, dict] = {}
    deadline = time.monotonic() + COLLECT_TIMEOUT_S
    while len(reports) < len(processes) and time.monotonic() < deadline:
        try:
            report = reports_queue.get(timeout=0.2)
            reports[report["role"]] = report
        except queue.Empty:
            if any(
                process.exitcode is not None and role not in reports for role, process in processes.items()
            ):
                break
    while True:  # a report that was still in the pipe when its worker's exit was seen
        try:
            report = reports_queue.get(timeout=0.5)
            reports[report["role"]] = report
        except queue.Empty:
            break
    for process in processes.values():
        process.join(timeout=WORKER_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    worker_pids = [process.pid for process in processes.values()]
    exit_codes = {role: process.exitcode for role, process in processes.items()}
    closed_cleanly = [channel.close(timeout=5.0) for channel in channels]
    del channels, reports_queue, extras, processes
    gc.collect()
    after = shared_memory_entries()
    torch_segments = {
        name
        for name in after - shared_memory_before
        if any(f"torch_{pid}_" in name or f"pym-{pid}-" in name for pid in worker_pids)
    }
    return WorkerRun(
        reports,
        exit_codes,
        closed_cleanly,
        (created_here & after) | torch_segments,
        # The CPU's workers are the fork server's children, not this process's: looked for by their pids.
        (child_pids() - children_before) | set(still_running(worker_pids, within_s=0)),
    )


# --------------------------------------------------------------------------------------------------------------
# Exchange: dtypes and shapes, slot reuse, backpressure, teardown
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=DEVICES)
def exchange(request) -> WorkerRun:
    device = request.param
    return run_workers(
        lambda: [TensorChannel(device, EXCHANGE_SLOTS, "exchange test", timeout_s=WORKER_TIMEOUT_S)],
        {"producer": exchange_producer, "consumer": exchange_consumer},
        lambda context: (context.Event(), device),
        device,
    )


def test_every_dtype_and_shape_arrives_bit_identical(exchange):
    consumer = exchange.report("consumer")
    names = sorted(case_tensors(SEED))
    assert consumer["case_mismatches"] == []
    assert consumer["received_names"][0] == ("cases:all", names)
    assert consumer["received_names"][1:] == [(f"case:{name}", [name]) for name in case_tensors(SEED)]


def test_slots_are_reused_and_a_held_slot_is_never_overwritten(exchange):
    producer = exchange.report("producer")
    assert exchange.report("consumer")["reuse_mismatches"] == []
    sends = 1 + len(case_tensors(SEED)) + REUSE_SENDS
    assert producer["reuse_sends"] == sends
    # Every slot's first send is not a reuse; every later one is.
    assert producer["reuse_slot_reuses"] == sends - EXCHANGE_SLOTS
    # One buffer per slot, then the 1.2 MB sends outgrow the first 1 MiB buffers, at most once per slot.
    assert EXCHANGE_SLOTS < producer["reuse_buffer_allocations"] <= 2 * EXCHANGE_SLOTS


def test_send_blocks_while_the_consumer_holds_every_slot(exchange):
    producer = exchange.report("producer")
    consumer = exchange.report("consumer")
    consumer_pid = consumer["pid"]
    assert producer["timeout_error"] == (
        f"tensor channel 'exchange test': no free slot within {BACKPRESSURE_TIMEOUT_S:.1f} s; all "
        f"{EXCHANGE_SLOTS} slots are in flight and the consumer (pid {consumer_pid}) has released none"
    )
    assert BACKPRESSURE_TIMEOUT_S <= producer["timeout_after_s"] < BACKPRESSURE_TIMEOUT_S + DETECTION_LIMIT_S
    # The consumer released its first slot HOLD_S after the timed-out send; the retry waited for that.
    assert 0.8 * HOLD_S <= producer["blocked_s"] < HOLD_S + DETECTION_LIMIT_S
    assert consumer["hold_tags"] == [f"hold:{index}" for index in range(EXCHANGE_SLOTS)]
    assert consumer["extra_tag"] == "hold:extra"


def test_teardown_runs_consumer_then_producer_then_channel_and_leaves_nothing(exchange):
    producer = exchange.report("producer")
    consumer = exchange.report("consumer")
    assert (
        consumer["end_error"]
        == "tensor channel 'exchange test': the producer closed its end; nothing more comes"
    )
    # The producer started closing first, and its close returned only after the consumer had closed.
    assert producer["close_started_at"] < consumer["closing_at"] < producer["close_returned_at"]
    assert exchange.exit_codes == {"producer": 0, "consumer": 0}
    assert exchange.channels_closed_cleanly == [True]
    assert exchange.leftover_children == set()
    assert exchange.leftover_shared_memory == set()


# --------------------------------------------------------------------------------------------------------------
# Peer death
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=DEVICES)
def peer_death(request) -> WorkerRun:
    device = request.param
    return run_workers(
        lambda: [
            TensorChannel(device, DEATH_SLOTS, "to doomed", timeout_s=WORKER_TIMEOUT_S),
            TensorChannel(device, DEATH_SLOTS, "from doomed", timeout_s=WORKER_TIMEOUT_S),
        ],
        {"survivor": survivor, "doomed": doomed},
        lambda context: (context.Event(), device),
        device,
    )


def test_a_dead_consumer_fails_the_blocked_send_within_seconds(peer_death):
    survivor_report = peer_death.report("survivor")
    doomed_report = peer_death.report("doomed")
    assert doomed_report["held_tag"] == "first"
    assert survivor_report["send_error"] == (
        "ChannelPeerGone",
        f"tensor channel 'to doomed': the consumer process (pid {doomed_report['pid']}) exited; "
        f"nothing more can be sent",
    )
    # One send fits the second slot; the next blocks (the dead process holds "first") until the death is seen.
    assert survivor_report["sent_before_failure"] <= 1
    assert 0 < survivor_report["send_failed_at"] - doomed_report["died_at"] < DETECTION_LIMIT_S


def test_a_dead_producer_fails_the_receive(peer_death):
    survivor_report = peer_death.report("survivor")
    doomed_pid = peer_death.report("doomed")["pid"]
    assert survivor_report["received_tag"] == "hello"
    assert survivor_report["receive_error"] == (
        "ChannelPeerGone",
        f"tensor channel 'from doomed': the producer process (pid {doomed_pid}) exited; its slot buffers are gone",
    )
    assert survivor_report["receive_failed_after_s"] < DETECTION_LIMIT_S


def test_endpoints_and_channels_close_at_once_when_the_other_side_is_dead(peer_death):
    # Every assertion carries the whole run, so a failure on the GPU machine says which part went wrong.
    facts = {
        "survivor": peer_death.report("survivor"),
        "exit_codes": peer_death.exit_codes,
        "channels_closed_cleanly": peer_death.channels_closed_cleanly,
        "leftover_children": peer_death.leftover_children,
        "leftover_shared_memory": peer_death.leftover_shared_memory,
    }
    assert facts["survivor"]["close_s"] < DETECTION_LIMIT_S, facts
    assert peer_death.exit_codes == {"survivor": 0, "doomed": DOOMED_EXIT_CODE}, facts
    assert peer_death.channels_closed_cleanly == [True, True], facts
    assert peer_death.leftover_children == set(), facts
    assert peer_death.leftover_shared_memory == set(), facts


# --------------------------------------------------------------------------------------------------------------
# In one process (CPU)
# --------------------------------------------------------------------------------------------------------------


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="runs on 'cpu' or a CUDA device, got 'meta'"):
        TensorChannel("meta")
    with pytest.raises(ValueError, match="needs at least one slot, got 0"):
        TensorChannel("cpu", slots=0)
    channel = TensorChannel("cpu", name="arguments")
    producer = channel.producer()
    with pytest.raises(ValueError, match="'mask' is not a dense tensor"):
        producer.send({"mask": [1, 2]}, "tag")
    with pytest.raises(ValueError, match="'sparse' is not a dense tensor"):
        producer.send({"sparse": torch.eye(3).to_sparse()}, "tag")
    producer.close()
    assert channel.close(timeout=1.0)


def test_each_side_is_claimed_once():
    channel = TensorChannel("cpu", name="claims")
    producer = channel.producer()
    consumer = channel.consumer()
    message = rf"tensor channel 'claims' already has a producer \(pid {os.getpid()}\)"
    with pytest.raises(ChannelError, match=message):
        channel.producer()
    consumer.close()
    producer.close()
    assert channel.close(timeout=1.0)
    with pytest.raises(ChannelClosed, match="'claims' is closing; no consumer can attach"):
        channel.consumer()


def test_receive_without_a_producer_times_out_with_a_clear_error():
    channel = TensorChannel("cpu", name="quiet")
    consumer = channel.consumer()
    started = time.monotonic()
    with pytest.raises(ChannelTimeout, match=r"^tensor channel 'quiet': nothing received within 0\.2 s$"):
        consumer.receive(timeout=0.2)
    assert time.monotonic() - started < DETECTION_LIMIT_S
    consumer.close()
    assert channel.close(timeout=1.0)


def test_send_without_a_consumer_times_out_once_the_slots_are_full():
    channel = TensorChannel("cpu", slots=1, name="unheard")
    producer = channel.producer()
    producer.send({"x": torch.ones(3)}, "first")
    message = r"no free slot within 0\.2 s; all 1 slots are in flight and no consumer has attached$"
    with pytest.raises(ChannelTimeout, match=message):
        producer.send({"x": torch.ones(3)}, "second", timeout=0.2)
    producer.close(timeout=0.1)
    assert channel.close(timeout=1.0)


def test_tags_are_unique_in_flight_and_a_release_names_a_held_tag():
    channel = TensorChannel("cpu", slots=2, name="tags")
    producer = channel.producer()
    consumer = channel.consumer()
    producer.send({"x": torch.arange(4)}, "a")
    message = r"the consumer \(pid \d+\) still holds the send tagged 'a' after 0\.2 s; tags must be unique"
    with pytest.raises(ChannelTimeout, match=message):
        producer.send({"x": torch.arange(4)}, "a", timeout=0.2)
    tag, tensors = consumer.receive(timeout=5.0)
    assert tag == "a" and torch.equal(tensors["x"], torch.arange(4))
    with pytest.raises(ValueError, match="no received slot is held under tag 'b'"):
        consumer.release("b")
    consumer.release("a")
    # Sent at once after the release: the send waits for that release to come through the queue.
    producer.send({"x": torch.arange(5)}, "a", timeout=5.0)
    with consumer.receiving(timeout=5.0) as (tag, tensors):
        assert tag == "a" and torch.equal(tensors["x"], torch.arange(5))
    consumer.close()
    producer.close()
    assert channel.close(timeout=1.0)


def test_closing_the_channel_wakes_a_blocked_receive():
    channel = TensorChannel("cpu", name="shutdown")
    consumer = channel.consumer()
    closed_cleanly = []
    closer = threading.Timer(0.2, lambda: closed_cleanly.append(channel.close(timeout=5.0)))
    closer.start()
    started = time.monotonic()
    with pytest.raises(ChannelClosed, match="'shutdown': the engine closed the channel"):
        consumer.receive(timeout=30.0)
    assert time.monotonic() - started < DETECTION_LIMIT_S
    consumer.close()
    closer.join()
    assert closed_cleanly == [True]


def test_only_small_messages_cross_the_queue():
    channel = TensorChannel("cpu", slots=1, name="small")
    producer = channel.producer()
    consumer = channel.consumer()
    big = torch.randn(1 << 20)  # 4 MB
    # Read the raw payloads the engine process could see (then hand them on): the 4 MB travel in the slot.
    producer.send({"latents": big}, "first")
    first = channel._messages.get(timeout=5.0)
    channel._messages.put(first)
    with consumer.receiving(timeout=5.0) as (_, tensors):
        assert torch.equal(tensors["latents"], big)
    producer.send({"latents": big}, "second")
    second = channel._messages.get(timeout=5.0)
    assert len(first) < 2048  # slot, tag, one placement and the new buffer's file descriptor handle
    assert len(second) < len(first) - 100  # the same slot again: its buffer is not announced twice
    consumer.close()
    producer.close()
    assert channel.close(timeout=1.0)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
)
def test_in_process_round_trip_keeps_every_byte(dtype):
    channel = TensorChannel("cpu", name="round trip")
    producer = channel.producer()
    consumer = channel.consumer()
    source = (torch.randn(5, 7, generator=torch.Generator().manual_seed(3)) * 50).to(dtype)
    producer.send({"x": source.t(), "scalar": source[1, 2]}, 0)
    source.zero_()
    with consumer.receiving(timeout=5.0) as (_, tensors):
        expected = (torch.randn(5, 7, generator=torch.Generator().manual_seed(3)) * 50).to(dtype)
        assert torch.equal(tensors["x"], expected.t()) and tensors["x"].is_contiguous()
        assert tensors["scalar"].shape == () and torch.equal(tensors["scalar"], expected[1, 2])
    consumer.close()
    producer.close()
    assert channel.close(timeout=1.0)
