"""Running a test file's Triton kernel tests under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess.

The interpreter runs kernels on the CPU, so the kernel tests of tests/test_ops.py, test_gguf_blocks.py and
test_scaled_dequant.py hold on a machine with no GPU. `assert_kernel_tests_pass_interpreted(path)` runs the tests of
`path` named `test_triton_kernel_*` in a fresh interpreter-mode pytest without conftest.py (its start-up imports the
engine; the run's temp folder and thread count come with the environment) and asserts they all ran and passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent


def assert_kernel_tests_pass_interpreted(test_file: str) -> None:
    """Run `test_file`'s `test_triton_kernel_*` tests under TRITON_INTERPRET=1: every one passes, none skips."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", test_file]
        + ["-k", "test_triton_kernel_"],
        cwd=REPOSITORY_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, summary
