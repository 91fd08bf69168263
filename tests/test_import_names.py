"""No import name of ours shadows a package that our dependencies install or import.

Scripts and `python -m` put the repository root first on `sys.path`, so a top-level package of ours wins over an
installed distribution of the same import name. transformers 5.25 imports Hugging Face's `kernels`; our fused
kernels live in the top-level folder `kernels/` (no `__init__.py`) and are imported as `h3engine.models.kernels`.
These tests run Python from the repository root in the installed environment, as the app and the CLI do.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def our_top_level_import_names() -> set[str]:
    """What `import NAME` finds in the repository root before site-packages: regular packages and modules."""
    names = set()
    for path in REPOSITORY.iterdir():
        if path.name.startswith("."):
            continue
        if path.is_dir() and (path / "__init__.py").is_file():
            names.add(path.name)
        elif path.is_file() and path.suffix == ".py":
            names.add(path.stem)
    return names


def run_from_repository_root(code: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPOSITORY,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_top_level_name_of_ours_is_an_installed_import_name() -> None:
    installed = importlib.metadata.packages_distributions()
    ours = our_top_level_import_names()
    assert {"app", "h3engine", "ui"} <= ours
    clashes = {name: installed[name] for name in sorted(ours) if name in installed}
    assert not clashes, f"top-level names of ours that installed distributions also provide: {clashes}"


def test_kernels_from_the_repository_root_is_hugging_faces_and_transformers_uses_it() -> None:
    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels distribution is not installed (the locked set installs it)")
    expected = Path(distribution.locate_file("kernels/__init__.py")).resolve()
    result = run_from_repository_root(
        "import kernels\n"
        "from kernels import get_kernel\n"
        "from transformers.integrations import hub_kernels\n"
        "assert hub_kernels.is_kernels_available()\n"
        "print(kernels.__file__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == expected


def test_the_engine_runs_its_fused_kernels_under_its_own_name() -> None:
    # The Triton interpreter runs the kernels on the CPU; fp32 SwiGLU differs from torch's by a few ulps of exp.
    result = run_from_repository_root(
        "import torch\n"
        "from h3engine.models import ops\n"
        "from h3engine.models.kernels import reference\n"
        "assert ops.triton_kernels is not None, 'h3engine.models.kernels.triton did not import'\n"
        "assert ops.triton_kernels.__name__ == 'h3engine.models.kernels.triton'\n"
        "fused = torch.randn(5, 74, generator=torch.Generator().manual_seed(0))\n"
        "assert ops.triton_kernels.supports_swiglu(fused)\n"
        "torch.testing.assert_close(ops.triton_kernels.swiglu(fused), reference.swiglu(fused))\n"
        "print(ops.triton_kernels.__file__)\n",
        TRITON_INTERPRET="1",
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == REPOSITORY / "kernels" / "triton" / "__init__.py"
