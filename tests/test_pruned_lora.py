"""LoRAs made for the released DiT on a pruned one: AdaLN updates refit onto our basis form (exact where the update
lies in the basis' span, the dropped part reported), refused in one line on the published table form.

How it breaks: a refit that forgets the mean's part (the offset), or multiplies by the basis on the wrong side, moves
the AdaLN tables; a residual computed on the wrong factor reports 0 where the update leaves the span.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import small_lora, write_lora
from _refusals import refused

from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.lora_format import LoraError, read_lora
from h3engine.engine.lora.adapters import Adapter, apply_adapters, refit_onto_basis, remove_adapters
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig

TINY = DiTConfig.tiny()


def exact_model(seed: int) -> H3DiT:
    model = H3DiT(TINY, dtype=torch.float32)
    model.load_state_dict(native_to_module(random_native_state(TINY, seed), TINY), strict=True)
    return model.eval()


def pruned_model(exact: H3DiT, basis: torch.Tensor, mean: torch.Tensor) -> H3DiT:
    """`exact` in our basis form: W' = W @ basis, b' = b + W @ mean (fp64 folds)."""
    config = dataclasses.replace(TINY, adaln_rank=basis.shape[1])
    state = {key: value.clone() for key, value in exact.state_dict().items()}
    state["adaln_curve.mean"], state["adaln_curve.basis"] = mean.float(), basis.float()
    for key in [key for key in state if key.endswith("adaln_proj.linear.weight")]:
        weight, bias_key = state[key].double(), key.removesuffix("weight") + "bias"
        state[key] = (weight @ basis).float()
        state[bias_key] = (state[bias_key].double() + weight @ mean).float()
    model = H3DiT(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def adaln_adapter(tmp_path, seed: int = 3) -> Adapter:
    path = tmp_path / "adaln.safetensors"
    write_lora(path, small_lora(TINY, seed, only="", shrink=0.2), "ours", TINY)
    return Adapter(read_lora(path))


def outputs(model: H3DiT, adapter: Adapter | None) -> tuple[torch.Tensor, torch.Tensor]:
    request = tiny_fl2va_request(TINY, torch.float32, seed=5).as_h3_arguments()
    remove_adapters(model)
    if adapter is not None:
        apply_adapters(model, [adapter])
    with torch.no_grad():
        return model(*request)


def close(got, expected) -> bool:
    return all((a - b).abs().max() < 1e-4 * b.abs().max() for a, b in zip(got, expected, strict=True))


def test_an_adaln_update_refit_onto_a_full_basis_is_the_update_on_the_exact_dit(tmp_path, caplog) -> None:
    generator = torch.Generator().manual_seed(4)
    basis = torch.linalg.qr(torch.randn(8, 8, generator=generator, dtype=torch.float64))[0]
    mean = torch.randn(8, generator=generator, dtype=torch.float64)
    exact = exact_model(seed=2)
    pruned = pruned_model(exact, basis, mean)
    adapter = adaln_adapter(tmp_path)
    assert close(outputs(pruned, None), outputs(exact, None))
    with caplog.at_level(logging.WARNING, logger="h3engine.engine.lora.adapters"):
        with_lora = outputs(pruned, adapter)
    assert close(with_lora, outputs(exact, adapter))
    assert not close(with_lora, outputs(pruned, None))  # the update is there
    assert "refit onto the pruned DiT's rank-8 basis" in caplog.text


def test_the_part_of_an_update_off_the_basis_is_what_the_refit_reports(tmp_path) -> None:
    generator = torch.Generator().manual_seed(6)
    basis = torch.linalg.qr(torch.randn(8, 3, generator=generator, dtype=torch.float64))[0].float()
    mean = torch.randn(8, generator=generator)
    layer = next(
        layer
        for name, layer in adaln_adapter(tmp_path).lora.partitions[None].items()
        if name.endswith("adaln_proj.linear")
    )
    # Rows inside the span: refit exactly, nothing off it.
    inside = dataclasses.replace(
        layer, down=torch.randn(layer.down.shape[0], 3, generator=generator) @ basis.T
    )
    fitted, offset, residual = refit_onto_basis(inside, mean, basis)
    curve = torch.randn(5, 3, generator=generator)
    signal = mean + curve @ basis.T  # SiLU(temb) points on the pruned DiT's affine span
    expected = signal @ inside.down.T @ inside.up.T
    got = curve @ fitted.down.T @ fitted.up.T + offset
    assert residual < 1e-6 and (got - expected).abs().max() < 1e-5 * expected.abs().max()
    # Rows off the span: the dropped part is reported as measured.
    _, _, off = refit_onto_basis(layer, mean, basis)
    projected = layer.down @ basis @ basis.T
    assert off == pytest.approx(float((layer.down - projected).norm() / layer.down.norm()), rel=1e-5)
    assert off > 0.1


def test_the_published_table_form_refuses_an_adaln_update_in_one_line(tmp_path) -> None:
    table = dataclasses.replace(TINY, adaln_rank=4, adaln_table_rows=17)
    model = H3DiT(table, dtype=torch.float32)
    model.load_state_dict(native_to_module(random_native_state(table, 1), table), strict=True)
    adapter = adaln_adapter(tmp_path)
    with refused(LoraError, names=("adaln.safetensors", "adaln_proj"), says="keeps no basis to refit"):
        apply_adapters(model, [adapter])
