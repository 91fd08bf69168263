"""Would fusing the block's elementwise ops into GEMM epilogues pay? quack's CuTe DSL GEMMs (FlashAttention-4's
dependency, so already on the GPU machine) at the DiT's block shapes (768p / 5 s: 38,222 packed rows), against what
the model runs now: a cuBLAS GEMM followed by our fused Triton op.

Per shape: cuBLAS alone and quack alone over a few SM90 tile configurations (is quack's GEMM as fast?); then per
fusion, cuBLAS + our op against one quack GEMM with the op in its epilogue:
- fc1 + SwiGLU (gate | value halves of fc1's output) -> [S, F];
- out_proj (or fc2) + gated residual: hidden + gate * (x @ W^T), one gate row per column;
- q (or k) + per-head RMSNorm + RoPE (quack rotates adjacent channel pairs; the model's NeoX layout would permute
  the weight's output channels to match; timing only).
Timing: do_bench bursts and a sustained loop (median of the second half of `--sustained-s` seconds, the GPU at its
power limit as inside a forward). Error: relative L2 against fp32 on the first 2,048 rows.

    python benchmarks/epilogue_gemms.py --output-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import device_label, package_version, sustained_ms  # noqa: E402
from h3engine import ops  # noqa: E402

ROWS, HIDDEN, HEADS, HEAD_DIM, FFN = 38_222, 5376, 56, 128, 14336
INNER = HEADS * HEAD_DIM
CHECK_ROWS = 2048
SHAPES = {"q": (HIDDEN, INNER), "out_proj": (INNER, HIDDEN), "fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}
# (tile_m, tile_n, cluster_m, cluster_n, pingpong): quack's SM90 default first, then its search space's neighbours.
CONFIGS = [
    (128, 192, 2, 1, True),
    (128, 128, 2, 1, True),
    (128, 208, 2, 1, True),
    (256, 128, 2, 1, False),
    (256, 192, 2, 1, False),
    (128, 256, 2, 1, False),
    (128, 192, 1, 2, True),
]


def relative_l2(value: torch.Tensor, expected: torch.Tensor) -> float:
    return float((value.float() - expected.float()).norm() / expected.float().norm())


def quack_config(tile_m: int, tile_n: int, cluster_m: int, cluster_n: int, pingpong: bool):
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        cluster_m=cluster_m,
        cluster_n=cluster_n,
        pingpong=pingpong,
        is_dynamic_persistent=False,
        device_capacity=9,
    )


def config_name(config: tuple[int, int, int, int, bool]) -> str:
    tile_m, tile_n, cluster_m, cluster_n, pingpong = config
    return f"{'pingpong' if pingpong else 'coop'}_{tile_m}x{tile_n}_cluster{cluster_m}x{cluster_n}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--sustained-s", type=float, default=3.0)
    parser.add_argument(
        "--configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to try per shape"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES)
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)

    import quack  # noqa: F401  (fails early when the CuTe DSL stack is absent)
    from quack.epilogue.library import identity_epi, swiglu_mod

    from benchmarks._quack_epilogues import gated_residual_epi, qk_norm_rope_epi

    x = {k: torch.randn(ROWS, k, device=device, dtype=torch.bfloat16) for k in {HIDDEN, INNER, FFN}}
    weights = {
        name: torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for name, (k, n) in SHAPES.items()
    }
    results: dict[str, dict[str, object]] = {}
    epilogue_configs: dict[str, str] = {}

    def record(name: str, run: Callable[[], torch.Tensor], expected_rows: torch.Tensor | None) -> None:
        began = time.perf_counter()
        try:
            output = run()
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - began
            burst = triton.testing.do_bench(run, warmup=25, rep=200)
            sustained = sustained_ms(run, args.sustained_s)
        except Exception as error:  # one variant failing must not stop the others
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:400]}")
            traceback.print_exc(limit=3)
            return
        entry: dict[str, object] = {
            "burst_ms": burst,
            "sustained_ms": sustained,
            "first_call_s": first_call_s,
        }
        if expected_rows is not None:
            entry["relative_l2_vs_fp32"] = relative_l2(output[:CHECK_ROWS], expected_rows)
        results[name] = entry
        print(
            f"{name}: burst {burst:.3f} ms, sustained {sustained:.3f} ms, first call {first_call_s:.1f} s, {entry}"
        )

    shapes = [name for name in args.shapes.split(",") if name]
    configs = CONFIGS[: args.configs]
    for shape in shapes:
        k, n = SHAPES[shape]
        a, w = x[k], weights[shape]
        expected = (a[:CHECK_ROWS].float() @ w.float().t()).to(torch.bfloat16)
        d = torch.empty(ROWS, n, device=device, dtype=torch.bfloat16)
        record(f"{shape}/cublas", lambda a=a, w=w: F.linear(a, w), expected)
        for config in configs:
            cfg = quack_config(*config)
            record(
                f"{shape}/quack_{config_name(config)}",
                lambda a=a, w=w, d=d, cfg=cfg: identity_epi(a, w.t(), out={"D": d}, config=cfg, tuned=False)[
                    "D"
                ],
                expected,
            )

    def fastest_config(shape: str, tile_n_multiple: int = 1) -> tuple[int, int, int, int, bool] | None:
        """The quack config of `shape` with the shortest sustained time among those whose tile_n is a multiple."""
        timed = {
            config: results.get(f"{shape}/quack_{config_name(config)}", {}).get("sustained_ms")
            for config in configs
            if config[1] % tile_n_multiple == 0
        }
        timed = {config: ms for config, ms in timed.items() if ms is not None}
        return min(timed, key=timed.get) if timed else None

    best = {
        shape: f"{shape}/quack_{config_name(config)}"
        for shape in shapes
        if (config := fastest_config(shape)) is not None
    }
    print(f"best quack config per shape (sustained): {best}")

    @functools.cache
    def best_config(shape: str, tile_n_multiple: int = 1):
        """The fastest sustained quack config of `shape` whose tile_n the epilogue accepts (quack's default else)."""
        chosen = fastest_config(shape, tile_n_multiple) or CONFIGS[0]
        print(f"{shape} epilogue (tile_n multiple of {tile_n_multiple}): {config_name(chosen)}")
        epilogue_configs[f"{shape}_tile_n_multiple_of_{tile_n_multiple}"] = config_name(chosen)
        return quack_config(*chosen)

    if "fc1" in shapes:
        a, w = x[HIDDEN], weights["fc1"]
        gate, value = (a[:CHECK_ROWS].float() @ w.float().t()).chunk(2, dim=-1)
        expected = F.silu(gate) * value
        record("fc1_swiglu/cublas_then_ours", lambda: ops.swiglu(F.linear(a, w)), expected)
        post = torch.empty(ROWS, FFN, device=device, dtype=torch.bfloat16)
        interleaved = w.view(2, FFN, HIDDEN).transpose(0, 1).reshape(2 * FFN, HIDDEN).contiguous()
        record(
            "fc1_swiglu/quack_interleaved_weight",
            lambda: swiglu_mod(
                a,
                interleaved.t(),
                out={"postact": post},
                store_d=False,
                config=best_config("fc1", 32),
                tuned=False,
            )["postact"],
            expected,
        )
        record(
            "fc1_swiglu/quack_concat_layout",
            lambda: swiglu_mod(
                a[None],
                w.t()[None],
                out={"postact": post[None]},
                store_d=False,
                config=best_config("fc1", 32),
                tuned=False,
                concat_layout=("B",),
            )["postact"][0],
            expected,
        )

    for shape in ("out_proj", "fc2"):
        if shape not in shapes:
            continue
        k, n = SHAPES[shape]
        a, w = x[k], weights[shape]
        hidden = torch.randn(ROWS, n, device=device, dtype=torch.bfloat16)
        gate_table = torch.randn(3, n, device=device, dtype=torch.bfloat16) * 0.1
        rows = torch.zeros(ROWS, dtype=torch.long, device=device)
        gate = gate_table[0].contiguous()
        expected = hidden[:CHECK_ROWS].float() + gate.float() * (a[:CHECK_ROWS].float() @ w.float().t())
        record(
            f"{shape}_gated_residual/cublas_then_ours",
            lambda a=a, w=w, hidden=hidden, gate_table=gate_table, rows=rows: ops.gated_residual(
                hidden, gate_table, rows, F.linear(a, w)
            ),
            expected,
        )
        d = torch.empty(ROWS, n, device=device, dtype=torch.bfloat16)
        record(
            f"{shape}_gated_residual/quack_epilogue",
            lambda a=a, w=w, hidden=hidden, gate=gate, d=d, shape=shape: gated_residual_epi(
                a, w.t(), hidden, out={"D": d}, config=best_config(shape), tuned=False, gate=gate
            )["D"],
            expected,
        )

    if "q" in shapes:
        a, w = x[HIDDEN], weights["q"]
        norm_weight = 1.0 + 0.1 * torch.randn(HEAD_DIM, device=device, dtype=torch.bfloat16)
        rotated = 96
        positions = torch.arange(ROWS, device=device, dtype=torch.float32)
        frequencies = 1.0 / 10000 ** (torch.arange(rotated // 2, device=device) / (rotated // 2))
        angles = positions[:, None] * frequencies[None]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.bfloat16)
        key_stub = torch.empty(ROWS, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

        def cublas_then_ours() -> torch.Tensor:
            query = F.linear(a, w).view(ROWS, HEADS, HEAD_DIM)
            return ops.qk_norm_rope(query, key_stub, norm_weight, norm_weight, 1e-5, cos, sin)[0]

        # Timing of the ours path covers the key too (the op normalizes both); halve it for one projection.
        record("q_norm_rope/cublas_then_ours_q_and_k_op", cublas_then_ours, None)
        # Interleaved (cos, sin) table for adjacent pairs; pass-through pairs rotate by zero.
        pair_angles = torch.cat([angles, torch.zeros(ROWS, (HEAD_DIM - rotated) // 2, device=device)], -1)
        table = torch.stack([pair_angles.cos(), pair_angles.sin()], -1).reshape(ROWS, HEAD_DIM)
        d = torch.empty(ROWS, INNER, device=device, dtype=torch.bfloat16)
        weight_row = norm_weight.repeat(HEADS).contiguous()
        for dtype in (torch.float32, torch.bfloat16):
            cs = table.to(dtype).contiguous()
            record(
                f"q_norm_rope/quack_epilogue_table_{str(dtype).removeprefix('torch.')}",
                lambda cs=cs: qk_norm_rope_epi(
                    a,
                    w.t(),
                    out={"D": d},
                    config=best_config("q", 128),
                    tuned=False,
                    cs=cs,
                    qk=HEAD_DIM,
                    w=weight_row,
                )["D"],
                None,
            )
        record(
            "q_norm_rope/cublas_qk_op_alone",
            lambda: ops.qk_norm_rope(key_stub, key_stub, norm_weight, norm_weight, 1e-5, cos, sin)[0],
            None,
        )

    result = {
        "benchmark": "epilogue_gemms",
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quack_kernels": package_version("quack-kernels"),
        "nvidia_cutlass_dsl": package_version("nvidia-cutlass-dsl"),
        "triton": package_version("triton"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rows": ROWS,
        "shapes_k_n": SHAPES,
        "configs": {config_name(c): c for c in configs},
        "sustained_s": args.sustained_s,
        "timing": "burst_ms: triton do_bench; sustained_ms: median over the second half of back-to-back calls",
        "results": results,
        "best_quack_config_sustained": best,
        "epilogue_configs": epilogue_configs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().strftime("%Y%m%d")
    path = args.output_dir / f"epilogue_gemms_{device_label(device)}_{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
