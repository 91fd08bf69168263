"""`python -m h3engine convert`: a released checkpoint written once as smaller files that load memory-mapped.

    python -m h3engine convert --checkpoint DIR --weights fp8 --out DIR2

`--weights fp8` writes the large linears (DiT blocks and refiner, AdaLN projections, the text encoder's layers) as
e4m3 values with one fp32 scale per output row, exactly what `--weights fp8` makes at load, in the released layout
(h3engine.checkpoint.fp8_files): the DiT and the text encoder about halve, and an engine streams them from the files in
FP8 without a bf16 copy in host memory. Prints each component's size and the total. Exit 2 with one line naming the
flag or the file for a bad flag, a checkpoint that does not load, or an output folder that is not empty.
"""

from __future__ import annotations

import argparse
import time

from h3engine.errors import RequestError

CONVERT_FORMATS = ("fp8",)


def add_convert_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Declare the `convert` subcommand on the CLI's subparsers."""
    convert = commands.add_parser(
        "convert",
        help="write a released checkpoint as smaller files once (--weights fp8: e4m3 with row scales)",
    )
    convert.add_argument("--checkpoint", required=True, help="the released checkpoint folder (either layout)")
    convert.add_argument(
        "--weights",
        required=True,
        help="fp8: the large linears as e4m3 with one fp32 scale per output row (the values --weights fp8 makes)",
    )
    convert.add_argument(
        "--out", required=True, help="an empty or missing folder for the converted checkpoint"
    )
    return convert


def run_convert(args: argparse.Namespace) -> int:
    """Convert (RequestError / CheckpointError for what cannot be: exit 2 by the CLI)."""
    if args.weights not in CONVERT_FORMATS:
        raise RequestError("--weights", f"expected one of {', '.join(CONVERT_FORMATS)}, got '{args.weights}'")
    from h3engine.checkpoint.fp8_files import convert_checkpoint

    started = time.perf_counter()
    try:
        sizes = convert_checkpoint(args.checkpoint, args.out)
    except FileExistsError as error:
        raise RequestError("--out", str(error)) from None
    for component, size in sizes.items():
        print(f"{component}: {size / (1 << 30):.2f} GiB")
    total = sum(sizes.values())
    print(
        f"converted in {time.perf_counter() - started:.1f} s: {total / (1 << 30):.2f} GiB of weights in {args.out}"
    )
    return 0
