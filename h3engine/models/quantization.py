"""Optional FP8 (e4m3) linear layers for the DiT blocks: weights quantized once, activations per call.

`quantize_dit_linears(dit)` replaces, in place, the four big GEMMs of every `DiTBlock` (attn.qkv_proj,
attn.out_proj, mlp.fc1, mlp.fc2) with `Fp8Linear` layers (numerics on the class) and drops their bf16 weights;
everything else keeps its dtype (the fp32 islands stay fp32). It works on the single-process DiT and on the
tensor-parallel one (`h3engine.models.parallel.dit`), whose row-parallel layers keep their sum over the group. Attention
finds `Fp8Linear.forward_chunks` by name (q, k, v from one quantization of x), so `h3engine.models.dit` never
imports this module (which imports it).

Danger: inference only. Quantize after loading (and after `modulation.offload_adaln`, before a `Placement` adopts the
model): the fp8 weight and scales are non-persistent buffers that `state_dict()` / `load_state_dict()` do not see.
Never cast the model with `.to(dtype)` (that converts the fp8 buffers too). The bf16 weights are freed only if
nothing else holds the replaced modules. Under tensor parallelism each rank quantizes its own shard, so FP8
results depend on the tensor-parallel degree at the quantization-noise level.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from h3engine.checkpoint.fp8_rows import FP8_DTYPE as FP8_DTYPE
from h3engine.checkpoint.fp8_rows import FP8_MAX as FP8_MAX
from h3engine.checkpoint.fp8_rows import dequantize_rows, quantize_rows
from h3engine.models.dit import H3DiT
from h3engine.models.parallel.collectives import all_reduce_sum
from h3engine.models.parallel.groups import GroupMembership
from h3engine.models.parallel.linear import ColumnParallelLinear, RowParallelLinear

# `torch._scaled_mm` needs both dimensions of its (column-major) second operand to be multiples of this.
_SCALED_MM_ALIGNMENT = 16
# Rowwise-scaled FP8 GEMMs exist from compute capability 8.9 (Ada) on.
_SCALED_MM_MIN_CAPABILITY = (8, 9)
# The DiT block layers that are quantized, as (submodule, attribute) paths inside a DiTBlock.
_QUANTIZED_BLOCK_LAYERS = (("attn", "qkv_proj"), ("attn", "out_proj"), ("mlp", "fc1"), ("mlp", "fc2"))


@functools.cache
def _device_has_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= _SCALED_MM_MIN_CAPABILITY


def scaled_mm_supported(weight_fp8: Tensor) -> bool:
    """Whether `fp8_matmul` takes the `torch._scaled_mm` path for this [N, K] fp8 weight (see the module doc)."""
    rows, columns = weight_fp8.shape
    aligned = rows % _SCALED_MM_ALIGNMENT == 0 and columns % _SCALED_MM_ALIGNMENT == 0
    return aligned and _device_has_fp8_gemm(weight_fp8.device)


def fp8_matmul_scaled_mm(
    input_fp8: Tensor, input_scales: Tensor, weight_fp8: Tensor, weight_scales: Tensor
) -> Tensor:
    """x8 [M, K] row-major, scales [M, 1]; W8 [N, K] contiguous, scales [N, 1] -> bf16 [M, N] via `_scaled_mm`.

    `_scaled_mm` multiplies its operands by the given scales (dequantization scales, not their inverses); rowwise
    scaling takes scale_a as [M, 1] and scale_b as [1, N], both fp32 and contiguous, and bf16 output only.
    """
    return torch._scaled_mm(
        input_fp8,
        weight_fp8.t(),
        scale_a=input_scales,
        scale_b=weight_scales.view(1, -1),
        out_dtype=torch.bfloat16,
    )


def fp8_matmul_reference(
    input_fp8: Tensor,
    input_scales: Tensor,
    weight_fp8: Tensor,
    weight_scales: Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The same product in plain torch: both operands dequantized to fp32, one fp32 matmul, cast to out_dtype."""
    product = dequantize_rows(input_fp8, input_scales) @ dequantize_rows(weight_fp8, weight_scales).t()
    return product.to(out_dtype)


def fp8_matmul(
    input_fp8: Tensor, input_scales: Tensor, weight_fp8: Tensor, weight_scales: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """[M, N] = dequant(x8) @ dequant(W8)^T in out_dtype, by `_scaled_mm` where supported, else the reference."""
    if scaled_mm_supported(weight_fp8):
        return fp8_matmul_scaled_mm(input_fp8, input_scales, weight_fp8, weight_scales).to(out_dtype)
    return fp8_matmul_reference(input_fp8, input_scales, weight_fp8, weight_scales, out_dtype)


class Fp8Linear(nn.Module):
    """Bias-free y = x W^T with W held in e4m3 with per-output-row scales; x is quantized per row each call.

    * W [N, K] is quantized once per output row: scale_w[n] = amax(|W[n, :]|) / 448 (fp32), W8 = e4m3(W / scale_w);
      x per call, per row (token), the same way: scale_x[m] = amax(|x[m, :]|) / 448. A zero row gets the smallest
      normal fp32 scale instead of 0 and quantizes to zeros (no 0/0).
    * y = (x8 * scale_x) @ (W8 * scale_w)^T by one of two paths that agree to the output rounding:
      `torch._scaled_mm` (fp32 accumulation, bf16 output) when the weight is on a CUDA device of compute capability
      >= 8.9 and N and K are multiples of 16 (its layout rule); otherwise the plain-torch reference (both operands
      dequantized to fp32, fp32 matmul): the CPU path and the fallback for small layers (the tiny test DiT) even on
      a GPU. The result is in x's dtype (an fp32 input on the `_scaled_mm` path is rounded to bf16 on the way).
    * Each e4m3 value carries 3 mantissa bits: an element in the normal range (|x / scale| >= 2^-6) is off by at
      most 2^-4 of itself, a smaller one by at most 2^-10 * scale.

    `sum_group`: the tensor-parallel group over which a row-parallel layer's partial products are summed (as
    `RowParallelLinear` does); a group of one (the default) sums nothing.
    """

    def __init__(self, weight: Tensor, sum_group: GroupMembership | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"Fp8Linear needs a 2-D float weight, got {weight.dtype} {list(weight.shape)}")
        if weight.is_meta:
            raise ValueError("Fp8Linear needs a loaded weight, got one on the meta device")
        self.out_features, self.in_features = weight.shape
        self.sum_group = sum_group if sum_group is not None else GroupMembership.alone()
        weight_fp8, weight_scales = quantize_rows(weight.detach())
        self.register_buffer("weight_fp8", weight_fp8, persistent=False)
        self.register_buffer("weight_scales", weight_scales, persistent=False)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, sum_group_size={self.sum_group.size}"

    def forward(self, hidden: Tensor) -> Tensor:
        input_fp8, input_scales = self._quantize_input(hidden)
        output = fp8_matmul(input_fp8, input_scales, self.weight_fp8, self.weight_scales, hidden.dtype)
        return all_reduce_sum(output.view(*hidden.shape[:-1], self.out_features), self.sum_group)

    def forward_chunks(self, hidden: Tensor, num_parts: int) -> tuple[Tensor, ...]:
        """The outputs of the weight's `num_parts` equal row blocks, in row order, each its own contiguous GEMM.

        Equal to `forward(hidden).chunk(num_parts, dim=-1)` up to rounding; x is quantized once for all parts.
        """
        if num_parts < 1 or self.out_features % num_parts:
            raise ValueError(f"cannot split {self.out_features} output features into {num_parts} equal parts")
        input_fp8, input_scales = self._quantize_input(hidden)
        part_rows = self.out_features // num_parts
        outputs = []
        for start in range(0, self.out_features, part_rows):
            rows = slice(start, start + part_rows)
            output = fp8_matmul(
                input_fp8, input_scales, self.weight_fp8[rows], self.weight_scales[rows], hidden.dtype
            )
            outputs.append(all_reduce_sum(output.view(*hidden.shape[:-1], part_rows), self.sum_group))
        return tuple(outputs)

    def _quantize_input(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        if hidden.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expects {self.in_features} input features, got {list(hidden.shape)}")
        return quantize_rows(hidden.reshape(-1, self.in_features))


def _fp8_replacement(layer: nn.Module, name: str) -> Fp8Linear:
    """The Fp8Linear computing what `layer` (an nn.Linear without bias or a tensor-parallel linear) computes."""
    if isinstance(layer, RowParallelLinear):
        return Fp8Linear(layer.weight, layer.group)
    if isinstance(layer, ColumnParallelLinear):
        return Fp8Linear(layer.weight)
    if isinstance(layer, nn.Linear):
        if layer.bias is not None:
            raise ValueError(f"{name}: Fp8Linear has no bias, but this layer has one")
        return Fp8Linear(layer.weight)
    if isinstance(layer, Fp8Linear):
        raise ValueError(f"{name} is already an Fp8Linear: quantize_dit_linears ran twice on this DiT")
    raise TypeError(f"{name}: cannot quantize a {type(layer).__name__}")


def quantize_dit_linears(dit: H3DiT) -> int:
    """Swap `Fp8Linear` into qkv_proj, out_proj, fc1 and fc2 of every DiT block in place; returns how many.

    The token refiner and every other layer stay as they are (see the module docstring). Weights must be loaded.
    """
    converted = 0
    with torch.no_grad():
        for index, block in enumerate(dit.blocks):
            for owner_name, layer_name in _QUANTIZED_BLOCK_LAYERS:
                owner = getattr(block, owner_name)
                name = f"blocks.{index}.{owner_name}.{layer_name}"
                setattr(owner, layer_name, _fp8_replacement(getattr(owner, layer_name), name))
                converted += 1
    return converted


def fp8_error_report(reference: Tensor, candidate: Tensor) -> dict[str, float]:
    """How far `candidate` (e.g. an FP8 run) is from `reference` (e.g. bf16), computed in fp64.

    relative_l2 = ||candidate - reference|| / ||reference||, max_abs = max |candidate - reference|,
    max_relative = max_abs / max |reference| (the measure of the DiT tests).
    """
    if reference.shape != candidate.shape:
        raise ValueError(
            f"fp8_error_report: reference {list(reference.shape)} and candidate {list(candidate.shape)} differ"
        )
    reference, candidate = reference.double(), candidate.double()
    reference_norm = torch.linalg.vector_norm(reference).item()
    if reference_norm == 0:
        raise ValueError("fp8_error_report: the reference is all zeros, relative errors are undefined")
    difference = candidate - reference
    max_abs = difference.abs().max().item()
    return {
        "relative_l2": torch.linalg.vector_norm(difference).item() / reference_norm,
        "max_abs": max_abs,
        "max_relative": max_abs / reference.abs().max().item(),
    }
