"""LoRA files in every H3 layout read as our module's updates, equal to what diffusers 0.42.1 makes of them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _lora_helpers import (
    LAYOUTS,
    METADATA_ALPHA,
    diffusers_deltas,
    lora_modules,
    ours_as_diffusers,
    random_lora,
    write_lora,
)
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.lora_format import LoraError, LoraFile, check_lora_fits, read_lora
from h3engine.models.dit_config import DiTConfig

TINY = DiTConfig.tiny()
# diffusers de-interleaves DiffSynth's QKV with a fixed 128-wide head: its parity runs on a tiny DiT that wide.
TINY_HEAD_128 = dataclasses.replace(TINY, head_dim=128)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _deltas(lora: LoraFile, partition: str | None = None) -> dict[str, torch.Tensor]:
    return {module: layer.delta() for module, layer in lora.layers(partition).items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_the_updates_the_file_means(tmp_path: Path, layout: str) -> None:
    path = tmp_path / f"{layout}.safetensors"
    expected = write_lora(path, random_lora(TINY, seed=1), layout, TINY)
    lora = read_lora(path, head_dim=TINY.head_dim)
    check_lora_fits(lora, TINY)
    ours = _deltas(lora)
    assert set(ours) == set(lora_modules(TINY))
    for module, delta in expected.items():
        assert _relative_error(ours[module], delta) < 1e-6, module
    for layer in lora.layers().values():
        assert layer.down.dtype == layer.up.dtype == torch.float32


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_equals_diffusers(tmp_path: Path, layout: str) -> None:
    config = TINY_HEAD_128 if layout == "diffsynth" else TINY
    path = tmp_path / f"{layout}.safetensors"
    write_lora(path, random_lora(config, seed=2), layout, config)
    lora = read_lora(path)  # the released head width, as diffusers reads DiffSynth files
    check_lora_fits(lora, config)
    reference = diffusers_deltas(path)
    expected_partition = "transformer_ref" if layout == "diffusers_ref" else "transformer"
    assert list(reference) == [expected_partition]
    ours = ours_as_diffusers(_deltas(lora), config)
    assert set(ours) == set(reference[expected_partition])
    for module, delta in reference[expected_partition].items():
        assert _relative_error(ours[module], delta) < 1e-6, module


@pytest.mark.parametrize(
    ("layout", "partition", "format_name"),
    [
        ("diffusers", "transformer", "diffusers"),
        ("diffusers_ref", "transformer_ref", "diffusers"),
        ("peft", None, "peft"),
        ("original", None, "original"),
        ("ai_toolkit", None, "original"),
        ("kohya", None, "kohya"),
        ("diffsynth", None, "diffsynth"),
    ],
)
def test_the_partition_is_the_one_the_file_names(
    tmp_path: Path, layout: str, partition: str | None, format_name: str
) -> None:
    path = tmp_path / "adapter.safetensors"
    write_lora(path, random_lora(TINY), layout, TINY)
    lora = read_lora(path, head_dim=TINY.head_dim)
    assert list(lora.partitions) == [partition]
    assert lora.layout == format_name


def test_a_file_for_both_partitions_keeps_them_apart_like_diffusers(tmp_path: Path) -> None:
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_lora(first, random_lora(TINY, seed=3), "diffusers", TINY)
    write_lora(second, random_lora(TINY, seed=4), "diffusers_ref", TINY)
    both = tmp_path / "both.safetensors"
    save_file({**load_file(str(first)), **load_file(str(second))}, str(both))
    lora = read_lora(both)
    reference = diffusers_deltas(both)
    assert set(lora.partitions) == set(reference) == {"transformer", "transformer_ref"}
    for partition in ("transformer", "transformer_ref"):
        ours = ours_as_diffusers(_deltas(lora, partition), TINY)
        for module, delta in reference[partition].items():
            assert _relative_error(ours[module], delta) < 1e-6, (partition, module)
    main, ref = (
        lora.layers(partition)["blocks.0.mlp.fc2"].delta() for partition in ("transformer", "transformer_ref")
    )
    assert not torch.equal(main, ref)
    with pytest.raises(ValueError, match="transformer_ref"):
        lora.layers()  # no single partition to default to


# --------------------------------------------------------------------------------------------------------------
# Row orders: QKV interleave and fc1 halves
# --------------------------------------------------------------------------------------------------------------


def _marked_qkv_up(config: DiTConfig) -> torch.Tensor:
    """A QKV up matrix [3 * inner, 1] whose row value is 100 * head + 10 * part (q 0, k 1, v 2) + dim / 100, laid out
    in the original file's per-head interleave [head, part, dim]."""
    rows = [
        100 * head + 10 * part + dim / 100
        for head in range(config.num_heads)
        for part in range(3)
        for dim in range(config.head_dim)
    ]
    return torch.tensor(rows, dtype=torch.float32)[:, None]


def test_diffsynth_qkv_rows_are_deinterleaved_into_our_stacked_order(tmp_path: Path) -> None:
    path = tmp_path / "diffsynth.safetensors"
    module = "blocks.1.attn.qkv_proj"
    save_file(
        {
            f"{module}.lora_A.default.weight": torch.ones(1, TINY.hidden_size),
            f"{module}.lora_B.default.weight": _marked_qkv_up(TINY),
        },
        str(path),
    )
    up = read_lora(path, head_dim=TINY.head_dim).layers()[module].up[:, 0]
    # Our qkv_proj holds [q; k; v], each [head, dim]: row (part, head, dim).
    stacked = up.reshape(3, TINY.num_heads, TINY.head_dim)
    for part in range(3):
        for head in range(TINY.num_heads):
            expected = 100 * head + 10 * part + torch.arange(TINY.head_dim) / 100
            assert torch.allclose(stacked[part, head], expected), (part, head)


def test_fused_qkv_outside_diffsynth_is_already_stacked(tmp_path: Path) -> None:
    path = tmp_path / "original.safetensors"
    module = "blocks.0.attn.qkv_proj"
    up = torch.arange(3 * TINY.inner_dim, dtype=torch.float32)[:, None]
    save_file(
        {f"{module}.lora_A.weight": torch.ones(1, TINY.hidden_size), f"{module}.lora_B.weight": up}, str(path)
    )
    assert torch.equal(read_lora(path).layers()[module].up, up)


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_fc1_gate_half_lands_on_our_first_rows(tmp_path: Path, layout: str) -> None:
    """Our fc1 is [gate; value]: the original names store it so, diffusers' ff.net.0.proj stores [value; gate]."""
    gate, value = torch.full((TINY.ffn_dim, 1), 1.0), torch.full((TINY.ffn_dim, 1), 2.0)
    down = torch.ones(1, TINY.hidden_size)
    if layout == "original":
        tensors = {
            "blocks.0.mlp.fc1.lora_A.weight": down,
            "blocks.0.mlp.fc1.lora_B.weight": torch.cat([gate, value]),
        }
    else:
        name = "transformer.transformer_blocks.0.ff.net.0.proj"
        tensors = {f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": torch.cat([value, gate])}
    path = tmp_path / "fc1.safetensors"
    save_file(tensors, str(path))
    up = read_lora(path).layers()["blocks.0.mlp.fc1"].up
    assert torch.equal(up[: TINY.ffn_dim], gate) and torch.equal(up[TINY.ffn_dim :], value)


def test_separate_q_k_v_factors_of_other_ranks_merge_into_one_exact_update(tmp_path: Path) -> None:
    """A diffusers-trained adapter may give to_q and to_v their own factors and leave to_k out."""
    generator = torch.Generator().manual_seed(5)
    prefix = "transformer.transformer_blocks.1.attn."
    tensors = {}
    for part, rank in (("to_q", 3), ("to_v", 2)):
        tensors[f"{prefix}{part}.lora_A.weight"] = torch.randn(rank, TINY.hidden_size, generator=generator)
        tensors[f"{prefix}{part}.lora_B.weight"] = torch.randn(TINY.inner_dim, rank, generator=generator)
    path = tmp_path / "qv.safetensors"
    save_file(tensors, str(path), metadata={"alpha": "4"})
    lora = read_lora(path)
    check_lora_fits(lora, TINY)
    delta = lora.layers()["blocks.1.attn.qkv_proj"].delta()
    q, k, v = delta.chunk(3)
    reference = diffusers_deltas(path)["transformer"]
    assert _relative_error(q, reference["transformer_blocks.1.attn.to_q"]) < 1e-6
    assert _relative_error(v, reference["transformer_blocks.1.attn.to_v"]) < 1e-6
    assert torch.equal(k, torch.zeros_like(k))


# --------------------------------------------------------------------------------------------------------------
# Alpha
# --------------------------------------------------------------------------------------------------------------


def _single_module_file(path: Path, alpha: float | None, metadata: dict[str, str] | None = None) -> None:
    tensors = {
        "blocks.0.mlp.fc2.lora_A.weight": torch.ones(4, TINY.ffn_dim),
        "blocks.0.mlp.fc2.lora_B.weight": torch.ones(TINY.hidden_size, 4),
        "blocks.1.mlp.fc2.lora_A.weight": torch.ones(4, TINY.ffn_dim),
        "blocks.1.mlp.fc2.lora_B.weight": torch.ones(TINY.hidden_size, 4),
    }
    if alpha is not None:
        tensors["blocks.0.mlp.fc2.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize(
    ("alpha", "metadata", "scales"),
    [
        (None, None, (1.0, 1.0)),  # alpha-less: alpha == rank
        (2.0, None, (0.5, 1.0)),  # a module's own alpha tensor
        (None, {"alpha": str(METADATA_ALPHA)}, (METADATA_ALPHA / 4, METADATA_ALPHA / 4)),
        (2.0, {"alpha": "8"}, (0.5, 1.0)),  # alpha tensors win; the metadata alpha is then ignored everywhere
        (None, {"alpha": "strong"}, (1.0, 1.0)),  # diffusers ignores a non-numeric entry
    ],
)
def test_alpha_scales_like_diffusers(
    tmp_path: Path, alpha: float | None, metadata: dict[str, str] | None, scales: tuple[float, float]
) -> None:
    path = tmp_path / "alpha.safetensors"
    _single_module_file(path, alpha, metadata)
    layers = read_lora(path).layers()
    assert (layers["blocks.0.mlp.fc2"].scale, layers["blocks.1.mlp.fc2"].scale) == scales
    reference = diffusers_deltas(path)["transformer"]
    ours = ours_as_diffusers({module: layer.delta() for module, layer in layers.items()}, TINY)
    for module, delta in reference.items():
        assert _relative_error(ours[module], delta) < 1e-6, module


@pytest.mark.parametrize(
    ("bare_alpha", "scale"),
    [(None, 0.5), ("8", 0.5)],  # diffusers' own adapter config, which wins over a bare __metadata__ alpha
)
def test_diffusers_adapter_metadata_alpha_is_honoured(
    tmp_path: Path, bare_alpha: str | None, scale: float
) -> None:
    path = tmp_path / "saved_by_diffusers.safetensors"
    name = "transformer.transformer_blocks.0.ff.net.2"
    adapter = {"transformer.r": 4, "transformer.lora_alpha": 2, "transformer.alpha_pattern": {}}
    metadata = {"lora_adapter_metadata": json.dumps(adapter), **({"alpha": bare_alpha} if bare_alpha else {})}
    save_file(
        {f"{name}.lora_A.weight": torch.ones(4, TINY.ffn_dim), f"{name}.lora_B.weight": torch.ones(16, 4)},
        str(path),
        metadata=metadata,
    )
    assert read_lora(path).layers()["blocks.0.mlp.fc2"].scale == scale
    reference = diffusers_deltas(path)["transformer"]["transformer_blocks.0.ff.net.2"]
    assert torch.equal(reference, torch.full_like(reference, scale * 4))


# --------------------------------------------------------------------------------------------------------------
# Bad files: one line naming the file (as the user knows it) and the first offending key
# --------------------------------------------------------------------------------------------------------------


def _error(path: Path, config: DiTConfig = TINY, **options: object) -> str:
    with pytest.raises(LoraError) as caught:
        check_lora_fits(read_lora(path, **options), config)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_pickle_file_is_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "adapter.pt"
    torch.save({"blocks.0.mlp.fc2.lora_A.weight": torch.ones(1, 2)}, str(path))
    message = _error(path)
    assert "'adapter.pt'" in message and "is not a readable .safetensors file" in message


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    write_lora(path, random_lora(TINY), "original", TINY)
    path.write_bytes(path.read_bytes()[:-100])
    message = _error(path)
    assert "'cut.safetensors'" in message and "safetensors" in message


def test_errors_name_the_users_file_not_the_path(tmp_path: Path) -> None:
    path = tmp_path / "upload-1234.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    message = _error(path, name="my_style.safetensors")
    assert "'my_style.safetensors'" in message and str(tmp_path) not in message


@pytest.mark.parametrize(
    ("key", "shape"),
    [
        ("blocks.0.attn.qkv_proj.weight", (72, 16)),  # a base weight, no LoRA factor
        ("transformer.transformer_blocks.0.attn.to_banana.lora_A.weight", (4, 16)),
        ("lora_unet_blocks_0_attn_banana.lora_down.weight", (4, 16)),
        ("blocks.0.attn.banana.lora_A.weight", (4, 16)),  # reads, then fits no module
        ("blocks.7.mlp.fc2.lora_A.weight", (4, 32)),  # a block the tiny DiT does not have
        ("blocks.0.norm1.lora_A.weight", (4, 16)),  # a module, but no linear
    ],
)
def test_a_key_naming_no_module_is_refused_by_name(tmp_path: Path, key: str, shape: tuple[int, int]) -> None:
    tensors = {key: torch.ones(shape)}
    if ".lora_A." in key or ".lora_down." in key:
        up_key = key.replace(".lora_A.", ".lora_B.").replace(".lora_down.", ".lora_up.")
        tensors[up_key] = torch.ones(shape[1], shape[0])
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path))
    message = _error(path)
    assert "'odd.safetensors'" in message and repr(key) in message


def test_a_shape_that_does_not_fit_is_refused_with_the_first_key(tmp_path: Path) -> None:
    """An adapter trained on a pruned checkpoint: fc2's input is narrower than the DiT's."""
    path = tmp_path / "pruned.safetensors"
    save_file(
        {
            "blocks.0.mlp.fc2.lora_A.weight": torch.ones(4, TINY.ffn_dim),
            "blocks.0.mlp.fc2.lora_B.weight": torch.ones(TINY.hidden_size, 4),
            "blocks.1.mlp.fc2.lora_A.weight": torch.ones(4, TINY.ffn_dim - 8),
            "blocks.1.mlp.fc2.lora_B.weight": torch.ones(TINY.hidden_size, 4),
        },
        str(path),
    )
    message = _error(path)
    assert "'pruned.safetensors'" in message and "'blocks.1.mlp.fc2.lora_A.weight'" in message
    assert "[16, 24]" in message and "[16, 32]" in message
    assert "(was the adapter trained on another, e.g. pruned, checkpoint?)" in message


def test_a_factor_without_its_partner_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "half.safetensors"
    save_file({"diffusion_model.blocks.0.mlp.fc2.lora_A.weight": torch.ones(4, TINY.ffn_dim)}, str(path))
    message = _error(path)
    assert "'half.safetensors'" in message and "'diffusion_model.blocks.0.mlp.fc2.lora_A.weight'" in message


def test_ranks_that_disagree_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ranks.safetensors"
    save_file(
        {
            "blocks.0.mlp.fc2.lora_A.weight": torch.ones(4, 32),
            "blocks.0.mlp.fc2.lora_B.weight": torch.ones(16, 2),
        },
        str(path),
    )
    assert "'blocks.0.mlp.fc2.lora_A.weight'" in _error(path)


def test_dora_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dora.safetensors"
    write_lora(path, random_lora(TINY), "original", TINY)
    save_file({**load_file(str(path)), "blocks.0.mlp.fc2.dora_scale": torch.ones(16, 1)}, str(path))
    assert "DoRA" in _error(path)


def test_diffsynth_read_for_another_head_width_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "diffsynth.safetensors"
    write_lora(path, random_lora(TINY_HEAD_128), "diffsynth", TINY_HEAD_128)
    message = _error(path, config=dataclasses.replace(TINY_HEAD_128, head_dim=64))
    assert "head_dim 128" in message and "qkv_proj" in message


def test_non_finite_factors_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.safetensors"
    down = torch.ones(4, TINY.ffn_dim)
    down[1, 2] = float("nan")
    save_file(
        {"blocks.0.mlp.fc2.lora_A.weight": down, "blocks.0.mlp.fc2.lora_B.weight": torch.ones(16, 4)},
        str(path),
    )
    message = _error(path)
    assert (
        "'nan.safetensors'" in message and "'blocks.0.mlp.fc2.lora_A.weight'" in message and "NaN" in message
    )


def test_a_kohya_module_that_does_not_fit_is_named_by_its_down_factor(tmp_path: Path) -> None:
    path = tmp_path / "musubi.safetensors"
    save_file(
        {
            "lora_unet_blocks_1_mlp_fc2.alpha": torch.tensor(4.0),
            "lora_unet_blocks_1_mlp_fc2.lora_down.weight": torch.ones(4, TINY.ffn_dim - 8),
            "lora_unet_blocks_1_mlp_fc2.lora_up.weight": torch.ones(TINY.hidden_size, 4),
        },
        str(path),
    )
    assert "'lora_unet_blocks_1_mlp_fc2.lora_down.weight'" in _error(path)


# --------------------------------------------------------------------------------------------------------------
# Headers only (the checks before a job)
# --------------------------------------------------------------------------------------------------------------


def _outline(lora: LoraFile) -> dict:
    return {
        partition: {
            module: (tuple(layer.down.shape), tuple(layer.up.shape), layer.scale)
            for module, layer in layers.items()
        }
        for partition, layers in lora.partitions.items()
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shapes_only_read_gives_the_layers_scales_and_targets_of_a_full_read(
    tmp_path: Path, layout: str
) -> None:
    path = tmp_path / f"{layout}.safetensors"
    write_lora(path, random_lora(TINY, seed=1), layout, TINY)
    full = read_lora(path, head_dim=TINY.head_dim)
    header = read_lora(path, head_dim=TINY.head_dim, shapes_only=True)
    assert _outline(header) == _outline(full) and header.layout == full.layout
    assert all(layer.down.is_meta and layer.up.is_meta for layer in header.layers().values())
    check_lora_fits(header, TINY)
    with pytest.raises(LoraError, match="the DiT's"):  # the fit check sees the shapes alone
        check_lora_fits(header, dataclasses.replace(TINY, ffn_dim=TINY.ffn_dim * 2))


def test_a_shapes_only_read_of_separate_q_k_v_parts_has_the_merged_shape(tmp_path: Path) -> None:
    prefix = "transformer.transformer_blocks.1.attn."
    tensors = {}
    for part, rank in (("to_q", 3), ("to_v", 2)):
        tensors[f"{prefix}{part}.lora_A.weight"] = torch.ones(rank, TINY.hidden_size)
        tensors[f"{prefix}{part}.lora_B.weight"] = torch.ones(TINY.inner_dim, rank)
    path = tmp_path / "qv.safetensors"
    save_file(tensors, str(path))
    assert _outline(read_lora(path, shapes_only=True)) == _outline(read_lora(path))
