"""The DiT's AdaLN tables of a whole request, built ahead of its forwards from the blocks' modulation weights.

`schedule_modulation(dit, step_timesteps, device)` gives one `StepModulation` per step, exactly what
`H3DiT.modulation` computes: each AdaLN projection is read once for all steps (streamed to `device` when
`offload_adaln` moved it to pinned host memory, FP8 with `fp8=True`, or read from the mapped files). The DiT's last
`MODULATION_CACHE_SCHEDULES` schedules stay on their device; loading weights or `clear_modulation_cache` forgets them.
With a disk cache (`attach_table_cache`, h3engine.engine.sampling.adaln_tables) each step's tables are read from it and only
the missing steps computed (`ScheduleModulation.persist` stores them after the forwards used them): a request whose
steps are all cached reads no AdaLN projection. `build_modulation` is the computation without any cache.

On a GPU the tables are built on a CUDA stream of their own, so the first forward starts at once: each block's
tables carry an event, and `wait()` / `final_tables()` (called by the DiT's forward) make the reading stream wait
for exactly the tables it is about to read.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from h3engine.checkpoint.safetensors_io import is_parked, parked
from h3engine.engine.sampling.adaln_tables import AdalnTableCache, StepTables, TableKey, device_identity
from h3engine.memory.homes import dequantize_into, dequantized, pin_in_place
from h3engine.memory.types import MODULATION_CACHE_SCHEDULES
from h3engine.models.dit import H3DiT
from h3engine.models.dit_layers import BlockModulation, StepModulation
from h3engine.models.quantization import quantize_rows
from h3engine.models.stored_linear import StoredLinear

logger = logging.getLogger(__name__)

# Schedules whose AdaLN tables `schedule_modulation` keeps per DiT.

# DiT -> (device, step timesteps) -> that schedule's tables, least recently used first.
_caches: weakref.WeakKeyDictionary[H3DiT, OrderedDict[tuple, list[StepModulation]]] = (
    weakref.WeakKeyDictionary()
)
# An offloaded AdaLN linear stored in FP8 -> (e4m3 values, fp32 row scales) in host memory; its own weight is then a
# broadcast NaN of the right shape (nothing reads it: `_on_device` hands out the dequantized copy).
_fp8_weights: weakref.WeakKeyDictionary[nn.Linear, tuple[Tensor, Tensor]] = weakref.WeakKeyDictionary()
# An offloaded AdaLN linear whose weight stays in the mapped checkpoint file -> its reader.
_mapped_weights: weakref.WeakKeyDictionary[nn.Linear, Callable[[], Tensor]] = weakref.WeakKeyDictionary()
# An offloaded AdaLN projection a community file stores quantized, left in the mapped file -> readers of its stored
# tensors (StoredLinear.stored's order).
_mapped_stored: weakref.WeakKeyDictionary[StoredLinear, tuple[Callable[[], Tensor], ...]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _DiskTables:
    """A DiT's disk cache of tables and what its tables depend on (h3engine.engine.sampling.adaln_tables.TableKey)."""

    cache: AdalnTableCache
    model: str
    adapters: str = ""


# DiT -> how many past schedules' tables stay on its device (absent: MODULATION_CACHE_SCHEDULES).
_kept: weakref.WeakKeyDictionary[H3DiT, int] = weakref.WeakKeyDictionary()
# DiT -> its disk cache (absent: none).
_disk_tables: weakref.WeakKeyDictionary[H3DiT, _DiskTables] = weakref.WeakKeyDictionary()
# DiT -> the key of its adapters on AdaLN ("" or absent: none), kept apart so that it holds before a cache is attached.
_adapter_keys: weakref.WeakKeyDictionary[H3DiT, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class InFlightBlockModulation(BlockModulation):
    """A block's tables built on another CUDA stream; `ready` marks them computed."""

    ready: torch.cuda.Event | None = None

    def wait(self) -> BlockModulation:
        """These tables, once the current CUDA stream has been made to wait until they are computed."""
        _wait_for(self.ready, self.shift_attn.device)
        return self


@dataclass(frozen=True)
class InFlightStepModulation(StepModulation):
    """A step's tables built on another CUDA stream; `final_ready` marks the final layer's computed."""

    final_ready: torch.cuda.Event | None = None

    def final_tables(self) -> tuple[Tensor, Tensor]:
        """The final layer's tables, once the current CUDA stream has been made to wait until they are computed."""
        _wait_for(self.final_ready, self.final[0].device)
        return self.final


def _adaln_projections(dit: H3DiT) -> list[nn.Module]:
    return [block.adaln_proj for block in dit.blocks] + [dit.final_layer.adaln_proj]


def offload_adaln(
    dit: H3DiT,
    fp8: bool = False,
    readers: Mapping[str, Callable[[], Tensor]] | None = None,
    stored_fp8: Mapping[str, Callable[[], tuple[Tensor, Tensor]]] | None = None,
) -> None:
    """Move every AdaLN projection of `dit` to CPU memory, pinned when CUDA is present; `schedule_modulation`
    streams them to the compute device when it builds tables. `fp8`: their weights wait as e4m3 values with row
    scales (h3engine.memory.homes) and are dequantized on the device: quantized here, or as `stored_fp8` (module key
    -> reader) gives them from files that store them so. `readers`: weights the loader left unread (module key ->
    reader of the files, which gives them dequantized where the files store FP8): they are read again for each
    schedule, nothing waits in memory."""
    readers, stored_fp8 = readers or {}, stored_fp8 or {}
    projections = _adaln_projections(dit)
    names = {id(projection): name for name, projection in dit.named_modules()}
    parameters = []
    for projection in projections:
        linear, key = projection.linear, f"{names[id(projection)]}.linear.weight"
        if isinstance(linear, StoredLinear):
            parameters += _offload_stored(linear, f"{names[id(projection)]}.linear", readers)
            continue
        # A pruned form's projections (adaln_rank inputs per row) stay as they are: FP8 rows of 8 would cost
        # precision for a few MiB.
        quantized = fp8 and not projection.pruned
        if key in readers:
            read = readers[key]
            # bf16 files under --weights fp8: the values FP8 storage stands for (FP8 files gave them already).
            _mapped_weights[linear] = (
                (lambda read=read: dequantized(read())) if quantized and key not in stored_fp8 else read
            )
            parameters.append(linear.bias)
            continue
        parameters += [linear.weight, linear.bias]
        if quantized:
            values, scales = (
                stored_fp8[key]() if key in stored_fp8 else quantize_rows(linear.weight.data.to("cpu"))
            )
            _fp8_weights[linear] = (values, scales)
            linear.weight.data = parked(linear.weight.shape, linear.weight.dtype)
            parameters += list(_fp8_weights[linear])
    parameters = [parameter for parameter in parameters if not is_parked(parameter)]
    for parameter in parameters:
        parameter.data = parameter.data.to("cpu")
    if torch.cuda.is_available():
        # Packed into slabs: pinned one by one, each weight would take a pinned block rounded up to a power of two.
        pin_in_place(parameters)
    clear_modulation_cache(dit)


def _offload_stored(
    linear: StoredLinear, prefix: str, readers: Mapping[str, Callable[[], Tensor]]
) -> list[Tensor]:
    """The tensors of a projection a community file stores quantized that wait in host memory: its bias, and its
    stored bytes (and scale) unless the loader left them in the mapped file (then read again for each schedule)."""
    keys = [f"{prefix}.{name}" for name, _ in linear.named_buffers()]
    if all(key in readers for key in keys):
        _mapped_stored[linear] = tuple(readers[key] for key in keys)
        return [linear.bias]
    return [*linear.stored(), linear.bias]


def store_adaln_in_fp8(dit: H3DiT) -> None:
    """`--weights fp8` for AdaLN projections that stay with the module (the CPU): their weights become the values
    the FP8 copies give back."""
    for projection in _adaln_projections(dit):
        if not projection.pruned and not isinstance(projection.linear, StoredLinear):
            projection.linear.weight.data = dequantized(projection.linear.weight.data)
    clear_modulation_cache(dit)


def _cache(dit: H3DiT) -> OrderedDict[tuple, list[StepModulation]]:
    if dit not in _caches:
        cache: OrderedDict[tuple, list[StepModulation]] = OrderedDict()
        _caches[dit] = cache
        dit.register_load_state_dict_post_hook(lambda module, keys: cache.clear())
    return _caches[dit]


def clear_modulation_cache(dit: H3DiT) -> None:
    """Forget every schedule's tables of `dit` (the next `schedule_modulation` builds them again)."""
    _cache(dit).clear()


def attach_table_cache(dit: H3DiT, cache: AdalnTableCache | None, model: str) -> None:
    """Give `dit` a disk cache of AdaLN tables (None: none); `model` names its weights as loaded (the checkpoint's DiT
    fingerprint, weight format and dtype: h3engine.engine.sampling.adaln_tables.TableKey.model)."""
    if cache is None:
        _disk_tables.pop(dit, None)
    else:
        _disk_tables[dit] = _DiskTables(cache, model)


def set_kept_schedules(dit: H3DiT, count: int) -> None:
    """How many past schedules' tables `dit` keeps on its device (MODULATION_CACHE_SCHEDULES by default; 0 when the
    disk cache serves repeats and the GPU is short); the request's own are alive while it runs either way."""
    _kept[dit] = count
    cache = _cache(dit)
    while len(cache) > count:
        cache.popitem(last=False)


def set_adapter_key(dit: H3DiT, key: str) -> None:
    """The adapters `dit` now carries on its AdaLN projections, as a key ("" for none): their tables are cached
    apart (h3engine.engine.lora.adapters calls this whenever it changes them)."""
    _adapter_keys[dit] = key
    clear_modulation_cache(dit)


class ScheduleModulation(list):
    """The `StepModulation` of every step of a request (a list), with where they came from: `source` "memory" (the
    DiT's last schedules), "cache" (the disk) or "computed" (some steps at least), `seconds` the host time it took."""

    def __init__(self, steps: Sequence[StepModulation], source: str, seconds: float = 0.0) -> None:
        super().__init__(steps)
        self.source = source
        self.seconds = seconds
        self._to_store: list[tuple[AdalnTableCache, str, str, int]] = []

    def persist(self) -> None:
        """Store the steps computed for this request in the disk cache (once: a second call stores nothing)."""
        for cache, name, description, step in self._to_store:
            cache.store(name, description, stored_tables(self[step]))
        self._to_store = []


def schedule_modulation(dit: H3DiT, step_timesteps: list[Tensor], device: torch.device) -> ScheduleModulation:
    """The AdaLN tables of every forward of a request on `device`, one per entry of `step_timesteps` (CPU): from the
    DiT's in-memory cache, else from its disk cache where it has them, else computed."""
    started = time.perf_counter()
    cache = _cache(dit)
    cache_key = (str(device), tuple(tuple(t.tolist()) for t in step_timesteps))
    if cache_key in cache:
        cache.move_to_end(cache_key)
        return ScheduleModulation(cache[cache_key], "memory", time.perf_counter() - started)
    disk = _disk_tables.get(dit)
    steps: list[StepModulation | None] = [None] * len(step_timesteps)
    names = []
    if disk is not None:
        key = TableKey(disk.model, _adapter_keys.get(dit, ""), device_identity(device))
        for index, timesteps in enumerate(step_timesteps):
            name, description = key.step_name(timesteps), key.description(timesteps)
            names.append((name, description))
            stored = disk.cache.load(name, description)
            if stored is not None:
                steps[index] = step_from_stored(stored, device)
    missing = [index for index, step in enumerate(steps) if step is None]
    if missing:
        built = build_modulation(dit, [step_timesteps[index].to(device) for index in missing])
        for index, step in zip(missing, built, strict=True):
            steps[index] = step
        if disk is not None:
            if device.type == "cuda":
                # Built before the first forward, not under it: the projections in flight and the forward's
                # activations are then never on the GPU together (the memory plan counts on it), once per schedule.
                torch.cuda.synchronize(device)
            logger.info(
                "AdaLN tables: %d of %d steps computed, %d read from %s",
                len(missing),
                len(steps),
                len(steps) - len(missing),
                disk.cache.folder,
            )
    source = "computed" if missing else "cache"
    result = ScheduleModulation(steps, source, time.perf_counter() - started)
    if disk is not None:
        result._to_store = [(disk.cache, *names[index], index) for index in missing]
    cache[cache_key] = list(result)
    while len(cache) > _kept.get(dit, MODULATION_CACHE_SCHEDULES):
        cache.popitem(last=False)
    return result


# The order of a block's tables in a stored step (h3engine.engine.sampling.adaln_tables.StepTables).
_BLOCK_TABLES = tuple(field.name for field in fields(BlockModulation))


def stored_tables(step: StepModulation) -> StepTables:
    """One step's tables as the disk cache stores them (waiting for tables still in flight on their stream)."""
    blocks = [block.wait() for block in step.blocks]
    scale_plus_one, shift = step.final_tables()
    return StepTables(
        torch.stack([torch.stack([getattr(block, name) for name in _BLOCK_TABLES]) for block in blocks]),
        torch.stack((scale_plus_one, shift)),
    )


def step_from_stored(stored: StepTables, device: torch.device) -> StepModulation:
    """A stored step's tables on `device`: views of one copy, the same bits as when they were computed."""
    blocks, final = stored.blocks.to(device), stored.final.to(device)
    return StepModulation(
        blocks=tuple(
            BlockModulation(**{name: tables[index] for index, name in enumerate(_BLOCK_TABLES)})
            for tables in blocks
        ),
        final=(final[0], final[1]),
    )


def build_modulation(dit: H3DiT, step_timesteps: list[Tensor]) -> list[StepModulation]:
    """The tables of each entry of `step_timesteps` (on the compute device), uncached."""
    device = step_timesteps[0].device
    # On a GPU the tables are built on a stream of their own: streaming an offloaded projection hides under the
    # first forward, whose blocks each wait only for their own tables.
    reading_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    building_stream = torch.cuda.Stream(device) if reading_stream is not None else None
    if building_stream is not None:
        building_stream.wait_stream(reading_stream)
        for timesteps in step_timesteps:
            timesteps.record_stream(building_stream)
    with torch.cuda.stream(building_stream) if building_stream is not None else contextlib.nullcontext():
        # The AdaLN input stays fp32: temb (each exact projection casts only after its SiLU) or a pruned form's c(t).
        step_inputs = [dit.adaln_input(timesteps) for timesteps in step_timesteps]
        block_tables: list[list[BlockModulation]] = [[] for _ in step_timesteps]
        for block in dit.blocks:
            weight, bias = _on_device(block.adaln_proj.linear, device)
            computed = [block.modulation(adaln_input, weight, bias) for adaln_input in step_inputs]
            ready = _handed_over([table for tables in computed for table in _tables(tables)], reading_stream)
            for tables, step_computed in zip(block_tables, computed, strict=True):
                tables.append(InFlightBlockModulation(**vars(step_computed), ready=ready))
        weight, bias = _on_device(dit.final_layer.adaln_proj.linear, device)
        finals = [dit.final_layer.modulation(adaln_input, weight, bias) for adaln_input in step_inputs]
        final_ready = _handed_over([table for final in finals for table in final], reading_stream)
    return [
        InFlightStepModulation(blocks=tuple(tables), final=final, final_ready=final_ready)
        for tables, final in zip(block_tables, finals, strict=True)
    ]


def _tables(modulation: BlockModulation) -> tuple[Tensor, ...]:
    return tuple(getattr(modulation, field.name) for field in fields(BlockModulation))


def _on_device(linear: nn.Linear, device: torch.device) -> tuple[Tensor, Tensor]:
    """A linear's weight and bias on `device` (a copy when they live elsewhere, e.g. offloaded to pinned CPU; an FP8
    home dequantized there)."""
    bias = linear.bias.to(device, non_blocking=True)
    if isinstance(linear, StoredLinear):
        reads = _mapped_stored.get(linear)
        stored = [read() for read in reads] if reads is not None else linear.stored()
        return linear.weight_from(*(tensor.to(device, non_blocking=True) for tensor in stored)), bias
    if linear in _mapped_weights:
        return _mapped_weights[linear]().to(device), bias
    if linear in _fp8_weights:
        values, scales = _fp8_weights[linear]
        weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device=device)
        return dequantize_into(
            weight, values.to(device, non_blocking=True), scales.to(device, non_blocking=True)
        ), bias
    return linear.weight.to(device, non_blocking=True), bias


def _wait_for(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current stream of `device` (where the tables live and are read) wait for `event`."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def _handed_over(
    tensors: Sequence[Tensor], reading_stream: torch.cuda.Stream | None
) -> torch.cuda.Event | None:
    """Tensors just computed on the current CUDA stream, to be read on `reading_stream`: the allocator keeps their
    memory until the reader's queued work is done, and the returned event marks them computed. None on a CPU."""
    if reading_stream is None:
        return None
    for tensor in tensors:
        tensor.record_stream(reading_stream)
    event = torch.cuda.Event()
    event.record()
    return event
