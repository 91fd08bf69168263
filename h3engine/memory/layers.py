"""Which layers of each model repeat, and which of their tensors a streamed placement moves.

A `LayerSpec`: a model's repeated layers in the order one pass runs them, the submodules of a layer whose tensors
stream (`streamed_parts`; "" is the whole layer), and the submodules whose calls open (`entry`, forward pre-hook)
and close (`exit`, forward hook) a layer's use. The DiT (refiner blocks, then main blocks) and the video decoder
stream only their attention and feed-forward: each block also reads the NEXT block's first norm (fused residual and
norm), so norms stay. The text encoder streams its 50 Qwen3-VL decoder layers whole. The DiT's AdaLN projections
are not layers here (h3engine.engine.sampling.modulation streams them once per request); the audio VAE has none.

Danger: the specs name attributes of our modules and of transformers' Qwen3-VL; a renamed attribute raises here,
at load, rather than streaming nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerSpec:
    layers: tuple[nn.Module, ...]
    streamed_parts: tuple[str, ...]
    entry: str
    exit: str

    def parts_of(self, layer: nn.Module) -> list[nn.Module]:
        return [layer.get_submodule(path) for path in self.streamed_parts]


def _spec(layers: Sequence[nn.Module], parts: tuple[str, ...], entry: str, exit: str) -> LayerSpec:
    spec = LayerSpec(tuple(layers), parts, entry, exit)
    for layer in spec.layers:
        for path in (*parts, entry, exit):
            layer.get_submodule(path)  # AttributeError naming the path when the model no longer has it
    return spec


def dit_layers(dit: nn.Module) -> LayerSpec:
    return _spec([*dit.token_refiner.blocks, *dit.blocks], ("attn", "mlp"), entry="attn", exit="mlp")


def text_encoder_layers(encoder: nn.Module) -> LayerSpec:
    return _spec(encoder.model.language_model.layers, ("",), entry="", exit="")


def video_decoder_layers(video_vae: nn.Module) -> LayerSpec:
    return _spec(video_vae.decoder.transformer_blocks, ("attn", "ff"), entry="", exit="")


# `pipeline.Models` field -> its layers (a model absent here has none).
LAYER_SPECS = {
    "dit": dit_layers,
    "text_encoder": text_encoder_layers,
    "video_vae": video_decoder_layers,
}


def layer_spec(model_name: str, module: nn.Module) -> LayerSpec | None:
    """The spec of a `pipeline.Models` field's module (None: a model without streamed layers)."""
    make = LAYER_SPECS.get(model_name)
    return None if make is None else make(module)
