"""Text-encoder states kept between requests: a rerun, a second take or a new seed of the same prompt and references
skips the text encoder (on a small GPU that is the 25-50 GB read of its layers per request).

`TextStateCache(capacity_bytes)` holds, per text encoder (the loaded module: one checkpoint's encoder, with its
weights), the states of recent presentations on the host, keyed by a digest of everything the encoder reads: the
prompt's token ids and every pixel tensor of the keyframes or references (`presentation_key`). The same inputs on
the same module give the same states, so handing them back is exact; adapters only touch the DiT. Least recently used
entries go past `capacity_bytes`.

Danger: a module whose weights change in place (nothing in the engine does this) would need `forget(encoder)`.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

import torch
from torch import Tensor, nn

from h3engine.engine.conditioning.presentation import Presentation

# The states of a 1,536-token prompt are ~16 MB, a Ref2VA request's with pictures ~40 MB.
DEFAULT_CAPACITY_BYTES = 512 << 20


def presentation_key(presentation: Presentation) -> str:
    """A digest of what the text encoder reads: token ids and pixel tensors (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in (("input_ids", presentation.input_ids), *sorted(presentation.vision_inputs.items())):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


class TextStateCache:
    """Recent text-encoder states per encoder module, on the host (see the module docstring)."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: weakref.WeakKeyDictionary[nn.Module, OrderedDict[str, Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self.hits = 0
        self.misses = 0

    def get(self, encoder: nn.Module, key: str) -> Tensor | None:
        entries = self._entries.get(encoder)
        if entries is None or key not in entries:
            self.misses += 1
            return None
        entries.move_to_end(key)
        self.hits += 1
        return entries[key]

    def put(self, encoder: nn.Module, key: str, states: Tensor) -> None:
        """Keep a host copy of `states` (a request's: [L, hidden]); drops the least recently used past the bound."""
        entries = self._entries.setdefault(encoder, OrderedDict())
        entries[key] = states.detach().to("cpu", copy=True)
        entries.move_to_end(key)
        while len(entries) > 1 and self.size_bytes(encoder) > self.capacity_bytes:
            entries.popitem(last=False)

    def size_bytes(self, encoder: nn.Module) -> int:
        entries = self._entries.get(encoder, {})
        return sum(states.numel() * states.element_size() for states in entries.values())

    def forget(self, encoder: nn.Module) -> None:
        self._entries.pop(encoder, None)


# The engine's: one per process (every encoder module keyed apart).
TEXT_STATES = TextStateCache()
