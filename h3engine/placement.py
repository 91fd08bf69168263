"""Memory profiles: where each model of a partition lives, and which of them a phase of a request puts on the GPU.

* "resident" (the default): every component is loaded onto the compute device and stays there; phases are no-ops.
* "low-memory": every component is loaded into host memory (pinned when the compute device is a GPU), and each
  phase copies onto the compute device only the components it runs, dropping the copies when it ends. In request
  order: "conditioning" (VAE encoders) -> "text_encode" -> "denoise" (DiT) -> "decode" (VAEs); `PHASE_COMPONENTS`
  names the `pipeline.Models` fields of each. The same modules run the same math under either profile, so outputs
  are bit-identical.

`Placement.load_device` is where loaders build components, `adopt(module)` registers a loaded one, and
`resident_for(phase, modules)` is the one place a phase begins and ends.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from h3engine.errors import RequestError

logger = logging.getLogger(__name__)

MEMORY_PROFILES = ("resident", "low-memory")
# Phase -> the `pipeline.Models` fields it runs, in request order.
PHASE_COMPONENTS = {
    "conditioning": ("video_vae", "audio_vae"),
    "text_encode": ("text_encoder",),
    "denoise": ("dit",),
    "decode": ("video_vae", "audio_vae"),
}

# Pinned home copies are packed into slabs of this size (see `pinned_copies`), each copy starting on this alignment.
PINNED_SLAB_BYTES = 1 << 31
PINNED_ALIGNMENT = 256

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def check_memory_profile(name: str) -> str:
    if name not in MEMORY_PROFILES:
        raise RequestError(f"--memory-profile: expected one of {', '.join(MEMORY_PROFILES)}, got '{name}'")
    return name


def _pinned_bytes(size: int) -> Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _power_of_two_at_least(size: int) -> int:
    return 1 << max(0, size - 1).bit_length()


def pin_in_place(
    tensors: Sequence[Tensor],
    slab_bytes: int = PINNED_SLAB_BYTES,
    allocate: Callable[[int], Tensor] = _pinned_bytes,
) -> None:
    """Move each tensor's data (parameters and buffers keep their identity) into page-locked host memory, for fast
    asynchronous copies to the GPU, packed in order into power-of-two slabs of at most `slab_bytes` (a larger
    tensor gets its own allocation). One tensor at a time, so the host holds one extra tensor, not a module's worth.

    Why slabs: torch's pinned allocator rounds each allocation up to a power of two; pinned tensor by tensor, the
    released DiT's weights besides its AdaLN projections would take ~57 % more host memory. From the first
    allocation that fails on, the remaining tensors stay as they are (pageable: slower copies, same values).
    """
    sizes = [
        -(-tensor.numel() * tensor.element_size() // PINNED_ALIGNMENT) * PINNED_ALIGNMENT
        for tensor in tensors
    ]
    left_to_pack = sum(size for size in sizes if size <= slab_bytes)
    slab, used = None, 0
    for tensor, size in zip(tensors, sizes, strict=True):
        try:
            if size > slab_bytes:
                storage, offset = allocate(size), 0
            else:
                if slab is None or used + size > slab.numel():
                    slab, used = allocate(min(slab_bytes, _power_of_two_at_least(left_to_pack))), 0
                storage, offset = slab, used
                used += size
                left_to_pack -= size
        except RuntimeError as error:
            logger.warning("could not pin more host memory (%s); copies to the GPU will be slower", error)
            return
        data_bytes = tensor.numel() * tensor.element_size()
        pinned = storage[offset : offset + data_bytes].view(tensor.dtype).view(tensor.shape)
        pinned.copy_(tensor.data)
        tensor.data = pinned


class Placement:
    """One engine's memory profile: where components load and which ones each phase holds on the compute device.

    `transfer` makes a phase's copy of a home tensor (default: to the compute device, asynchronously from pinned
    memory); on the CPU the default returns the tensor itself, so the low-memory profile moves nothing there.
    """

    def __init__(
        self,
        profile: str = "resident",
        compute_device: torch.device | str = "cpu",
        transfer: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.profile = check_memory_profile(profile)
        self.compute_device = torch.device(compute_device)
        self._moves = self.profile == "low-memory"
        self._pins = self._moves and self.compute_device.type == "cuda"
        self._transfer = transfer or (lambda tensor: tensor.to(self.compute_device, non_blocking=True))
        # Adopted module -> (parameter or buffer, its home tensor) for each tensor a phase moves.
        self._homes: WeakKeyDictionary[nn.Module, list[tuple[Tensor, Tensor]]] = WeakKeyDictionary()
        self.phase: str | None = None

    @property
    def load_device(self) -> torch.device:
        return torch.device("cpu") if self._moves else self.compute_device

    def adopt(self, module: ModuleT | None) -> ModuleT | None:
        """Register a freshly loaded component (None: a component this rank does not hold); returns it.

        Its parameters and buffers as they are now become its "home" tensors, so adopt a module after its last
        load-time change (AdaLN offload, weight folding): leaving a phase restores exactly what was recorded. A tensor
        already in pinned host memory stays home in every phase: the module streams it itself (the DiT's offloaded
        AdaLN projections).
        """
        if not self._moves or module is None:
            return module
        tensors = list(itertools.chain(module.parameters(), module.buffers()))
        if self._pins:
            # Already pinned: offloaded on purpose, the module streams it itself.
            tensors = [tensor for tensor in tensors if not tensor.data.is_pinned()]
            pin_in_place(tensors)
        self._homes[module] = [(tensor, tensor.data) for tensor in tensors]
        return module

    @contextmanager
    def resident_for(self, phase: str, modules: Iterable[nn.Module | None]) -> Iterator[None]:
        """Hold `modules` (a phase's components; None entries are skipped) on the compute device for the block.

        Entering copies each home tensor to the compute device (`transfer`); leaving points every parameter and
        buffer back at its home tensor (inference never writes weights, so nothing is copied back) and empties the
        CUDA cache. Tensors a module makes during a phase and keeps outside its parameters and buffers (cached AdaLN
        tables) stay where they were made.
        """
        if phase not in PHASE_COMPONENTS:
            raise ValueError(f"unknown phase '{phase}', expected one of {', '.join(PHASE_COMPONENTS)}")
        if not self._moves:
            yield
            return
        if self.phase is not None:
            raise RuntimeError(f"phase '{phase}' entered while '{self.phase}' holds the device")
        present = [module for module in modules if module is not None]
        self.phase = phase
        try:
            for module in present:
                for tensor, home in self._homes[module]:
                    tensor.data = self._transfer(home)
            yield
        finally:
            # Also after a failed copy (out of memory): every tensor goes home, moved yet or not.
            for module in present:
                for tensor, home in self._homes[module]:
                    tensor.data = home
            self.phase = None
            if self.compute_device.type == "cuda":
                torch.cuda.empty_cache()
