"""Quantized DiT linears (h3engine.models.stored_linear) against bf16 ones at the released shapes, on one GPU.

Forms: the GGUF block types community H3 files use and three ComfyUI scaled forms (FP8_E4M3 x a tensor scale, INT8
x row scales, INT8 ConvRot 256). For each and each of a DiT block's four large linears (qkv 21504 x 5376, out 5376 x
7168, fc1 28672 x 5376, fc2 5376 x 14336), a random bf16 weight (std 0.02) is quantized by our own writers
(gguf_quantize.quantize; single_file_formats' quantize_fp8_tensor / quantize_int8 / quantize_int8_convrot) and
timed (medians): the dequantization (Triton kernel and its plain-torch twin, h3engine.models.gguf_ops / scaled_ops;
the bandwidth the kernel path reaches on its bytes in + bf16 bytes out), and a StoredLinear forward over S = 38,222
rows (768p / 5 s T2VA) against `F.linear` with the bf16 weight, as a ratio. The error columns compare the
StoredLinear output y with y_bf16 = F.linear(hidden, bf16 weight) over the first ERROR_ROWS hidden rows:
max|y - y_bf16| / max|y_bf16| and the relative RMS error. Then the cost per DiT step: 50 blocks x the four linears,
per form, against bf16. JSON goes to --output-dir.

    python -m benchmarks.gguf_linears                                    # GPU, JSON to benchmarks/results/
    python -m benchmarks.gguf_linears --types Q4_K,INT8_ROW,FP8_E4M3_TENSOR
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch import Tensor

from benchmarks._common import RESULTS_DIR, device_label, package_version
from h3engine.checkpoint import gguf_blocks, gguf_quantize, single_file_formats
from h3engine.checkpoint.gguf_blocks import GGMLType
from h3engine.models import gguf_ops, ops, scaled_ops
from h3engine.models.stored_linear import StoredLinear, WeightForm

SEQUENCE_LENGTH = 38_222
BLOCKS = 50
LINEARS = {"qkv_proj": (21504, 5376), "out_proj": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")
WEIGHT_STD = 0.02
# Hidden rows the error columns are computed over (the first ones of the benchmark's hidden states).
ERROR_ROWS = 4096


@dataclass(frozen=True)
class Form:
    """A stored form under test: its label in the results, its WeightForm, and how our writer makes it."""

    label: str
    form: WeightForm

    def quantize(self, weight: Tensor) -> tuple[Tensor, Tensor | None]:
        """A bf16 weight [out, in] -> (its bytes, uint8 [out, row bytes], and the scale of a scaled form), on
        the weight's device."""
        if self.form.ggml_type is not None:
            return gguf_quantize.quantize(weight.float(), self.form.ggml_type).to(weight.device), None
        if self.form.rotation_group:
            values, scale = single_file_formats.quantize_int8_convrot(weight, self.form.rotation_group)
        elif self.form.values_dtype == torch.int8:
            values, scale = single_file_formats.quantize_int8(weight, per_row=self.form.scale_per_row)
        else:
            values, scale = single_file_formats.quantize_fp8_tensor(weight, self.form.values_dtype)
        return values.view(torch.uint8), scale

    def dequantizers(self, stored: StoredLinear) -> tuple[Callable[[], Tensor], Callable[[], Tensor]]:
        """(the dispatch's dequantization to bf16, the twin's) of a layer's stored tensors."""
        shape = (stored.out_features, stored.in_features)
        if self.form.ggml_type is not None:
            raw, kind = stored.quantized, self.form.ggml_type
            return (
                lambda: gguf_ops.dequantize(raw, kind, shape, out_dtype=torch.bfloat16),
                lambda: gguf_blocks.dequantize(raw, kind, shape).to(torch.bfloat16),
            )
        values, scale = stored.quantized.view(self.form.values_dtype), stored.scale
        group = self.form.rotation_group or None
        return (
            lambda: scaled_ops.dequantize(values, scale, group, torch.bfloat16),
            lambda: single_file_formats.dequantize_scaled(values, scale, group, torch.bfloat16),
        )

    def implementation(self, stored: StoredLinear) -> str:
        """Which path the layer's dequantization takes ('triton' or 'reference')."""
        if self.form.ggml_type is not None:
            shape = (stored.out_features, stored.in_features)
            return gguf_ops.implementation(stored.quantized, self.form.ggml_type, shape, torch.bfloat16)
        values = stored.quantized.view(self.form.values_dtype)
        group = self.form.rotation_group or None
        return scaled_ops.implementation(values, stored.scale, group, torch.bfloat16)


# --types names -> forms: the GGUF types by ggml name, then the scaled forms.
FORMS = {name: Form(name, WeightForm.gguf(GGMLType[name])) for name in GGUF_TYPES} | {
    "FP8_E4M3_TENSOR": Form("FP8_E4M3 tensor scale", WeightForm(values_dtype=torch.float8_e4m3fn)),
    "INT8_ROW": Form("INT8 row scale", WeightForm(values_dtype=torch.int8, scale_per_row=True)),
    "INT8_CONVROT_256": Form(
        "INT8 ConvRot 256", WeightForm(values_dtype=torch.int8, scale_per_row=True, rotation_group=256)
    ),
}


def median_ms(run: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"))


def output_errors(layer: StoredLinear, weight: Tensor, hidden: Tensor) -> dict:
    """max|y - y_bf16| / max|y_bf16| and ||y - y_bf16|| / ||y_bf16|| of the layer against F.linear(hidden, weight)."""
    expected = F.linear(hidden, weight).float()
    difference = layer(hidden).float() - expected
    return {
        "error_rows": hidden.shape[0],
        "relative_max_error": float(difference.abs().max() / expected.abs().max()),
        "relative_rms_error": float(
            torch.linalg.vector_norm(difference) / torch.linalg.vector_norm(expected)
        ),
    }


def stored_layer(form: Form, weight: Tensor) -> StoredLinear:
    """A StoredLinear (no bias) holding `weight` quantized in `form`, on the weight's device."""
    out_features, in_features = weight.shape
    layer = StoredLinear(
        in_features, out_features, form.form, bias=False, dtype=torch.bfloat16, device=weight.device
    )
    raw, scale = form.quantize(weight)
    layer.quantized.copy_(raw)
    if scale is not None:
        layer.scale.copy_(scale.reshape(layer.scale.shape))
    return layer


def measure(
    form: Form,
    name: str,
    shape: tuple[int, int],
    hidden: Tensor,
    timer: Callable[[Callable[[], object]], float] = median_ms,
) -> dict:
    """One row of the results: `form` at the linear `name` of `shape` [out, in], over `hidden` [S, in] (bf16)."""
    generator = torch.Generator(device=hidden.device).manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator, device=hidden.device) * WEIGHT_STD).to(torch.bfloat16)
    layer = stored_layer(form, weight)
    dequantize, twin_dequantize = form.dequantizers(layer)
    dequantized = layer.weight
    kernel_ms = timer(dequantize)
    twin_ms = timer(twin_dequantize)
    with ops.force_reference():
        twin = layer.weight
    stored_ms = timer(lambda: layer(hidden))
    bf16_ms = timer(lambda: F.linear(hidden, weight))
    stored_bytes = sum(tensor.numel() * tensor.element_size() for tensor in layer.stored())
    moved = stored_bytes + dequantized.numel() * 2
    return {
        "type": form.label,
        "linear": name,
        "shape": list(shape),
        "dequant_path": form.implementation(layer),
        "bytes_stored": stored_bytes,
        "bytes_bf16": weight.numel() * 2,
        "dequant_triton_ms": kernel_ms,
        "dequant_twin_ms": twin_ms,
        "dequant_speedup": twin_ms / kernel_ms,
        "dequant_gbps": moved / kernel_ms / 1e6,
        "triton_equals_twin": bool(torch.equal(dequantized, twin)),
        "stored_forward_ms": stored_ms,
        "bf16_forward_ms": bf16_ms,
        "forward_ratio": stored_ms / bf16_ms,
        **output_errors(layer, weight, hidden[:ERROR_ROWS]),
    }


def per_step(rows: list[dict], labels: list[str]) -> dict:
    """Per form: the 200 block linears of a DiT step (50 blocks x the four measured), time and size, vs bf16."""
    summary = {}
    for label in labels:
        mine = [row for row in rows if row["type"] == label]
        summary[label] = {
            "stored_ms": BLOCKS * sum(row["stored_forward_ms"] for row in mine),
            "bf16_ms": BLOCKS * sum(row["bf16_forward_ms"] for row in mine),
            "stored_gib": BLOCKS * sum(row["bytes_stored"] for row in mine) / 2**30,
            "bf16_gib": BLOCKS * sum(row["bytes_bf16"] for row in mine) / 2**30,
            "max_relative_max_error": max(row["relative_max_error"] for row in mine),
            "max_relative_rms_error": max(row["relative_rms_error"] for row in mine),
        }
        summary[label]["ratio"] = summary[label]["stored_ms"] / summary[label]["bf16_ms"]
        print(f"{label}: the 200 block linears of a step {summary[label]}")
    return summary


def print_row(row: dict) -> None:
    print(
        f"{row['type']:22} {row['linear']:8} dequant {row['dequant_triton_ms']:.3f} ms ({row['dequant_gbps']:.0f} "
        f"GB/s, twin x{row['dequant_speedup']:.1f}) forward {row['stored_forward_ms']:.2f} ms vs bf16 "
        f"{row['bf16_forward_ms']:.2f} ({row['forward_ratio']:.3f}x) equal={row['triton_equals_twin']} "
        f"error max {row['relative_max_error']:.2e} rms {row['relative_rms_error']:.2e}"
    )


def parse_types(text: str) -> list[Form]:
    """`--types`: comma-separated names of FORMS (GGUF type names, FP8_E4M3_TENSOR, INT8_ROW, INT8_CONVROT_256)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FORMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown types {unknown}; choose from {', '.join(FORMS)}")
    return [FORMS[name] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--types", type=parse_types, default=list(FORMS.values()), help=f"any of {', '.join(FORMS)}"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    hidden = {}
    for form in args.types:
        for name, shape in LINEARS.items():
            if shape[1] not in hidden:
                hidden[shape[1]] = torch.randn(SEQUENCE_LENGTH, shape[1], device=device).to(torch.bfloat16)
            rows.append(measure(form, name, shape, hidden[shape[1]]))
            print_row(rows[-1])
            if rows[-1]["dequant_path"] != "triton":
                raise SystemExit(
                    f"{form.label} {name}: the dispatch took the torch twin, not the Triton kernel"
                )
    result = {
        "benchmark": "gguf_linears",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device),
        "versions": {name: package_version(name) for name in ("torch", "triton", "gguf")},
        "sequence_length": SEQUENCE_LENGTH,
        "dtype": "bfloat16",
        "weight_std": WEIGHT_STD,
        "error_rows": min(ERROR_ROWS, SEQUENCE_LENGTH),
        "rows": rows,
        "per_step_block_linears": per_step(rows, [form.label for form in args.types]),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().strftime("%Y%m%d")
    out = args.output_dir / f"gguf_linears_{device_label(device)}_{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
