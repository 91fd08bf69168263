"""Spawned side of tests/test_channel_gpu.py: a producer and a consumer of many large, changing tensors.

Kept apart from the test module so that a spawned worker imports only torch and the channel. Run 1 (3 slots):
fresh tensors of every kind each send (every 4th with a big fp32 tensor); the producer scribbles zeros over its
sources right after `send`, reports each send's checksums first through a separate queue, and the consumer checks
every tensor on arrival and again just before it releases it (it holds the two newest batches). Run 2 (2 slots):
big fp32 sends copied out by the consumer, for the throughput. Each worker puts one report on `reports`
(`{"role": ..., "error": traceback}` when it failed).
"""

from __future__ import annotations

import time
import traceback
from collections import deque

import torch

VERIFY_SLOTS = 3
HOLD_WINDOW = 2
BIG_EVERY = 4
THROUGHPUT_SLOTS = 2
THROUGHPUT_SENDS = 60
WARMUP_SENDS = 5
WORKER_TIMEOUT_S = 120.0


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
