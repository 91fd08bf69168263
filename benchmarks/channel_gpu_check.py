"""CUDA IPC tensor channel on one GPU: a producer process hands tensors to a consumer process, checked and timed.

    python3 benchmarks/channel_gpu_check.py                                  # the GPU machine (one H200)
    python3 benchmarks/channel_gpu_check.py --device cpu --sends 24 --big-mib 4   # smoke test of this script

Two spawned processes, two channels made here (the engine's role: this process only joins and reports):
1. Verified run, 3 slots: 200 sends of fresh random tensors (bf16, fp32 with NaN/inf, non-contiguous fp16,
   int64, uint8, bool, 0-d, empty; shapes change with the step; every 4th send adds a 64 MiB fp32 tensor). The
   producer refills the same source tensors in place, sends them, and scribbles zeros over them right after
   `send` returns. It reports each send's checksums first, through a separate queue. The consumer checks every
   tensor's name, dtype, shape and checksum (position-weighted byte sum, exact int64) on arrival, keeps the two
   newest batches, and checks each one again just before it releases it, while the producer is already
   writing later batches into the other slots.
2. Throughput, 2 slots: 64 MiB fp32 sends, the consumer copying each one out into its own tensor; the GB/s count
   the 64 MiB delivered per second after a warm-up, each byte copied twice (into the slot, out of it).
Prints one PASS/FAIL line (and the problems above it); exit code 1 on any mismatch, error or hang.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import traceback
from collections import deque
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))

from h3engine.runtime.channel import TensorChannel  # noqa: E402

VERIFY_SLOTS = 3
HOLD_WINDOW = 2
BIG_EVERY = 4
THROUGHPUT_SLOTS = 2
THROUGHPUT_SENDS = 60
WARMUP_SENDS = 5
WORKER_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 540.0
SHOWN_PROBLEMS = 10


def step_tensors(step: int, device: str, big_mib: int) -> dict[str, torch.Tensor]:
    """Fresh values for send `step`, the same in every process and run."""
    generator = torch.Generator(device=device).manual_seed(1000 + step)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    fp32 = normal(1 + step % 13, 257)
    fp32.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], device=device)
    tensors = {
        "latents_bf16": normal(16, 7 + step % 5, 33).to(torch.bfloat16),
        "odd_fp32": fp32,
        "transposed_fp16": normal(48, 31).to(torch.float16).t(),
        "positions_int64": torch.randint(
            -(2**40), 2**40, (3, 1000 + step), generator=generator, device=device
        ),
        "audio_uint8": torch.randint(0, 256, (4097,), generator=generator, device=device, dtype=torch.uint8),
        "mask_bool": torch.rand(61, 3, generator=generator, device=device) > 0.5,
        "scalar_fp32": normal(1).reshape(()),
        "empty_bf16": torch.empty(0, 8, dtype=torch.bfloat16, device=device),
    }
    if step % BIG_EVERY == 0:
        tensors["big_fp32"] = normal(big_mib * (1 << 20) // (4 * 4096), 4096)
    return tensors


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Position-weighted sums of each tensor's bytes (exact in int64), with one device sync for all of them."""
    sums = []
    for tensor in tensors:
        data = tensor.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        weights = torch.arange(data.numel(), device=data.device) % 65521 + 1
        sums.append((data * weights).sum())
    return torch.stack(sums).tolist() if sums else []


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def producer_main(
    verify_channel, speed_channel, expected, reports, device: str, sends: int, big_mib: int
) -> None:
    try:
        producer = verify_channel.producer()
        sources: dict[str, torch.Tensor] = {}
        started = time.perf_counter()
        for step in range(sends):
            fresh = step_tensors(step, device, big_mib)
            batch = {}
            for name, values in fresh.items():
                source = sources.get(name)
                if source is None or source.shape != values.shape:
                    # Same strides as the fresh values: the transposed one stays a non-contiguous source.
                    source = torch.empty_strided(
                        values.shape, values.stride(), dtype=values.dtype, device=device
                    )
                    sources[name] = source
                batch[name] = source.copy_(values)
            entries = [(name, str(tensor.dtype), tuple(tensor.shape)) for name, tensor in batch.items()]
            expected.put((step, entries, checksums(list(batch.values()))))
            producer.send(batch, step, WORKER_TIMEOUT_S)
            for source in batch.values():
                source.zero_()
        synchronize(device)
        elapsed_s = time.perf_counter() - started
        producer.close(WORKER_TIMEOUT_S)
        stats = producer.stats

        speed_producer = speed_channel.producer()
        big = torch.empty(big_mib * (1 << 20) // 4, dtype=torch.float32, device=device)
        for step in range(THROUGHPUT_SENDS):
            big.fill_(float(step))
            speed_producer.send({"big": big}, step, WORKER_TIMEOUT_S)
        speed_producer.close(WORKER_TIMEOUT_S)
        reports.put(
            {
                "role": "producer",
                "sends": stats.sends,
                "slot_reuses": stats.slot_reuses,
                "buffer_allocations": stats.buffer_allocations,
                "bytes_sent": stats.bytes_sent,
                "blocked_s": stats.blocked_s,
                "elapsed_s": elapsed_s,
            }
        )
    except BaseException:
        reports.put({"role": "producer", "error": traceback.format_exc()})


def consumer_main(
    verify_channel, speed_channel, expected, reports, device: str, sends: int, big_mib: int
) -> None:
    try:
        consumer = verify_channel.consumer()
        problems: list[str] = []
        checked_tensors = 0
        held: deque[tuple[int, dict[str, torch.Tensor], list, list[int]]] = deque()

        def check(
            when: str, step: int, tensors: dict[str, torch.Tensor], entries: list, sums: list[int]
        ) -> None:
            nonlocal checked_tensors
            got = [(name, str(tensor.dtype), tuple(tensor.shape)) for name, tensor in tensors.items()]
            if got != entries:
                problems.append(f"send {step} ({when}): got {got}, sent {entries}")
                return
            for (name, _, _), got_sum, sent_sum in zip(
                entries, checksums(list(tensors.values())), sums, strict=True
            ):
                checked_tensors += 1
                if got_sum != sent_sum:
                    problems.append(f"send {step} ({when}): {name} checksum {got_sum}, sent {sent_sum}")

        def release_oldest() -> None:
            step, tensors, entries, sums = held.popleft()
            check("before release", step, tensors, entries, sums)
            consumer.release(step)

        for index in range(sends):
            step, tensors = consumer.receive(WORKER_TIMEOUT_S)
            sent_step, entries, sums = expected.get(timeout=WORKER_TIMEOUT_S)
            if step != sent_step:
                problems.append(f"received send {step} where send {sent_step} was due")
            check("on arrival", step, tensors, entries, sums)
            held.append((step, tensors, entries, sums))
            if len(held) > HOLD_WINDOW:
                release_oldest()
            if index % 7 == 3:
                time.sleep(0.002)  # uneven pace: the producer sometimes finds every slot in flight
        while held:
            release_oldest()
        # Received views must not outlive the consumer: they keep the producer's CUDA memory referenced.
        del tensors
        consumer.close()

        speed_consumer = speed_channel.consumer()
        own = None
        started = 0.0
        for index in range(THROUGHPUT_SENDS):
            if index == WARMUP_SENDS:
                synchronize(device)
                started = time.perf_counter()
            with speed_consumer.receiving(WORKER_TIMEOUT_S) as (_, tensors):
                own = torch.empty_like(tensors["big"]) if own is None else own
                own.copy_(tensors["big"])
        synchronize(device)
        throughput_s = time.perf_counter() - started
        last = float(THROUGHPUT_SENDS - 1)
        wrong = int((own != last).sum())
        if wrong:
            problems.append(f"throughput run: {wrong} values of the last 64 MiB send are not {last}")
        speed_consumer.close()
        reports.put(
            {
                "role": "consumer",
                "problems": problems,
                "checked_tensors": checked_tensors,
                "throughput_gb_s": (THROUGHPUT_SENDS - WARMUP_SENDS) * own.numel() * 4 / throughput_s / 1e9,
            }
        )
    except BaseException:
        reports.put({"role": "consumer", "error": traceback.format_exc()})


def run(device: str, sends: int, big_mib: int) -> tuple[bool, list[str], str]:
    """(passed, problems, summary) of one producer -> consumer run."""
    context = mp.get_context("spawn")
    verify_channel = TensorChannel(device, VERIFY_SLOTS, "gpu check", timeout_s=WORKER_TIMEOUT_S)
    speed_channel = TensorChannel(device, THROUGHPUT_SLOTS, "gpu throughput", timeout_s=WORKER_TIMEOUT_S)
    expected = context.Queue()
    reports = context.Queue()
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
    if problems or len(collected) < 2:
        return False, problems, f"{sends} sends over {VERIFY_SLOTS} slots did not complete"
    producer, consumer = collected["producer"], collected["consumer"]
    problems += consumer["problems"]
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    summary = (
        f"{producer['sends']} sends over {VERIFY_SLOTS} slots on {where}, "
        f"{(sends + BIG_EVERY - 1) // BIG_EVERY} of them with a {big_mib} MiB tensor: "
        f"{len(consumer['problems'])} mismatches in {consumer['checked_tensors']} tensor checks (on arrival and "
        f"before release), {producer['slot_reuses']} slot reuses, {producer['buffer_allocations']} slot buffers "
        f"allocated, {producer['bytes_sent'] / 1e9:.2f} GB in {producer['elapsed_s']:.1f} s with checksums "
        f"(producer blocked {producer['blocked_s']:.2f} s); throughput {consumer['throughput_gb_s']:.1f} GB/s "
        f"({THROUGHPUT_SENDS - WARMUP_SENDS} x {big_mib} MiB, each copied into a slot and out again)"
    )
    # The first send into each slot is its only non-reuse (slots are taken least recently released first).
    if producer["slot_reuses"] != producer["sends"] - VERIFY_SLOTS:
        problems.append(
            f"expected {producer['sends'] - VERIFY_SLOTS} slot reuses, counted {producer['slot_reuses']}"
        )
    return not problems, problems, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a smoke test of this script")
    parser.add_argument("--sends", type=int, default=200)
    parser.add_argument("--big-mib", type=int, default=64, help="size of the big tensor (MiB)")
    arguments = parser.parse_args()
    if arguments.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL channel_gpu_check: no CUDA GPU visible to torch", flush=True)
        return 1
    started = time.perf_counter()
    passed, problems, summary = run(arguments.device, arguments.sends, arguments.big_mib)
    for problem in problems[:SHOWN_PROBLEMS]:
        print(f"  problem: {problem}", flush=True)
    if len(problems) > SHOWN_PROBLEMS:
        print(f"  ... and {len(problems) - SHOWN_PROBLEMS} more problems", flush=True)
    verdict = "PASS" if passed else "FAIL"
    print(
        f"{verdict} channel_gpu_check (pid {os.getpid()}, {time.perf_counter() - started:.0f} s): {summary}",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
