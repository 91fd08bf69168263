"""bf16 GEMM rate at the DiT's block shapes (768p / 5 s: 38,222 packed rows), to place the forward's time against the
751 TFLOP/s 8192^3 ceiling: q/k/v as three GEMMs (what the model runs) or one, out_proj, fc1, fc2.

    python benchmarks/gemm_shapes.py --output-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import device_label  # noqa: E402

ROWS, HIDDEN, INNER, FFN = 38_222, 5376, 7168, 14336
SHAPES = {
    "q_or_k_or_v": (ROWS, HIDDEN, INNER, 3),
    "qkv_fused": (ROWS, HIDDEN, 3 * INNER, 1),
    "out_proj": (ROWS, INNER, HIDDEN, 1),
    "fc1": (ROWS, HIDDEN, 2 * FFN, 1),
    "fc1_half": (ROWS, HIDDEN, FFN, 0),  # gate or value alone: would fc1 as two GEMMs be faster?
    "fc2": (ROWS, FFN, HIDDEN, 1),
    "square_8192": (8192, 8192, 8192, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument(
        "--blas",
        default="cublas",
        help="comma-separated torch BLAS back ends to time (torch.backends.cuda.preferred_blas_library), e.g. "
        "cublas,cublaslt; results are keyed by back end after the first",
    )
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    backends = [name.strip() for name in args.blas.split(",") if name.strip()]
    results = {}
    for index, backend in enumerate(backends):
        if backend == "tunableop":
            # PyTorch's TunableOp: every GEMM shape is timed over the BLAS libraries' algorithms on first use and
            # the fastest kept (results in the output folder, loadable by a later process).
            torch.backends.cuda.preferred_blas_library("cublas")
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            torch.cuda.tunable.set_filename(str(args.output_dir / "tunableop_results.csv"))
            torch.cuda.tunable.set_max_tuning_duration(200)  # ms per candidate algorithm
            if hasattr(torch.cuda.tunable, "set_cublaslt_requested_algo_count"):
                torch.cuda.tunable.set_cublaslt_requested_algo_count(32)
        else:
            torch.cuda.tunable.enable(False)
            torch.backends.cuda.preferred_blas_library(backend)
        print(f"BLAS back end: {backend}")
        timed = time_shapes()
        if index == 0:
            results = timed
        else:
            results[f"blas_{backend}"] = timed
    record = {
        "benchmark": "gemm_shapes",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "blas": backends[0],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "results": results,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    label = device_label(torch.device("cuda"))
    (args.output_dir / f"gemm_shapes_{label}_{datetime.date.today():%Y%m%d}.json").write_text(
        json.dumps(record, indent=2) + "\n"
    )


def time_shapes() -> dict:
    """Each block shape's GEMM time with the current BLAS back end, and one block's linear time from them."""
    results = {}
    block_ms = 0.0
    for name, (m, k, n, per_block) in SHAPES.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ms = triton.testing.do_bench(lambda a=a, w=w: torch.nn.functional.linear(a, w), warmup=50, rep=300)
        tflops = 2 * m * k * n / ms / 1e9
        # The same product with the weight stored transposed ([k, n], a plain a @ w): BLAS sees other operand
        # layouts and may pick another kernel.
        w_kn = w.t().contiguous()
        ms_kn = triton.testing.do_bench(lambda a=a, w_kn=w_kn: a @ w_kn, warmup=50, rep=300)
        results[name] = {
            "m": m,
            "k": k,
            "n": n,
            "ms": ms,
            "tflops": tflops,
            "per_block": per_block,
            "weight_kn_ms": ms_kn,
            "weight_kn_tflops": 2 * m * k * n / ms_kn / 1e9,
        }
        if name != "qkv_fused":
            block_ms += ms * per_block
        print(f"{name:>12}: {ms:8.3f} ms  {tflops:6.0f} TFLOP/s   weight [k, n]: {ms_kn:8.3f} ms")
        del a, w, w_kn
    results["block_linear_ms_three_qkv_gemms"] = block_ms
    results["block_linear_ms_fused_qkv"] = (
        block_ms - 3 * results["q_or_k_or_v"]["ms"] + results["qkv_fused"]["ms"]
    )
    print(
        f"block linears: {block_ms:.2f} ms (three q/k/v GEMMs), {results['block_linear_ms_fused_qkv']:.2f} ms (fused)"
    )
    return results


if __name__ == "__main__":
    main()
