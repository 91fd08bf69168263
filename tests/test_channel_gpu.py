"""The tensor channel under load: a producer process hands many large, changing tensors to a consumer process.

Verified run (3 slots): every tensor's name, dtype, shape and checksum (position-weighted byte sum, exact in
int64) arrives intact and is still intact just before the consumer releases it, while the producer writes later
batches into the other slots and scribbles over its sources after each send; every send after the first per
slot reuses a slot. Throughput run (2 slots): the last big send arrives whole; the GB/s (each byte copied into the
slot and out again) is printed. 200 sends, 64 MiB tensors, through CUDA IPC on one GPU (tests/test_channel.py
checks the channel on the CPU). The worker side is tests/_channel_gpu_helpers.py.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch.multiprocessing as mp
from _channel_gpu_helpers import (
    BIG_EVERY,
    THROUGHPUT_SENDS,
    THROUGHPUT_SLOTS,
    VERIFY_SLOTS,
    WARMUP_SENDS,
    WORKER_TIMEOUT_S,
    consumer_main,
    producer_main,
)

from h3engine.runtime.channel import TensorChannel

RUN_TIMEOUT_S = 540.0


@pytest.mark.parametrize(
    ("device", "sends", "big_mib"),
    [pytest.param("cuda:0", 200, 64, marks=pytest.mark.cuda, id="cuda")],
)
def test_many_changing_sends_arrive_intact_and_reuse_the_slots(device: str, sends: int, big_mib: int) -> None:
    context = mp.get_context("spawn")
    verify_channel = TensorChannel(device, VERIFY_SLOTS, "gpu check", timeout_s=WORKER_TIMEOUT_S)
    speed_channel = TensorChannel(device, THROUGHPUT_SLOTS, "gpu throughput", timeout_s=WORKER_TIMEOUT_S)
    expected, reports = context.Queue(), context.Queue()
    arguments = (verify_channel, speed_channel, expected, reports, device, sends, big_mib)
    processes = [
        context.Process(target=producer_main, args=arguments, name="channel-producer"),
        context.Process(target=consumer_main, args=arguments, name="channel-consumer"),
    ]
    for process in processes:
        process.start()
    collected: dict[str, dict] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(collected) < 2 and time.monotonic() < deadline:
        try:
            report = reports.get(timeout=1.0)
            collected[report["role"]] = report
        except queue.Empty:
            if any(process.exitcode not in (None, 0) for process in processes):
                break
    problems = []
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            problems.append(f"{process.name} (pid {process.pid}) hung; killed")
            process.kill()
            process.join()
        elif process.exitcode != 0:
            problems.append(f"{process.name} exited with code {process.exitcode}")
    for channel in (verify_channel, speed_channel):
        if not channel.close(timeout=10.0):
            problems.append(f"{channel.describe} did not close cleanly")
    for role in ("producer", "consumer"):
        report = collected.get(role)
        if report is None:
            problems.append(f"the {role} sent no report")
        elif "error" in report:
            problems.append(f"the {role} failed:\n{report['error']}")
    assert not problems, "\n".join(problems)

    producer, consumer = collected["producer"], collected["consumer"]
    assert consumer["problems"] == []
    assert producer["sends"] == sends
    # The first send into each slot is its only non-reuse (slots are taken least recently released first).
    assert producer["slot_reuses"] == producer["sends"] - VERIFY_SLOTS
    print(
        f"{sends} sends over {VERIFY_SLOTS} slots on {device}, {(sends + BIG_EVERY - 1) // BIG_EVERY} of them with "
        f"a {big_mib} MiB tensor: {consumer['checked_tensors']} tensor checks, {producer['buffer_allocations']} "
        f"slot buffers allocated, {producer['bytes_sent'] / 1e9:.2f} GB in {producer['elapsed_s']:.1f} s "
        f"(producer blocked {producer['blocked_s']:.2f} s); throughput {consumer['throughput_gb_s']:.1f} GB/s "
        f"({THROUGHPUT_SENDS - WARMUP_SENDS} x {big_mib} MiB)"
    )
