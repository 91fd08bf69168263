"""GGUF-quantized DiT linears (h3engine.models.stored_linear) against bf16 ones at the released shapes, on one GPU.

For each block-quantized type community H3 files use and each of a DiT block's four large linears (qkv 21504 x 5376,
out 5376 x 7168, fc1 28672 x 5376, fc2 5376 x 14336): the median time of the dequantization (Triton kernel and its
plain-torch twin, h3engine.models.gguf_ops; the bandwidth the kernel reaches on its bytes in + bf16 bytes out) and
of a StoredLinear forward over S = 38,222 rows (768p / 5 s T2VA) against `F.linear` with a bf16 weight, as a ratio.
The weights are random bytes with finite fp16 scales (the time of a dequantization does not depend on the values).
Then the cost per DiT step: 50 blocks x the four linears, per type, against bf16. JSON goes to --output-dir.

    python -m benchmarks.gguf_linears                          # GPU, JSON to benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks._common import RESULTS_DIR, device_label, package_version
from h3engine.checkpoint import gguf_blocks
from h3engine.checkpoint.gguf_blocks import BLOCK_FORMATS, GGMLType
from h3engine.models import gguf_ops, ops
from h3engine.models.stored_linear import StoredLinear, WeightForm

SEQUENCE_LENGTH = 38_222
BLOCKS = 50
LINEARS = {"qkv_proj": (21504, 5376), "out_proj": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")
# Byte offsets of each type's fp16 scale fields inside a block (set to finite values so no NaN slows a path).
FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(kind: GGMLType, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    layout = BLOCK_FORMATS[kind]
    rows, columns = shape
    blocks = rows * columns // layout.block_size
    raw = torch.randint(0, 256, (blocks, layout.type_size), dtype=torch.uint8, device=device)
    scale = torch.full((blocks, 1), 1e-3, dtype=torch.float16, device=device).view(torch.uint8)
    for offset in FP16_FIELDS[kind.name]:
        raw[:, offset : offset + 2] = scale
    return raw.view(rows, -1)


def median_ms(run) -> float:
    return float(triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"))


def measure(kind: GGMLType, name: str, shape: tuple[int, int], device: torch.device, hidden) -> dict:
    raw = random_blocks(kind, shape, device)
    layer = StoredLinear(
        shape[1], shape[0], WeightForm.gguf(kind), bias=False, dtype=torch.bfloat16, device=device
    )
    layer.quantized.copy_(raw)
    weight = layer.weight
    assert gguf_ops.implementation(raw, kind, shape, torch.bfloat16) == "triton"
    kernel_ms = median_ms(lambda: gguf_ops.dequantize(raw, kind, shape, out_dtype=torch.bfloat16))
    twin_ms = median_ms(lambda: gguf_blocks.dequantize(raw, kind, shape).to(torch.bfloat16))
    with ops.force_reference():
        twin = layer.weight
    stored_ms = median_ms(lambda: layer(hidden))
    bf16_ms = median_ms(lambda: F.linear(hidden, weight))
    moved = raw.numel() + weight.numel() * 2
    return {
        "type": kind.name,
        "linear": name,
        "shape": list(shape),
        "bytes_stored": raw.numel(),
        "bytes_bf16": weight.numel() * 2,
        "dequant_triton_ms": kernel_ms,
        "dequant_twin_ms": twin_ms,
        "dequant_speedup": twin_ms / kernel_ms,
        "dequant_gbps": moved / kernel_ms / 1e6,
        "triton_equals_twin": bool(torch.equal(weight, twin)),
        "stored_forward_ms": stored_ms,
        "bf16_forward_ms": bf16_ms,
        "forward_ratio": stored_ms / bf16_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    hidden = {}
    for kind_name in args.types.split(","):
        kind = GGMLType[kind_name]
        for name, shape in LINEARS.items():
            if shape[1] not in hidden:
                hidden[shape[1]] = torch.randn(SEQUENCE_LENGTH, shape[1], device=device).to(torch.bfloat16)
            rows.append(measure(kind, name, shape, device, hidden[shape[1]]))
            row = rows[-1]
            print(
                f"{row['type']:5} {name:8} dequant {row['dequant_triton_ms']:.3f} ms ({row['dequant_gbps']:.0f} GB/s, "
                f"twin x{row['dequant_speedup']:.1f}) forward {row['stored_forward_ms']:.2f} ms vs bf16 "
                f"{row['bf16_forward_ms']:.2f} ({row['forward_ratio']:.3f}x) equal={row['triton_equals_twin']}"
            )
    per_step = {}
    for kind_name in args.types.split(","):
        mine = [row for row in rows if row["type"] == kind_name]
        per_step[kind_name] = {
            "stored_ms": BLOCKS * sum(row["stored_forward_ms"] for row in mine),
            "bf16_ms": BLOCKS * sum(row["bf16_forward_ms"] for row in mine),
            "stored_gib": BLOCKS * sum(row["bytes_stored"] for row in mine) / 2**30,
            "bf16_gib": BLOCKS * sum(row["bytes_bf16"] for row in mine) / 2**30,
        }
        per_step[kind_name]["ratio"] = per_step[kind_name]["stored_ms"] / per_step[kind_name]["bf16_ms"]
        print(f"{kind_name}: the 200 block linears of a step {per_step[kind_name]}")
    result = {
        "benchmark": "gguf_linears",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device),
        "versions": {name: package_version(name) for name in ("torch", "triton", "gguf")},
        "sequence_length": SEQUENCE_LENGTH,
        "dtype": "bfloat16",
        "rows": rows,
        "per_step_block_linears": per_step,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().strftime("%Y%m%d")
    out = args.output_dir / f"gguf_linears_{device_label(device)}_{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
