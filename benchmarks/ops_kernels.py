"""Each fused Triton op against its plain-torch twin at the released DiT shapes (768p / 5 s T2VA, S = 38,222).

For every op of `h3engine.models.ops`: the median time of the Triton kernel and of the reference (triton.testing.do_bench
on a GPU: warm-up, L2 flushed before every run, median), the bytes the fused kernel must move at least (each input
read once, each output written once; the AdaLN tables and norm weights are negligible and left out) and the
bandwidth that makes, also as a fraction of a measured device-to-device copy, and the max abs / max rel error
between the two results (max |a - b| and max |a - b| / max |b| over every output). JSON goes to --output-dir; a
short table is printed last.

Shapes: hidden 5376, 56 heads x 128 with 96 rotated channels, FFN 14,336, bf16; AdaLN tables of M = 2 timesteps
(6 rows); the Ulysses relayouts of an sp = --sequence-parallel group (stacked q/k/v sent, attention output back).

    python -m benchmarks.ops_kernels                                                    # GPU, JSON to results/
    TRITON_INTERPRET=1 python -m benchmarks.ops_kernels --tiny --device cpu --output-dir /tmp   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing

from benchmarks._common import RESULTS_DIR, device_label, package_version
from h3engine.models import ops
from h3engine.models.dit_config import DiTConfig
from h3engine.models.kernels import reference
from h3engine.models.kernels import triton as triton_kernels
from h3engine.models.kernels.triton.common import INTERPRETING

# The 768p / 5 s T2VA layout: 512 text + 414 audio + 37,296 video rows; M = 2 timesteps -> 6 AdaLN table rows.
RELEASED_SEQUENCE_LENGTH = 38_222
TABLE_ROWS = 6
EPS = 1e-5
# Elements per side of the copy that sets the bandwidth ceiling (1 GiB of bf16 read, 1 GiB written).
COPY_ELEMENTS = 2**29


@dataclass(frozen=True)
class Case:
    """One op at one shape: its positional arguments and the bytes a single fused pass moves."""

    name: str
    arguments: tuple
    bytes_moved: int


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
):
    return torch.randn(shape, generator=generator, device=device).to(dtype)


def build_cases(
    config: DiTConfig, sequence_length: int, sequence_parallel: int, dtype: torch.dtype, device: torch.device
) -> list[Callable[[], Case]]:
    """Case builders (called one at a time, so only one op's tensors are alive)."""
    hidden_size, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
    rotary_dim, ffn_dim = config.rotary_dim, config.ffn_dim
    element = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return random_tensor(shape, dtype, device, generator) * scale

    def tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, TABLE_ROWS, (sequence_length,), generator=generator, device=device)
        return (
            1.0 + draw(TABLE_ROWS, hidden_size),
            draw(TABLE_ROWS, hidden_size),
            draw(TABLE_ROWS, hidden_size),
            rows,
        )

    def modulated_rms_norm() -> Case:
        scale_plus_one, shift, _, rows = tables()
        arguments = (
            draw(sequence_length, hidden_size, scale=3.0),
            draw(hidden_size),
            EPS,
            scale_plus_one,
            shift,
            rows,
        )
        return Case("modulated_rms_norm", arguments, 2 * sequence_length * hidden_size * element)

    def gated_residual() -> Case:
        _, _, gate, rows = tables()
        hidden, update = draw(sequence_length, hidden_size), draw(sequence_length, hidden_size)
        return Case(
            "gated_residual", (hidden, gate, rows, update), 3 * sequence_length * hidden_size * element
        )

    def gated_residual_rms_norm() -> Case:
        scale_plus_one, shift, gate, rows = tables()
        hidden, update = draw(sequence_length, hidden_size), draw(sequence_length, hidden_size)
        arguments = (hidden, gate, rows, update, draw(hidden_size), EPS, scale_plus_one, shift)
        return Case("gated_residual_rms_norm", arguments, 4 * sequence_length * hidden_size * element)

    def qk_norm_rope() -> Case:
        angles = (
            torch.rand(sequence_length, rotary_dim // 2, generator=generator, device=device).repeat(1, 2) * 30
        )
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        query, key = draw(sequence_length, heads, head_dim), draw(sequence_length, heads, head_dim)
        arguments = (query, key, draw(head_dim), draw(head_dim), EPS, cos, sin)
        moved = (4 * sequence_length * heads * head_dim + 2 * sequence_length * rotary_dim) * element
        return Case("qk_norm_rope", arguments, moved)

    def swiglu() -> Case:
        return Case(
            "swiglu",
            (draw(sequence_length, 2 * ffn_dim, scale=3.0),),
            3 * sequence_length * ffn_dim * element,
        )

    local_rows = -(-sequence_length // sequence_parallel)

    def pack_heads_for_exchange() -> Case:
        stacked = draw(local_rows, 3, heads, head_dim)
        return Case("pack_heads_for_exchange", (stacked, sequence_parallel), 2 * stacked.numel() * element)

    def unpack_exchanged_heads() -> Case:
        received = draw(sequence_parallel, local_rows, heads // sequence_parallel, head_dim)
        return Case("unpack_exchanged_heads", (received,), 2 * received.numel() * element)

    return [
        modulated_rms_norm,
        gated_residual,
        gated_residual_rms_norm,
        qk_norm_rope,
        swiglu,
        pack_heads_for_exchange,
        unpack_exchanged_heads,
    ]


def median_ms(
    run: Callable[[], object], device: torch.device, warmup_ms: int, rep_ms: int, cpu_runs: int
) -> float:
    """do_bench's median on a GPU (L2 flushed before each run); the median of `cpu_runs` wall times otherwise."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    run()
    seconds = []
    for _ in range(cpu_runs):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) * 1e3


def outputs_of(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def errors(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """max |a - b|, max |a - b| / max |b| and the fraction of differing elements, over all outputs."""
    max_abs, max_rel, differing, total = 0.0, 0.0, 0, 0
    for ours, theirs in zip(actual, expected, strict=True):
        difference = (ours.float() - theirs.float()).abs()
        max_abs = max(max_abs, difference.max().item())
        max_rel = max(max_rel, difference.max().item() / max(theirs.float().abs().max().item(), 1e-30))
        differing += (ours != theirs).sum().item()
        total += ours.numel()
    return {"max_abs_error": max_abs, "max_rel_error": max_rel, "differing_fraction": differing / total}


def copy_bandwidth_gbps(device: torch.device, warmup_ms: int, rep_ms: int) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second), the ceiling for these ops."""
    if device.type != "cuda":
        return None
    source = torch.empty(COPY_ELEMENTS, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    milliseconds = median_ms(lambda: target.copy_(source), device, warmup_ms, rep_ms, cpu_runs=0)
    return 2 * source.numel() * source.element_size() / milliseconds / 1e6


def measure(
    case: Case, device: torch.device, warmup_ms: int, rep_ms: int, cpu_runs: int, copy_gbps: float | None
) -> dict:
    """Time the Triton kernel and the twin on one case and compare their results."""
    if not getattr(triton_kernels, f"supports_{case.name}")(*case.arguments):
        raise SystemExit(f"{case.name}: the Triton kernel does not support the benchmark shapes")
    fused = getattr(triton_kernels, case.name)
    twin = getattr(reference, case.name)
    triton_ms = median_ms(lambda: fused(*case.arguments), device, warmup_ms, rep_ms, cpu_runs)
    reference_ms = median_ms(lambda: twin(*case.arguments), device, warmup_ms, rep_ms, cpu_runs)
    entry = {
        "op": case.name,
        "dispatch": ops.implementation(case.name, *case.arguments),
        "shapes": [list(value.shape) for value in case.arguments if isinstance(value, torch.Tensor)],
        "bytes_moved": case.bytes_moved,
        "triton_ms": triton_ms,
        "reference_ms": reference_ms,
        "speedup": reference_ms / triton_ms,
        "triton_gbps": case.bytes_moved / triton_ms / 1e6,
        "reference_gbps": case.bytes_moved / reference_ms / 1e6,
        **errors(outputs_of(fused(*case.arguments)), outputs_of(twin(*case.arguments))),
    }
    if copy_gbps is not None:
        entry["triton_fraction_of_copy"] = entry["triton_gbps"] / copy_gbps
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config, 64 rows (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--sequence-parallel", type=int, default=4, help="Ulysses group size of the relayouts"
    )
    parser.add_argument("--warmup-ms", type=int, default=100, help="do_bench warm-up per op and variant")
    parser.add_argument("--rep-ms", type=int, default=500, help="do_bench measuring time per op and variant")
    parser.add_argument("--cpu-runs", type=int, default=3, help="timed runs per op on CPU (smoke test only)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--qk-norm-rope-launches",
        action="store_true",
        help="also time the qk_norm_rope kernel over rows per program x warps (launch tuning)",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type != "cuda" and not INTERPRETING:
        parser.error("the Triton kernels need a CUDA device; a CPU smoke test needs TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype)
    config = DiTConfig.tiny() if args.tiny else DiTConfig.released()
    sequence_length = 64 if args.tiny else RELEASED_SEQUENCE_LENGTH
    if config.num_heads % args.sequence_parallel:
        # The relayouts split the heads over the group (the tiny config's 2 heads: a group of 2).
        args.sequence_parallel = config.num_heads
    copy_gbps = copy_bandwidth_gbps(device, args.warmup_ms, args.rep_ms)
    if copy_gbps is not None:
        print(f"device-to-device copy: {copy_gbps:.0f} GB/s")

    results = []
    with torch.no_grad():
        for build in build_cases(config, sequence_length, args.sequence_parallel, dtype, device):
            entry = measure(build(), device, args.warmup_ms, args.rep_ms, args.cpu_runs, copy_gbps)
            results.append(entry)
            print(
                f"{entry['op']}: triton {entry['triton_ms']:.3f} ms, reference {entry['reference_ms']:.3f} ms"
            )

    launches = []
    if args.qk_norm_rope_launches:
        with torch.no_grad():
            case = next(
                build
                for build in build_cases(config, sequence_length, args.sequence_parallel, dtype, device)
                if build.__name__ == "qk_norm_rope"
            )()
            single = triton_kernels.qk_norm_rope(*case.arguments)
            for rows_per_program in (1, 2, 4, 8):
                for num_warps in (2, 4, 8):

                    def run(rows_per_program=rows_per_program, num_warps=num_warps):
                        return triton_kernels.qk_norm_rope(
                            *case.arguments, rows_per_program=rows_per_program, num_warps=num_warps
                        )

                    same = all(torch.equal(a, b) for a, b in zip(run(), single, strict=True))
                    ms = median_ms(run, device, args.warmup_ms, args.rep_ms, args.cpu_runs)
                    launches.append(
                        {
                            "rows_per_program": rows_per_program,
                            "num_warps": num_warps,
                            "ms": ms,
                            "gbps": case.bytes_moved / ms / 1e6,
                            "bit_identical": same,
                        }
                    )
                    print(
                        f"qk_norm_rope rows/program {rows_per_program} warps {num_warps}: {ms:.3f} ms, same {same}"
                    )

    report = {
        "benchmark": "kernels",
        "config": "tiny" if args.tiny else "released",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "sequence_length": sequence_length,
        "sequence_parallel": args.sequence_parallel,
        "timing": "triton.testing.do_bench median, L2 flushed before each run"
        if device.type == "cuda"
        else "median wall time (interpreter smoke test, not a measurement)",
        "bytes_definition": "each input read once and each output written once (AdaLN tables, weights left out)",
        "copy_gbps": copy_gbps,
        "results": results,
        "qk_norm_rope_launches": launches or None,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    path = args.output_dir / f"kernels_{device_label(device)}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")

    header = f"{'op':<24} {'dispatch':>9} {'triton ms':>10} {'ref ms':>9} {'speedup':>8} {'GB/s':>7} {'max abs':>9} {'max rel':>9}"
    print(header)
    for entry in results:
        print(
            f"{entry['op']:<24} {entry['dispatch']:>9} {entry['triton_ms']:>10.3f} {entry['reference_ms']:>9.3f} "
            f"{entry['speedup']:>7.2f}x {entry['triton_gbps']:>7.0f} {entry['max_abs_error']:>9.2e} "
            f"{entry['max_rel_error']:>9.2e}"
        )


if __name__ == "__main__":
    main()
