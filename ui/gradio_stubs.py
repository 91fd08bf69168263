"""Import Gradio without its stub writer.

Every import of gradio rewrites the type stubs (`.pyi`) of its own component classes: `gradio.component_meta`
parses each component's source file as the class is made (`create_or_modify_pyi`), about 1.1 s of the 2.8 s
import on a 2-core CPU, for files that only an editor reads and that a server never needs. `skip_stub_writer()`,
called before gradio is first imported, makes that one function a no-op as its module loads; gradio's components are
otherwise made exactly as before. Called from ui/__init__.py, so the app, the tests and every process that imports
our UI start faster. Without effect once gradio is imported, or if a later gradio moves the function.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

STUB_WRITER_MODULE = "gradio.component_meta"
STUB_WRITER = "create_or_modify_pyi"


def _write_no_stub(*args: Any, **kwargs: Any) -> None:
    return None


class _StubWriterOff(importlib.abc.MetaPathFinder):
    """Finds gradio.component_meta as Python would, and has its loader replace the stub writer after running it."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != STUB_WRITER_MODULE:
            return None
        sys.meta_path.remove(self)  # once: this module loads once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_skip_stubs(module: ModuleType) -> None:
            run_module(module)
            if hasattr(module, STUB_WRITER):
                setattr(module, STUB_WRITER, _write_no_stub)

        spec.loader.exec_module = run_then_skip_stubs
        return spec


def skip_stub_writer() -> None:
    """Before gradio's first import in this process: its components are made without rewriting their stubs."""
    if STUB_WRITER_MODULE in sys.modules or any(
        isinstance(finder, _StubWriterOff) for finder in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _StubWriterOff())
