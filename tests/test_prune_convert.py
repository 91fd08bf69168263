"""`python -m h3engine convert --prune-adaln` (h3engine.checkpoint.prune_adaln) on tiny checkpoints.

A DiT whose SiLU(temb) curve spans fewer directions than the rank converts to the exact model's output to fp32
rounding; on a random DiT the error the converter reports is the error measured directly on the two loaded DiTs;
the converted folder (alone or with --weights fp8) loads with the normal loader and generates; refusals are one
line naming the flag or the folder.

How it breaks: a fold with the wrong mean sign or basis side, a basis fitted on a grid the engine does not read, an
error measured against the wrong reference, a writer that drops the curve's tensors or misses the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from _runtime_helpers import parity_requests
from safetensors.torch import load_file, save_file

from h3engine.checkpoint.fp8_files import SCALE_SUFFIX
from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.prune_adaln import prune_checkpoint
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.tiny import make_tiny_checkpoint
from h3engine.cli.convert import schedule_timesteps
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.models.dit import H3DiT

DIT = "FL2VA/transformer"


def load_dit(root: Path) -> H3DiT:
    layout = detect_layout(root)
    return dit_source(layout, layout.for_task("t2va"), torch.float32).load(torch.device("cpu"))


def tables(model: H3DiT, timesteps: torch.Tensor) -> list[torch.Tensor]:
    """Every AdaLN projection's fp32 table [M, out] (blocks', then the final layer's)."""
    adaln_input = model.adaln_input(timesteps)
    projections = [block.adaln_proj for block in model.blocks] + [model.final_layer.adaln_proj]
    with torch.no_grad():
        return [projection(adaln_input) for projection in projections]


def worst_relative_error(pruned: H3DiT, exact: H3DiT, timesteps: torch.Tensor) -> float:
    worst = 0.0
    for got, want in zip(tables(pruned, timesteps), tables(exact, timesteps), strict=True):
        errors = (got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)
        worst = max(worst, errors.max().item())
    return worst


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path, list]:
    """(a tiny checkpoint, its DiTs pruned to rank 2, the reports)."""
    original = tiny_checkpoints("native", seed=7)
    out = tmp_path_factory.mktemp("pruned") / "checkpoint"
    reports, _ = prune_checkpoint(original, out, rank=2, timesteps=schedule_timesteps(str(original)))
    return original, out, reports


def test_a_curve_inside_the_basis_converts_to_the_exact_model(tmp_path) -> None:
    """temb's rows past the 3rd are constant (zero weights): SiLU(temb) lies in a 3-dimensional affine subspace, so
    a rank-3 basis holds it; with fp32 projections the pruned DiT is the exact one to fp32 rounding."""
    original = make_tiny_checkpoint(tmp_path / "original", seed=3)
    for shard in (original / DIT).glob("*.safetensors"):
        state = load_file(shard)
        if "time_embedder.proj_out.weight" in state:
            state["time_embedder.proj_out.weight"][3:] = 0.0
        for key in [key for key in state if "adaln_proj" in key]:
            state[key] = state[key].float()
        save_file(state, shard, metadata={"format": "pt"})
    reports, _ = prune_checkpoint(original, tmp_path / "pruned", rank=3, timesteps=[0.3, 0.999])
    report = next(report for report in reports if report.folder == DIT)
    assert report.grid_error < 1e-5 and report.check_error < 1e-5, report
    exact, pruned = load_dit(original), load_dit(tmp_path / "pruned")
    assert pruned.config.adaln_form == "basis" and pruned.config.adaln_rank == 3
    grid = torch.linspace(0.0, 1.0, 101)
    assert worst_relative_error(pruned, exact, grid) < 1e-5
    request = tiny_fl2va_request(exact.config, torch.float32, seed=5).as_h3_arguments()
    with torch.no_grad():
        for got, want in zip(pruned(*request), exact(*request), strict=True):
            assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_the_reported_error_is_the_measured_one(converted) -> None:
    original, out, reports = converted
    report = next(report for report in reports if report.folder == DIT)
    exact, pruned = load_dit(original), load_dit(out)
    fine_grid = torch.linspace(0.0, 1.0, 2049, dtype=torch.float64).float()
    check = torch.tensor(sorted(set(schedule_timesteps(str(original)))), dtype=torch.float32)
    measured_grid = worst_relative_error(pruned, exact, fine_grid)
    measured_check = worst_relative_error(pruned, exact, check)
    assert report.grid_error == pytest.approx(measured_grid, rel=1e-3)
    assert report.check_error == pytest.approx(measured_check, rel=1e-3)
    assert 0 < report.check_error <= report.grid_error < 0.1
    assert 0 < report.captured < 1 and report.rank == 2 and report.bytes_after < report.bytes_before


def test_the_converted_folder_holds_the_basis_form(converted) -> None:
    original, out, _ = converted
    files, source = WeightFiles.open(out / DIT), WeightFiles.open(original / DIT)
    assert files.infos["adaln_curve.mean"].shape == (8,) and files.infos["adaln_curve.basis"].shape == (8, 2)
    assert files.infos["adaln_curve.basis"].dtype == torch.float32
    weight = files.infos["blocks.1.adaln_proj.linear.weight"]
    assert weight.shape == (288, 2) and weight.dtype == torch.bfloat16
    assert set(files.infos) == set(source.infos) | {"adaln_curve.mean", "adaln_curve.basis"}
    for key in ("time_embedder.proj_out.weight", "blocks.0.attn.qkv_proj.weight", "rope.inv_freq"):
        assert torch.equal(files.tensor(key), source.tensor(key)), key
    config = json.loads((out / DIT / "config.json").read_text())
    assert config["adaln_rank"] == 2 and config["time_embed_dim"] == 8
    index = json.loads((out / DIT / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(files.infos)
    # Everything else is the original's, linked.
    for name in ("FL2VA/video_vae/source/model.safetensors", "Ref2VA/model_index.json"):
        assert (out / name).read_bytes() == (original / name).read_bytes()


def test_a_converted_checkpoint_generates(converted) -> None:
    original, out, _ = converted
    request = parity_requests(steps=2, seed=4)["t2va"]
    expected, _ = Engine.from_checkpoint(original, device="cpu", adaln_cache="off").generate(request)
    resident, _ = Engine.from_checkpoint(out, device="cpu", adaln_cache="off").generate(request)
    streamed, _ = Engine.from_checkpoint(
        out, device="cpu", adaln_cache="off", memory_profile="streamed", host_memory=1e-6
    ).generate(request)
    assert torch.equal(streamed.video_latents, resident.video_latents)
    assert torch.isfinite(resident.video_latents).all() and torch.isfinite(resident.audio_latents).all()
    scale = expected.video_latents.abs().max()
    assert 0 < (resident.video_latents - expected.video_latents).abs().max() < 0.1 * scale


def test_prune_with_fp8_weights_from_the_cli(capsys, tiny_checkpoints, tmp_path) -> None:
    original = tiny_checkpoints("native", seed=7)
    out = tmp_path / "fp8"
    arguments = [
        "convert",
        "--checkpoint",
        str(original),
        "--prune-adaln",
        "--weights",
        "fp8",
        "--out",
        str(out),
    ]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "FL2VA/transformer: pruned AdaLN to rank 8" in printed and "AdaLN table error" in printed
    assert "text_encoder:FL2VA/text_encoder" in printed
    files = WeightFiles.open(out / DIT)
    assert (
        "blocks.0.mlp.fc1.weight" in files.scales and "blocks.0.adaln_proj.linear.weight" not in files.scales
    )
    assert not any(key.endswith(SCALE_SUFFIX) for key in files.infos)
    engine = Engine.from_checkpoint(out, device="cpu", adaln_cache="off")
    got, _ = engine.generate(parity_requests(steps=2, seed=4)["t2va"])
    assert engine.plan.weights == "fp8" and torch.isfinite(got.video_latents).all()


def test_fp8_conversion_of_a_pruned_checkpoint_leaves_its_projections_unquantized(
    converted, tmp_path
) -> None:
    _, pruned, _ = converted
    out = tmp_path / "fp8"
    assert main(["convert", "--checkpoint", str(pruned), "--weights", "fp8", "--out", str(out)]) == 0
    files = WeightFiles.open(out / DIT)
    assert "blocks.0.attn.qkv_proj.weight" in files.scales
    assert not any("adaln" in key for key in files.scales)
    assert torch.equal(
        files.tensor("blocks.0.adaln_proj.linear.weight"),
        WeightFiles.open(pruned / DIT).tensor("blocks.0.adaln_proj.linear.weight"),
    )
    assert load_dit(out).config.adaln_form == "basis"


@pytest.mark.parametrize(
    "extra, starts",
    [
        ([], "error: --weights: give --weights fp8, --prune-adaln, or both"),
        (["--prune-adaln", "--adaln-rank", "0"], "error: --adaln-rank: expected a positive integer, got 0"),
        (["--prune-adaln", "--adaln-rank", "9"], "error: "),
        (
            ["--prune-adaln", "--weights", "int4"],
            "error: --weights: expected one of fp8, int8, q8_0, q6_k, q5_k, q4_k, q3_k, q2_k, got 'int4'",
        ),
    ],
)
def test_convert_refuses_in_one_line(capsys, tiny_checkpoints, tmp_path, extra, starts) -> None:
    original = tiny_checkpoints("native", seed=7)
    assert main(["convert", "--checkpoint", str(original), "--out", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(starts), err


def test_prune_refuses_the_diffusers_layout_and_a_pruned_checkpoint(
    capsys, tiny_checkpoints, converted, tmp_path
) -> None:
    _, pruned, _ = converted
    for source, says in (
        (tiny_checkpoints("diffusers", seed=0), "diffusers layout"),
        (pruned, "already pruned"),
    ):
        out = tmp_path / "out"
        assert main(["convert", "--checkpoint", str(source), "--prune-adaln", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not out.exists() or not any(out.iterdir())


def test_a_projection_split_over_two_shards_is_folded_once(tmp_path) -> None:
    """Block 1's AdaLN bias in one shard and its weight in the other: each written once, where the index says, with
    the values of the unsplit checkpoint's conversion."""
    original = make_tiny_checkpoint(tmp_path / "original", seed=3)
    folder = original / DIT
    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(shard))
        shard.unlink()
    first = {key: value for key, value in state.items() if key != "blocks.1.adaln_proj.linear.weight"}
    save_file(first, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(
        {"blocks.1.adaln_proj.linear.weight": state["blocks.1.adaln_proj.linear.weight"]},
        folder / "model-00002-of-00002.safetensors",
        metadata={"format": "pt"},
    )
    weight_map = {key: "model-00001-of-00002.safetensors" for key in first}
    weight_map["blocks.1.adaln_proj.linear.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    reports, _ = prune_checkpoint(original, tmp_path / "split", rank=2)
    unsplit, _ = prune_checkpoint(
        make_tiny_checkpoint(tmp_path / "plain", seed=3), tmp_path / "unsplit", rank=2
    )
    files, expected = WeightFiles.open(tmp_path / "split" / DIT), WeightFiles.open(tmp_path / "unsplit" / DIT)
    assert files.infos["blocks.1.adaln_proj.linear.weight"].file.name == "model-00002-of-00002.safetensors"
    assert set(files.infos) == set(expected.infos)
    for key in files.infos:
        assert torch.equal(files.tensor(key), expected.tensor(key)), key
    assert reports[0].grid_error == unsplit[0].grid_error
