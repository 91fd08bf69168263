"""FlashAttention-4's SM90 forward tile configurations at the DiT's packed shape (768p / 5 s: 38,222 rows x 56 heads x
128), against torch's cuDNN SDPA: time, TFLOP/s and error (relative L2 against an fp32 computation of a slice of the
query rows). FA4 picks 128 x 128 tiles for head_dim 128 on Hopper; its own config search lists wider ones that fit.

    python -m benchmarks.attention_configs --output-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks._common import RESULTS_DIR, device_label, package_version, sustained_ms
from h3engine.models import attention as attention_ops

ROWS, HEADS, HEAD_DIM = 38_222, 56, 128
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap, threads): FA4's default for head_dim 128 first, then the feasible
# wider tiles of flash_attn/cute/sm90_config_search.py (192-row tiles need a third MMA warp group).
CONFIGS = [
    (128, 128, True, True, 384),
    (128, 144, True, True, 384),
    (128, 160, True, True, 384),
    (128, 176, True, True, 384),
    (128, 192, True, True, 384),
    (128, 176, True, False, 384),
    (192, 128, True, False, 512),
    (192, 128, False, False, 512),
    (192, 112, True, False, 512),
    (192, 96, True, False, 512),
]
REFERENCE_QUERY_ROWS = 2048
# One DiT block's GEMMs at the packed shape, (rows, in, out): q, k, v, out_proj, fc1, fc2 (--sustained-s).
HIDDEN, FFN = 5376, 14336
BLOCK_GEMMS = [(HIDDEN, HEADS * HEAD_DIM)] * 3 + [
    (HEADS * HEAD_DIM, HIDDEN),
    (HIDDEN, 2 * FFN),
    (FFN, HIDDEN),
]


def fp32_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int) -> torch.Tensor:
    """Exact attention of the first `rows` query rows in fp32, head by head: [rows, heads, head_dim]."""
    outputs = []
    for head in range(query.shape[1]):
        q = query[:rows, head].float()
        scores = q @ key[:, head].float().T / HEAD_DIM**0.5
        outputs.append(torch.softmax(scores, dim=-1) @ value[:, head].float())
    return torch.stack(outputs, dim=1)


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--sustained-s",
        type=float,
        default=0.0,
        help="also time each variant for this many seconds between one block's GEMMs (power-limited clocks)",
    )
    args = parser.parse_args()
    from flash_attn.cute.interface import _flash_attn_fwd

    generator = torch.Generator(device="cuda").manual_seed(0)
    query, key, value = (
        torch.randn(ROWS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(3)
    )
    flops = 4 * ROWS * ROWS * HEADS * HEAD_DIM
    reference = fp32_reference(query, key, value, REFERENCE_QUERY_ROWS)
    results = {}
    gemms = []
    if args.sustained_s > 0:
        block_input = {
            size: torch.randn(ROWS, size, device="cuda", dtype=torch.bfloat16)
            for size in (HIDDEN, FFN, HEADS * HEAD_DIM)
        }
        gemms = [
            (
                block_input[size_in],
                torch.randn(size_out, size_in, device="cuda", dtype=torch.bfloat16) / size_in**0.5,
            )
            for size_in, size_out in BLOCK_GEMMS
        ]

    def record(name: str, run) -> None:
        output = run()
        ms = triton.testing.do_bench(run, warmup=5, rep=200)
        results[name] = {
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "relative_l2_vs_fp32": relative_l2(output[:REFERENCE_QUERY_ROWS], reference),
        }
        error = results[name]["relative_l2_vs_fp32"]
        line = f"{name:>28}: {ms:7.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s  vs fp32 {error:.2e}"
        if gemms:
            sustained = sustained_ms(
                run, args.sustained_s, between=lambda: [F.linear(rows, weight) for rows, weight in gemms]
            )
            results[name].update({"sustained_ms": sustained, "sustained_tflops": flops / sustained / 1e9})
            line += f"  between GEMMs: {sustained:7.2f} ms {flops / sustained / 1e9:6.0f} TFLOP/s"
        print(line)

    record("cudnn_sdpa", lambda: attention_ops.cudnn_attention(query, key, value))
    q4, k4, v4 = (tensor.unsqueeze(0) for tensor in (query, key, value))
    for tile_m, tile_n, rs, overlap, threads in CONFIGS:
        name = f"fa4_{tile_m}x{tile_n}_rs{int(rs)}_ol{int(overlap)}"

        def run(tile_m=tile_m, tile_n=tile_n, rs=rs, overlap=overlap, threads=threads) -> torch.Tensor:
            output = _flash_attn_fwd(
                q4,
                k4,
                v4,
                tile_mn=(tile_m, tile_n),
                mma_pv_is_rs=rs,
                intra_wg_overlap=overlap,
                num_threads=threads,
            )
            return output[0][0]  # (out, lse, ...) -> out [1, S, heads, head_dim] -> [S, heads, head_dim]

        try:
            record(name, run)
        except Exception as error:  # noqa: BLE001 - an infeasible tile is a result, not a failure
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(f"{name:>28}: failed ({results[name]['error'][:120]})")
    record("fa4_public_default", lambda: attention_ops.fa4_attention(query, key, value))
    output = {
        "benchmark": "attention_configs",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flash_attn_4": package_version("flash-attn-4"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": {"rows": ROWS, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "flop": flops,
        "error_reference": f"fp32 attention of the first {REFERENCE_QUERY_ROWS} query rows",
        "timing": "ms: triton do_bench (short bursts); sustained_ms: median over the second half of "
        f"{args.sustained_s} s of attention calls, each followed by one block's GEMMs",
        "results": results,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = (
        args.output_dir
        / f"attention_configs_{device_label(torch.device('cuda'))}_{datetime.date.today():%Y%m%d}.json"
    )
    path.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
