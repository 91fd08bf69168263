"""app.py's command line: the warm-up switch and which replicas it applies to (no app is started here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import app


def test_replicas_warm_up_unless_told_not_to() -> None:
    assert app.parse_config([], {}).warm_up is True
    assert app.parse_config(["--no-warm-up"], {}).warm_up is False


def test_only_replicas_on_a_gpu_count_as_computing_on_cuda() -> None:
    assert app._computes_on_cuda(SimpleNamespace(device=torch.device("cuda", 1)))
    assert not app._computes_on_cuda(SimpleNamespace(device=torch.device("cpu")))
    assert app._computes_on_cuda(SimpleNamespace(spec=SimpleNamespace(devices=("cuda:0", "cuda:1"))))
    assert not app._computes_on_cuda(SimpleNamespace(spec=SimpleNamespace(devices=("cpu", "cpu"))))


def test_upload_limits_count_like_gradio_and_a_bad_one_names_the_option() -> None:
    assert app.parse_config([], {}).max_file_size == 200 * 1024**2
    assert app.parse_config(["--max-file-size", "3 KB"], {}).max_file_size == 3 * 1024
    for bad in ("lots", "200", "0mb", "1.5gb"):
        with pytest.raises(app.ConfigError, match="^--max-file-size: "):
            app.parse_config(["--max-file-size", bad], {})
    with pytest.raises(app.ConfigError, match="^--port: invalid int value: 'x'"):
        app.parse_config([], {"H3_PORT": "x"})
