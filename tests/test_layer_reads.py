"""Layers read from the checkpoint files at every visit (h3engine.memory.streaming): reader threads fill a host ring of
`read_ahead` buffers in visit order, never one layer into two buffers, straight from the files' bytes (extents); the
forward computes exactly what resident weights compute.

How it breaks: a ring that reads the wrong layer next computes other outputs or stops with "out of order"; a
scheduler that reads a layer again while a buffer still holds it shows in the log of holds; a read that goes through
the tensor reader instead of the extents calls a reader that raises.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from safetensors.torch import save_file
from test_memory_streaming import copy_of, forward, random_dit

from h3engine.checkpoint.safetensors_io import read_header, row_extents
from h3engine.memory import streaming
from h3engine.memory.homes import PageLockedBuffer
from h3engine.memory.layers import dit_layers
from h3engine.memory.placement import file_home_layers
from h3engine.memory.stream_layout import TensorRead, read_extents, streamed_tensors
from h3engine.memory.streaming import LayerStream

LAYERS = 6  # 5 blocks + 1 refiner block


class RecordingStream(LayerStream):
    """Logs, under a lock, each read's start and end (layer, buffer) and each image the ring takes from a buffer."""

    def __init__(self, *args, read_delay: float = 0.0, **kwargs) -> None:
        self.log: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.read_delay = read_delay
        super().__init__(*args, **kwargs)

    def _read_layer(self, layer: int, buffer: int, copied: object) -> int:
        with self.lock:
            self.log.append(("read", layer, buffer))
        time.sleep(self.read_delay)
        read = super()._read_layer(layer, buffer, copied)
        with self.lock:
            self.log.append(("done", layer, buffer))
        return read

    def _host_image(self, layer: int) -> tuple[torch.Tensor, int]:
        image, buffer = super()._host_image(layer)
        with self.lock:
            self.log.append(("take", layer, buffer))
        return image, buffer


class Calls:
    count = 0


def file_readers(dit, folder: Path, calls: Calls | None = None) -> list[list[TensorRead]]:
    """Every streamed tensor of every layer saved to one file; each read gives its values and counts the call in
    `calls` (pinned images are filled through them; a file-home visit must go through the extents instead)."""
    spec = dit_layers(dit)
    tensors = {}
    for index, layer in enumerate(spec.layers):
        for number, (_, _, tensor) in enumerate(streamed_tensors(spec, layer)):
            tensors[f"{index}.{number}"] = tensor.detach().clone()
    path = folder / "layers.safetensors"
    save_file(tensors, path)
    infos = read_header(path)
    calls = calls or Calls()

    def reader(name: str):
        def read() -> torch.Tensor:
            calls.count += 1
            return tensors[name]

        return read

    return [
        [
            TensorRead(reader(f"{index}.{number}"), row_extents(infos[f"{index}.{number}"], tensor.dtype))
            for number, (_, _, tensor) in enumerate(streamed_tensors(spec, layer))
        ]
        for index, layer in enumerate(spec.layers)
    ]


def holds(log: list[tuple[str, int, int]]) -> list[set[tuple[int, int]]]:
    """After each event, the (layer, buffer) pairs a buffer holds: from its read's start until the ring takes it."""
    held: set[tuple[int, int]] = set()
    states = []
    for event, layer, buffer in log:
        if event == "read":
            held.add((layer, buffer))
        elif event == "take":
            held.discard((layer, buffer))
        states.append(set(held))
    return states


@pytest.mark.parametrize(("in_files", "read_ahead"), [(6, 2), (3, 2), (6, 3), (1, 2), (4, 1)])
def test_reader_threads_fill_the_host_ring_in_visit_order_ahead_and_never_a_layer_twice(
    tmp_path, in_files, read_ahead
) -> None:
    dit = random_dit(num_layers=LAYERS - 1)
    request = tiny_fl2va_request(dit.config, torch.float32, seed=2)
    expected = forward(dit, request)
    streamed = copy_of(dit)
    mapped = file_home_layers(LAYERS, in_files)
    calls = Calls()
    readers = file_readers(dit, tmp_path, calls)
    stream = RecordingStream(
        dit_layers(streamed), 0, "cpu", 2, readers=readers, mapped=mapped, read_ahead=read_ahead
    )
    calls.count = 0  # the pinned images are filled; from now on every read goes through the extents
    forwards = 3
    for _ in range(forwards):
        got = forward(streamed, request)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert stream.restarts == 0 and stream.visits == forwards * LAYERS
    file_layers = [index for index, flag in enumerate(mapped) if flag]
    assert sum(mapped) == in_files and stream.images.count(None) == in_files
    taken = [layer for event, layer, _ in stream.log if event == "take"]
    started = [layer for event, layer, _ in stream.log if event == "read"]
    # Taken in visit order, once per visit; read in the same order, at most `read_ahead` beyond what was taken.
    assert taken == file_layers * forwards + file_layers[: len(taken) - in_files * forwards]
    assert started[: len(taken)] == taken
    ahead = min(read_ahead, in_files)
    assert stream.most_reads_ahead == ahead
    for state in holds(stream.log):
        layers = [layer for layer, _ in state]
        assert len(layers) == len(set(layers)) <= ahead  # never one layer in two buffers
        assert len({buffer for _, buffer in state}) == len(state)
    # Every byte came from the file, through the extents.
    per_layer = {
        index: sum(t.numel() * t.element_size() for _, _, t in streamed_tensors(dit_layers(dit), layer))
        for index, layer in enumerate(dit_layers(dit).layers)
    }
    assert stream.read_bytes == sum(per_layer[layer] for layer in taken) and calls.count == 0
    stream.close()
    assert not any(thread.name.startswith("layer-reader") for thread in threading.enumerate())


@pytest.mark.parametrize("guarded", [True, False])
def test_a_scheduler_that_reads_a_held_layer_again_is_caught(tmp_path, monkeypatch, guarded) -> None:
    """One file-home layer and two host buffers (more than the stream would take): the scheduler never reads the
    layer a buffer holds into the other; without that guard the log of holds shows it twice."""
    dit = random_dit(num_layers=LAYERS - 1)
    request = tiny_fl2va_request(dit.config, torch.float32, seed=2)
    expected = forward(dit, request)

    def careless(self) -> None:
        while self._free_buffers:
            layer = self._next_file_layer(self._read_cursor)
            buffer = self._free_buffers.pop(0)
            future = self._pool.submit(self._read_layer, layer, buffer, self._buffer_copied[buffer])
            self._reads.append(streaming._Read(layer, buffer, future))
            self._read_cursor = self._following(layer)

    if not guarded:
        monkeypatch.setattr(LayerStream, "_schedule_reads", careless)
    streamed = copy_of(dit)
    stream = RecordingStream(
        dit_layers(streamed),
        0,
        "cpu",
        2,
        readers=file_readers(dit, tmp_path),
        mapped=file_home_layers(LAYERS, 1),
    )
    monkeypatch.setattr(LayerStream, "host_ring_buffers", property(lambda self: 2))
    for _ in range(2):
        got = forward(streamed, request)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    twice = [state for state in holds(stream.log) if len({layer for layer, _ in state}) < len(state)]
    assert bool(twice) != guarded, stream.log
    stream.close()


def test_the_host_waits_for_a_read_only_when_the_disk_is_behind(tmp_path) -> None:
    dit = random_dit(num_layers=LAYERS - 1)
    request = tiny_fl2va_request(dit.config, torch.float32, seed=2)
    readers = file_readers(dit, tmp_path)
    waits = {}
    for delay in (0.0, 0.05):
        streamed = copy_of(dit)
        stream = RecordingStream(
            dit_layers(streamed), 0, "cpu", 2, readers=readers, mapped=True, read_delay=delay
        )
        forward(streamed, request)
        waits[delay] = (stream.waited_reads, stream.layer_reads)
        stream.close()
    # A slow disk: most visits wait for their read; the layers are read once per visit either way (and the ring's
    # first two of the next forward).
    assert waits[0.05][0] >= LAYERS - 2 and waits[0.05][1] == waits[0.0][1] == LAYERS + 2


def test_file_homes_are_spread_over_the_visit_order() -> None:
    assert file_home_layers(6, 0) == [False] * 6
    assert file_home_layers(6, 6) == [True] * 6
    assert file_home_layers(6, 3) == [False, True] * 3
    assert sum(file_home_layers(52, 17)) == 17
    gaps = [index for index, flag in enumerate(file_home_layers(52, 13)) if flag]
    assert max(b - a for a, b in zip(gaps, gaps[1:], strict=False)) == 4


def test_extents_read_a_files_bytes_into_place(tmp_path) -> None:
    values = torch.arange(24, dtype=torch.float32).view(6, 4)
    save_file({"w": values}, tmp_path / "w.safetensors")
    info = read_header(tmp_path / "w.safetensors")["w"]
    # Rows 4-5 first, then rows 0-3.
    extents = row_extents(info, torch.float32, [(4, 2, 0), (0, 4, 2)])
    destination = torch.zeros(96, dtype=torch.uint8)
    assert read_extents(extents, destination) == 96
    assert torch.equal(destination.view(torch.float32).view(6, 4), torch.cat((values[4:], values[:4])))
    assert row_extents(info, torch.bfloat16) is None  # another dtype: its bytes are not the module's


@pytest.mark.cuda
def test_a_page_locked_buffer_is_exactly_its_size_and_copies_asynchronously() -> None:
    buffer = PageLockedBuffer(3 * (1 << 20) + 5, register=True)
    assert buffer.registered and buffer.tensor.numel() == 3 * (1 << 20) + 5 and buffer.tensor.is_pinned()
    buffer.tensor.fill_(7)
    on_device = torch.empty(buffer.size, dtype=torch.uint8, device="cuda")
    on_device.copy_(buffer.tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert int(on_device.sum()) == 7 * buffer.size
    buffer.close()
    assert not buffer.registered


def test_resident_layers_change_between_forwards_and_compute_the_same(tmp_path) -> None:
    """Layers join the resident ones from their home (an image or the files) and leave them for it; a layer resident
    from the start with readers streams from the files once it leaves; without readers it cannot leave."""
    dit = random_dit(num_layers=LAYERS - 1)
    request = tiny_fl2va_request(dit.config, torch.float32, seed=2)
    expected = forward(dit, request)
    streamed = copy_of(dit)
    stream = LayerStream(
        dit_layers(streamed), 3, "cpu", 2, readers=file_readers(dit, tmp_path), mapped=[False, True, False]
    )
    assert stream.lowest_resident == 0 and len(stream.layers) == 3
    visits = 0
    for count in (3, 0, 5, 1, 4, 3):
        stream.set_resident_layers(count)
        got = forward(streamed, request)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), count
        visits += LAYERS - count
        assert len(stream.layers) == LAYERS - count and stream.visits == visits
        stream.close()
    # Without readers the layers resident from the start have no home: they stay.
    fixed = LayerStream(dit_layers(copy_of(dit)), 2, "cpu", 2)
    assert fixed.lowest_resident == 2
    with pytest.raises(ValueError, match=r"within \[2, 5\]"):
        fixed.set_resident_layers(1)
    fixed.set_resident_layers(4)
    fixed.set_resident_layers(2)
    with pytest.raises(RuntimeError, match="ring is open"):
        stream.open()
        stream.set_resident_layers(2)
    stream.close()


def test_a_tiny_engine_runs_from_the_files_with_a_host_budget_below_its_models(tiny_checkpoints) -> None:
    """The `streamed` profile on the CPU under a host budget smaller than the streamed models: their layers stay in
    the files (no image in host memory), read at each visit, and the generation is the resident one's."""
    from _runtime_helpers import parity_requests

    from h3engine.engine.engine import Engine
    from h3engine.memory.sizes import checkpoint_sizes

    checkpoint = tiny_checkpoints("native", seed=7)
    partition = next(iter(checkpoint_sizes(checkpoint, dtype=torch.float32).partitions.values()))
    # Below the smallest streamed model's layers: every one of them goes to the files.
    budget_gib = (
        min(partition.model(name).layers_total for name in ("dit", "text_encoder", "video_vae"))
        / 2
        / (1 << 30)
    )
    resident = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32, adaln_cache="off")
    small = Engine.from_checkpoint(
        checkpoint,
        device="cpu",
        dtype=torch.float32,
        memory_profile="streamed",
        host_memory=budget_gib,
        adaln_cache="off",
    )
    assert {small.plan.models[name].home for name in ("dit", "text_encoder", "video_vae")} == {"mapped"}
    request = parity_requests(steps=2, seed=4)["t2va"]
    expected, _ = resident.generate(request)
    got, _ = small.generate(request)
    for name in ("video", "audio", "video_latents", "audio_latents"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    models = small.store.models_for_task("t2va")
    for name in ("dit", "text_encoder", "video_vae"):
        stream = small.placement.stream_of(getattr(models, name))
        assert stream.host_bytes == 0 and stream.layer_reads > 0, name
        # What the host holds of it while it runs: the ring's two layers (of 3 and 50 here), less than the model.
        if len(stream.layers) > 2:
            assert stream.host_ring_buffers * stream.host_ring_bytes < partition.model(name).layers_total, (
                name
            )
