"""Worker side of tests/test_channel.py: what each spawned process runs, the tensors it sends, and the checks.

Kept apart from the test module so that a spawned worker imports only torch and the channel. Each worker puts
exactly one report (a dict of builtins) on the `reports` queue, `{"role": ..., "error": traceback}` when it failed,
so the test shows a worker's failure instead of waiting out a timeout.
"""

from __future__ import annotations

import os
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from h3engine.runtime.channel import TensorChannel
from h3engine.runtime.channel_errors import ChannelClosed, ChannelError, ChannelTimeout

SEED = 20240607
EXCHANGE_SLOTS = 3
# Element counts cycled by the reuse phase: the 1.2 MB one does not fit a first 1 MiB slot buffer, so slots grow.
REUSE_SIZES = (1_000, 70_001, 300_007)
REUSE_SENDS = 24
# The consumer keeps this many received batches before releasing the oldest, so the producer keeps blocking.
REUSE_WINDOW = 2
BACKPRESSURE_TIMEOUT_S = 0.3
# How long the consumer keeps every slot after the producer's timed-out send, and waits before it closes.
HOLD_S = 0.5
CLOSE_DELAY_S = 0.5
DEATH_SLOTS = 2
DOOMED_EXIT_CODE = 17
DOOMED_DELAY_S = 0.5
WORKER_TIMEOUT_S = 20.0


def case_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype and shape case, as the producer sends them (some non-contiguous); fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    fp32 = torch.randn(7, 13, generator=generator)
    fp32.view(-1)[:4] = special
    bf16 = torch.randn(3, 5, 2, generator=generator).to(torch.bfloat16)
    bf16.view(-1)[:4] = special.to(torch.bfloat16)
    fp16 = torch.randn(33, generator=generator).to(torch.float16)
    fp16[:4] = special.to(torch.float16)
    return {
        "fp32_odd": fp32,
        "bf16": bf16,
        "fp16": fp16,
        "fp64": torch.randn(2, 3, generator=generator, dtype=torch.float64),
        "int64": torch.randint(-(2**62), 2**62, (5, 3), generator=generator),
        "int32": torch.randint(-(2**31), 2**31 - 1, (9,), generator=generator, dtype=torch.int32),
        "uint8": torch.randint(0, 256, (17,), generator=generator, dtype=torch.uint8),
        "bool": torch.rand(4, 9, generator=generator) > 0.5,
        "scalar_fp32": torch.tensor(3.25),
        "scalar_int64": torch.tensor(-7),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_3d_bf16": torch.empty(2, 0, 5, dtype=torch.bfloat16),
        "transposed_fp32": torch.randn(6, 10, generator=generator).t(),
        "strided_int64": torch.arange(40).view(8, 5)[::2, 1:4],
        "expanded_fp16": torch.randn(3, 1, generator=generator).to(torch.float16).expand(3, 4),
        "sliced_bf16": torch.randn(4, 6, generator=generator).to(torch.bfloat16)[:, 1::2],
    }


def bit_mismatch(name: str, received: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when dtype, shape and every byte agree (NaN payloads and -0.0 included), else what differs."""
    if received.dtype != expected.dtype or received.shape != expected.shape:
        return f"{name}: got {received.dtype} {tuple(received.shape)}, sent {expected.dtype} {tuple(expected.shape)}"
    received_bytes = received.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    expected_bytes = expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(received_bytes, expected_bytes):
        differing = int((received_bytes != expected_bytes).sum())
        return f"{name}: {differing} of {expected_bytes.numel()} bytes differ"
    return None


def reuse_values(step: int, device: str) -> torch.Tensor:
    """The payload of reuse send `step`: exact in fp32 and different for every step."""
    size = REUSE_SIZES[step % len(REUSE_SIZES)]
    return torch.arange(size, dtype=torch.float32, device=device) * 0.5 + step * 1000.0


def run_and_report(role: str, reports, body: Callable[[], dict]) -> None:
    try:
        report = body()
    except BaseException:
        report = {"error": traceback.format_exc()}
    reports.put({"role": role, "pid": os.getpid(), **report})


# --------------------------------------------------------------------------------------------------------------
# Exchange: dtypes and shapes, slot reuse, backpressure, teardown
# --------------------------------------------------------------------------------------------------------------


def exchange_producer(channel: TensorChannel, reports, timed_out, device: str) -> None:
    run_and_report("producer", reports, lambda: _exchange_producer(channel, timed_out, device))


def _exchange_producer(channel: TensorChannel, timed_out, device: str) -> dict:
    producer = channel.producer()
    cases = {name: tensor.to(device) for name, tensor in case_tensors(SEED).items()}
    producer.send(cases, "cases:all")
    for name, tensor in cases.items():
        producer.send({name: tensor}, f"case:{name}")

    # One source tensor per size, refilled in place for each send and scribbled over right after it.
    sources = {size: torch.empty(size, dtype=torch.float32, device=device) for size in REUSE_SIZES}
    for step in range(REUSE_SENDS):
        values = reuse_values(step, device)
        source = sources[values.numel()]
        source.copy_(values)
        producer.send({"values": source, "step": torch.tensor([step], device=device)}, f"reuse:{step}")
        source.fill_(-1.0)
    stats_after_reuse = producer.stats

    for index in range(EXCHANGE_SLOTS):
        producer.send({"index": torch.tensor([index], device=device)}, f"hold:{index}")
    started = time.monotonic()
    try:
        producer.send(
            {"index": torch.tensor([EXCHANGE_SLOTS], device=device)}, "hold:extra", BACKPRESSURE_TIMEOUT_S
        )
        timeout_error = None
    except ChannelTimeout as error:
        timeout_error = str(error)
    timeout_after_s = time.monotonic() - started
    timed_out.set()
    started = time.monotonic()
    producer.send({"index": torch.tensor([EXCHANGE_SLOTS], device=device)}, "hold:extra", WORKER_TIMEOUT_S)
    blocked_s = time.monotonic() - started

    close_started_at = time.monotonic()
    producer.close(timeout=WORKER_TIMEOUT_S)
    stats = producer.stats
    return {
        "sends": stats.sends,
        "reuse_sends": stats_after_reuse.sends,
        "reuse_slot_reuses": stats_after_reuse.slot_reuses,
        "reuse_buffer_allocations": stats_after_reuse.buffer_allocations,
        "timeout_error": timeout_error,
        "timeout_after_s": timeout_after_s,
        "blocked_s": blocked_s,
        "close_started_at": close_started_at,
        "close_returned_at": time.monotonic(),
    }


def exchange_consumer(channel: TensorChannel, reports, timed_out, device: str) -> None:
    run_and_report("consumer", reports, lambda: _exchange_consumer(channel, timed_out, device))


def _exchange_consumer(channel: TensorChannel, timed_out, device: str) -> dict:
    consumer = channel.consumer()
    expected = case_tensors(SEED)
    case_mismatches = []
    received_names = []
    with consumer.receiving(WORKER_TIMEOUT_S) as (tag, tensors):
        received_names.append((tag, sorted(tensors)))
        case_mismatches += [bit_mismatch(f"{tag}/{name}", tensors[name], expected[name]) for name in expected]
    for _ in expected:
        with consumer.receiving(WORKER_TIMEOUT_S) as (tag, tensors):
            received_names.append((tag, sorted(tensors)))
            ((name, tensor),) = tensors.items()
            case_mismatches.append(bit_mismatch(f"{tag}/{name}", tensor, expected[name]))

    reuse_mismatches = []
    held: deque[tuple[str, dict[str, torch.Tensor], int]] = deque()

    def check_reuse(when: str, tag: str, tensors: dict[str, torch.Tensor], step: int) -> None:
        for name, want in (
            ("values", reuse_values(step, device)),
            ("step", torch.tensor([step], device=device)),
        ):
            mismatch = bit_mismatch(f"{tag}/{name} ({when})", tensors[name], want)
            if mismatch:
                reuse_mismatches.append(mismatch)

    def release_oldest() -> None:
        tag, tensors, step = held.popleft()
        # The producer has sent (and scribbled over) later batches by now; this slot must be untouched.
        check_reuse("before release", tag, tensors, step)
        consumer.release(tag)

    for step in range(REUSE_SENDS):
        tag, tensors = consumer.receive(WORKER_TIMEOUT_S)
        if tag != f"reuse:{step}":
            reuse_mismatches.append(f"expected reuse:{step}, got {tag}")
        check_reuse("on arrival", tag, tensors, step)
        held.append((tag, tensors, step))
        if len(held) > REUSE_WINDOW:
            release_oldest()
    while held:
        release_oldest()
    # Received views must not outlive the consumer: on CUDA they keep the producer's memory referenced.
    del tensors

    hold_tags = [consumer.receive(WORKER_TIMEOUT_S)[0] for _ in range(EXCHANGE_SLOTS)]
    timed_out.wait(WORKER_TIMEOUT_S)
    time.sleep(HOLD_S)
    consumer.release(hold_tags[0])
    extra_tag, _ = consumer.receive(WORKER_TIMEOUT_S)
    for tag in [*hold_tags[1:], extra_tag]:
        consumer.release(tag)

    try:
        consumer.receive(WORKER_TIMEOUT_S)
        end_error = None
    except ChannelClosed as error:
        end_error = str(error)
    time.sleep(CLOSE_DELAY_S)
    closing_at = time.monotonic()
    consumer.close()
    return {
        "case_mismatches": [mismatch for mismatch in case_mismatches if mismatch],
        "received_names": received_names,
        "reuse_mismatches": reuse_mismatches,
        "hold_tags": hold_tags,
        "extra_tag": extra_tag,
        "end_error": end_error,
        "closing_at": closing_at,
        "closed_at": time.monotonic(),
    }


# --------------------------------------------------------------------------------------------------------------
# Peer death: two channels between a survivor and a process that dies holding a slot
# --------------------------------------------------------------------------------------------------------------


def survivor(
    to_doomed: TensorChannel, from_doomed: TensorChannel, reports, survivor_received, device: str
) -> None:
    run_and_report("survivor", reports, lambda: _survivor(to_doomed, from_doomed, survivor_received, device))


def _survivor(to_doomed: TensorChannel, from_doomed: TensorChannel, survivor_received, device: str) -> dict:
    producer = to_doomed.producer()
    consumer = from_doomed.consumer()
    producer.send({"x": torch.ones(1000, device=device)}, "first")
    tag, _ = consumer.receive(WORKER_TIMEOUT_S)
    consumer.release(tag)
    survivor_received.set()

    # The doomed process holds "first" and never releases it: one more send fits, the next one blocks until
    # the survivor notices the death.
    sent_before_failure = 0
    send_error = None
    try:
        for index in range(DEATH_SLOTS + 1):
            producer.send(
                {"x": torch.full((1000,), float(index), device=device)}, f"more:{index}", WORKER_TIMEOUT_S
            )
            sent_before_failure += 1
    except ChannelError as error:
        send_error = (type(error).__name__, str(error))
    send_failed_at = time.monotonic()

    started = time.monotonic()
    try:
        consumer.receive(WORKER_TIMEOUT_S)
        receive_error = None
    except ChannelError as error:
        receive_error = (type(error).__name__, str(error))
    receive_failed_after_s = time.monotonic() - started

    started = time.monotonic()
    producer.close(timeout=WORKER_TIMEOUT_S)
    consumer.close()
    return {
        "received_tag": tag,
        "sent_before_failure": sent_before_failure,
        "send_error": send_error,
        "send_failed_at": send_failed_at,
        "receive_error": receive_error,
        "receive_failed_after_s": receive_failed_after_s,
        "close_s": time.monotonic() - started,
    }


def doomed(
    to_doomed: TensorChannel, from_doomed: TensorChannel, reports, survivor_received, device: str
) -> None:
    consumer = to_doomed.consumer()
    producer = from_doomed.producer()
    producer.send({"y": torch.arange(10, device=device)}, "hello")
    tag, _ = consumer.receive(WORKER_TIMEOUT_S)
    survivor_received.wait(WORKER_TIMEOUT_S)
    time.sleep(DOOMED_DELAY_S)
    reports.put({"role": "doomed", "pid": os.getpid(), "held_tag": tag, "died_at": time.monotonic()})
    reports.close()
    reports.join_thread()
    # A crash: no close, no release, no interpreter shutdown.
    os._exit(DOOMED_EXIT_CODE)
