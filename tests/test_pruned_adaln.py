"""Pruned AdaLN forms (h3engine.models.dit_adaln, h3engine.checkpoint.dit_pruned) on tiny random DiTs.

The published table form computes exactly its math (the table interpolated by hand at rows, between rows and at the
ends, then the projection, no SiLU); our basis form computes W' c + b' (at full rank: the exact model); the exact
form's projection is unchanged; the files' shapes decide the form and a contradiction is refused naming the tensor
(and its file); a pruned DiT runs where the exact one does: loaded from a checkpoint by the engine, tensor- and
sequence-parallel, with its tables built from offloaded projections (never quantized to FP8).

How it breaks: a table read at t * 1000 or at t * rows, a SiLU left on the curve, a projection cast to bf16 before
the fp32 GEMM, detection that trusts config.json over the tensors, a TP loader that misses the table.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from _dit_helpers import tiny_fl2va_request
from _runtime_helpers import parity_requests

from h3engine.checkpoint.dit_format import adaln_form_from_shapes, config_from_native, native_to_module
from h3engine.checkpoint.dit_keys import native_state_shapes, random_native_state
from h3engine.checkpoint.dit_pruned import adaln_form_of_files
from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source, read_dit_config
from h3engine.checkpoint.safetensors_io import WeightFiles, is_parked
from h3engine.checkpoint.tiny import make_tiny_checkpoint, save_sharded
from h3engine.engine.engine import Engine
from h3engine.engine.sampling.modulation import build_modulation, offload_adaln, store_adaln_in_fp8
from h3engine.errors import CheckpointError
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.dit import load_dit_shard
from h3engine.models.parallel.groups import ParallelLayout, create_dit_groups, initialize_process_group

TINY = DiTConfig.tiny()
TABLE = dataclasses.replace(TINY, adaln_rank=4, adaln_table_rows=17)
BASIS = dataclasses.replace(TINY, adaln_rank=3)
EIGHT_HEAD_TABLE = dataclasses.replace(TABLE, num_heads=8)
# t on a row (5 / 16), between rows, the ends, and the condition levels.
TIMESTEPS = [0.0, 5 / 16, 0.3, 1 / 32, 0.67, 0.999, 1.0]


def model_of(config: DiTConfig, seed: int, dtype: torch.dtype = torch.float32) -> H3DiT:
    model = H3DiT(config, dtype=dtype)
    model.load_state_dict(native_to_module(random_native_state(config, seed), config), strict=True)
    return model.eval()


def expected_tables(model: H3DiT, curve: torch.Tensor) -> list[torch.Tensor]:
    """Every projection's table P = W c + b in fp64 (blocks', then the final layer's)."""
    projections = [block.adaln_proj for block in model.blocks] + [model.final_layer.adaln_proj]
    return [curve @ p.linear.weight.double().T + p.linear.bias.double() for p in projections]


def got_tables(model: H3DiT, timesteps: torch.Tensor) -> list[torch.Tensor]:
    """The DiT's own modulation, unpacked back into each projection's [M, out] table."""
    modulation = model.modulation(timesteps)
    tables = []
    for block in modulation.blocks:
        parts = (
            block.shift_attn,
            block.scale_plus_one_attn - 1.0,
            block.gate_attn,
            block.shift_ffn,
            block.scale_plus_one_ffn - 1.0,
            block.gate_ffn,
        )
        tables.append(torch.stack(parts, dim=1).reshape(timesteps.numel(), -1).double())
    scale_plus_one, shift = modulation.final
    tables.append(torch.cat((shift, scale_plus_one - 1.0), dim=-1).double())
    return tables


# --------------------------------------------------------------------------------------------------------------
# The forms' math
# --------------------------------------------------------------------------------------------------------------


def test_the_table_form_is_its_math() -> None:
    model = model_of(TABLE, seed=1)
    table = model.adaln_t_table.double()
    rows = table.shape[0]
    curve = []
    for t in TIMESTEPS:
        position = t * (rows - 1)
        lower = min(math.floor(position), rows - 2)
        weight = position - lower
        curve.append((1 - weight) * table[lower] + weight * table[lower + 1])
    curve = torch.stack(curve)
    timesteps = torch.tensor(TIMESTEPS, dtype=torch.float32)
    with torch.no_grad():
        got_curve = model.adaln_input(timesteps)
        assert got_curve.dtype == torch.float32
        assert (got_curve.double() - curve).abs().max() < 1e-6
        # On a row (t = 0, 5/16, 1) the curve is that row, bit for bit.
        for index, row in ((0, 0), (1, 5), (6, rows - 1)):
            assert torch.equal(got_curve[index], model.adaln_t_table[row])
        for got, expected in zip(got_tables(model, timesteps), expected_tables(model, curve), strict=True):
            assert (got - expected).abs().max() < 1e-6 * max(1.0, expected.abs().max().item())


def test_the_basis_form_at_full_rank_is_the_exact_model() -> None:
    """W' = W @ basis, b' = b + W @ mean with an orthonormal basis of the whole SiLU(temb) space: every table and
    the forward equal the exact model's to fp32 rounding."""
    exact = model_of(TINY, seed=2)
    full = dataclasses.replace(TINY, adaln_rank=TINY.time_embed_dim)
    state = {key: value.clone() for key, value in exact.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(8, 8, generator=generator, dtype=torch.float64))[0]
    mean = torch.randn(8, generator=generator, dtype=torch.float64)
    state["adaln_curve.mean"], state["adaln_curve.basis"] = mean.float(), basis.float()
    for key in [key for key in state if key.endswith("adaln_proj.linear.weight")]:
        weight = state[key].double()
        bias_key = key.removesuffix("weight") + "bias"
        state[key], state[bias_key] = (
            (weight @ basis).float(),
            (state[bias_key].double() + weight @ mean).float(),
        )
    pruned = H3DiT(full, dtype=torch.float32)
    pruned.load_state_dict(state, strict=True)
    timesteps = torch.tensor(TIMESTEPS)
    with torch.no_grad():
        for got, expected in zip(
            got_tables(pruned.eval(), timesteps), got_tables(exact, timesteps), strict=True
        ):
            assert (got - expected).abs().max() < 1e-5 * expected.abs().max()
        request = tiny_fl2va_request(TINY, torch.float32, seed=5).as_h3_arguments()
        for got, expected in zip(pruned(*request), exact(*request), strict=True):
            assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_the_exact_projection_is_unchanged() -> None:
    """SiLU on the fp32 temb, then the bf16 linear: the release's recipe, bit for bit."""
    model = model_of(TINY, seed=4, dtype=torch.bfloat16)
    timesteps = torch.tensor(TIMESTEPS)
    temb = model.time_embedder(timesteps)
    assert torch.equal(model.adaln_input(timesteps), temb)
    linear = model.blocks[0].adaln_proj.linear
    assert linear.weight.dtype == torch.bfloat16 and linear.in_features == TINY.time_embed_dim
    expected = F.linear(F.silu(temb).to(torch.bfloat16), linear.weight, linear.bias)
    assert torch.equal(model.blocks[0].adaln_proj(temb), expected)
    assert DiTConfig.released().adaln_form == "exact" and TINY.adaln_form == "exact"


def test_pruned_forms_hold_their_tensors_in_fp32_and_run_in_bf16() -> None:
    for config in (TABLE, BASIS):
        model = model_of(config, seed=6, dtype=torch.bfloat16)
        state = model.state_dict()
        assert "time_embedder.proj_in.weight" in state or config.adaln_form == "table"
        assert all(tensor.dtype == torch.float32 for key, tensor in state.items() if "adaln" in key), (
            config.adaln_form
        )
        modulation = model.modulation(torch.tensor([0.3, 0.999]))
        assert modulation.blocks[0].shift_attn.dtype == torch.bfloat16
        with torch.no_grad():
            video, audio = model(*tiny_fl2va_request(config, torch.bfloat16, seed=7).as_h3_arguments())
        assert video.dtype == torch.float32 and torch.isfinite(video).all() and torch.isfinite(audio).all()


# --------------------------------------------------------------------------------------------------------------
# Detection from the files
# --------------------------------------------------------------------------------------------------------------


def shapes_of(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    return dict(native_state_shapes(config))


def test_the_shapes_decide_the_form() -> None:
    assert adaln_form_from_shapes(shapes_of(TINY), TINY) == TINY
    assert adaln_form_from_shapes(shapes_of(TABLE), TINY) == TABLE
    assert adaln_form_from_shapes(shapes_of(BASIS), TINY) == BASIS
    # config.json may state the form; stated right, it changes nothing.
    assert adaln_form_from_shapes(shapes_of(TABLE), TABLE) == TABLE


def _without(shapes: dict, *keys: str) -> dict:
    return {key: shape for key, shape in shapes.items() if key not in keys}


@pytest.mark.parametrize(
    "shapes, config, names",
    [
        ({**shapes_of(TINY), "adaln_t_table": (17, 4)}, TINY, "'time_embedder."),
        (
            {
                **_without(shapes_of(TINY), *[k for k in shapes_of(TINY) if k.startswith("time_embedder")]),
                "adaln_t_table": (17, 4),
            },
            TINY,
            "'blocks.0.adaln_proj.linear.weight' is [288, 8]",
        ),
        (_without(shapes_of(BASIS), "adaln_curve.mean"), TINY, "'adaln_curve.mean' is missing"),
        (_without(shapes_of(BASIS), "adaln_curve.basis"), TINY, "'adaln_curve.basis' is missing"),
        (
            {**shapes_of(BASIS), "adaln_curve.basis": (8, 5)},
            TINY,
            "'blocks.0.adaln_proj.linear.weight' is [288, 3]",
        ),
        ({**shapes_of(BASIS), "adaln_curve.basis": (7, 3)}, TINY, "'adaln_curve.basis' is [7, 3]"),
        (
            _without(
                shapes_of(BASIS),
                "time_embedder.proj_out.weight",
                "time_embedder.proj_out.bias",
                "time_embedder.proj_in.weight",
                "time_embedder.proj_in.bias",
            ),
            TINY,
            "'time_embedder.proj_out.weight' is missing",
        ),
        (
            {**shapes_of(TABLE), "adaln_curve.mean": (8,)},
            TINY,
            "'adaln_curve.mean' sits beside 'adaln_t_table'",
        ),
        ({**shapes_of(TABLE), "adaln_t_table": (1, 4)}, TINY, "'adaln_t_table' is [1, 4]"),
        (
            _without(shapes_of(TABLE), "adaln_t_table"),
            TINY,
            "'blocks.0.adaln_proj.linear.weight' is [288, 4]",
        ),
        (
            {**shapes_of(TINY), "blocks.1.adaln_proj.linear.weight": (288, 4)},
            TINY,
            "'blocks.1.adaln_proj.linear.weight' is [288, 4]",
        ),
        (shapes_of(TABLE), dataclasses.replace(TABLE, adaln_table_rows=33), "adaln_table_rows 33"),
        (shapes_of(TINY), BASIS, "adaln_rank 3"),
        (shapes_of(BASIS), TABLE, "adaln_rank 4"),
    ],
)
def test_contradictions_are_refused_by_tensor(shapes, config, names) -> None:
    with pytest.raises(CheckpointError) as raised:
        adaln_form_from_shapes(shapes, config)
    assert names in str(raised.value), str(raised.value)


def test_config_json_may_state_the_form() -> None:
    from h3engine.checkpoint.dit_format import config_to_native

    native = config_to_native(TINY)
    assert "adaln_rank" not in native and config_from_native(native) == TINY
    assert config_from_native(config_to_native(BASIS)) == BASIS
    assert config_from_native(config_to_native(TABLE)) == TABLE
    # ComfyUI's curve configs: the table's rows as adaln_curve_grid, its width as time_embed_dim.
    comfy = {**native, "adaln_curve_grid": 17, "time_embed_dim": 4}
    assert config_from_native(comfy).adaln_form == "table" and config_from_native(comfy).adaln_rank == 4
    with pytest.raises(CheckpointError, match="disagree"):
        config_from_native({**native, "adaln_curve_grid": 17, "adaln_table_rows": 33, "adaln_rank": 4})


def write_dit(folder: Path, config: DiTConfig, seed: int, edit=None) -> None:
    """A native transformer folder (two shards and an index) of a random `config` DiT, `edit(state)` applied."""
    state = random_native_state(config, seed)
    if edit is not None:
        edit(state)
    for path in folder.glob("*.safetensors*"):
        path.unlink()
    save_sharded(state, folder, "model", 2, "model.safetensors.index.json")


def test_a_refusal_names_the_file(tmp_path) -> None:
    def wide(state: dict) -> None:
        state["adaln_t_table"] = torch.zeros(17, 4)
        for key in [key for key in state if key.startswith("time_embedder.")]:
            del state[key]

    write_dit(tmp_path, TINY, seed=8, edit=wide)
    files = WeightFiles.open(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        adaln_form_of_files(files, TINY, native=True)
    message = str(raised.value)
    shard = files.infos["blocks.0.adaln_proj.linear.weight"].file
    assert message.startswith(f"{shard}: tensor 'blocks.0.adaln_proj.linear.weight' is [288, 8]"), message
    assert "adaln_t_table" in message


def test_the_diffusers_layout_holds_no_pruned_form(tiny_checkpoints, tmp_path) -> None:
    layout = detect_layout(tiny_checkpoints("diffusers", seed=0))
    files = WeightFiles.open(layout.for_task("t2va").dit)
    files.infos["adaln_t_table"] = dataclasses.replace(files.infos["proj_in.weight"], shape=(17, 4))
    with pytest.raises(CheckpointError, match="native layout only"):
        adaln_form_of_files(files, TINY, native=False)


# --------------------------------------------------------------------------------------------------------------
# Where the exact DiT runs
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["table", "basis"])
def pruned_checkpoint(request, tmp_path_factory) -> tuple[Path, DiTConfig]:
    """A tiny native checkpoint whose two DiTs are random DiTs of a pruned form (config.json as released)."""
    config = TABLE if request.param == "table" else BASIS
    root = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "checkpoint", seed=5)
    for seed, partition in enumerate(("FL2VA", "Ref2VA")):
        write_dit(root / partition / "transformer", config, seed=20 + seed)
    return root, config


def test_the_loader_reads_a_pruned_checkpoint(pruned_checkpoint) -> None:
    root, config = pruned_checkpoint
    layout = detect_layout(root)
    paths = layout.for_task("t2va")
    assert read_dit_config(layout, paths) == config
    model = dit_source(layout, paths, torch.float32).load(torch.device("cpu"))
    expected = model_of(config, seed=20)
    assert all(torch.equal(value, expected.state_dict()[key]) for key, value in model.state_dict().items())


def test_an_engine_generates_with_a_pruned_dit(pruned_checkpoint) -> None:
    root, _ = pruned_checkpoint
    request = parity_requests(steps=2, seed=4)["t2va"]
    resident, _ = Engine.from_checkpoint(root, device="cpu", adaln_cache="off").generate(request)
    assert torch.isfinite(resident.video_latents).all() and torch.isfinite(resident.audio_latents).all()
    streamed_engine = Engine.from_checkpoint(
        root, device="cpu", adaln_cache="off", memory_profile="streamed", host_memory=1e-6
    )
    streamed, _ = streamed_engine.generate(request)
    assert torch.equal(streamed.video_latents, resident.video_latents)
    fp8, _ = Engine.from_checkpoint(root, device="cpu", adaln_cache="off", weights="fp8").generate(request)
    assert torch.isfinite(fp8.video_latents).all()


@pytest.mark.parametrize("config", [TABLE, BASIS], ids=["table", "basis"])
def test_offloaded_projections_build_the_same_tables_and_stay_unquantized(config) -> None:
    model = model_of(config, seed=9, dtype=torch.bfloat16)
    timesteps = [torch.tensor([0.3, 0.999]), torch.tensor([0.67])]
    expected = [model.modulation(step) for step in timesteps]
    store_adaln_in_fp8(model)
    offload_adaln(model, fp8=True)
    assert not any(is_parked(block.adaln_proj.linear.weight) for block in model.blocks)
    for got, want in zip(build_modulation(model, timesteps), expected, strict=True):
        for block, block_expected in zip(got.blocks, want.blocks, strict=True):
            assert torch.equal(block.wait().shift_attn, block_expected.shift_attn)
            assert torch.equal(block.gate_ffn, block_expected.gate_ffn)
        assert all(torch.equal(a, b) for a, b in zip(got.final_tables(), want.final, strict=True))


def test_a_single_rank_shard_is_the_single_process_model(tmp_path) -> None:
    write_dit(tmp_path, EIGHT_HEAD_TABLE, seed=10)
    groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEAD_TABLE, 1))
    sharded = load_dit_shard(WeightFiles.open(tmp_path), EIGHT_HEAD_TABLE, groups, torch.float32, "cpu")
    request = tiny_fl2va_request(EIGHT_HEAD_TABLE, torch.float32, seed=11).as_h3_arguments()
    with torch.no_grad():
        got, expected = sharded(*request), model_of(EIGHT_HEAD_TABLE, seed=10)(*request)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def parallel_worker(rank: int, world_size: int, store: str, folder: str, output: str) -> None:
    """One rank: the pruned 8-head DiT under Ulysses 2 and under tensor parallel 2, on the same request."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    initialize_process_group(
        rank, world_size, f"file://{store}", torch.device("cpu"), timeout=timedelta(seconds=120)
    )
    request = tiny_fl2va_request(EIGHT_HEAD_TABLE, torch.float32, seed=11).as_h3_arguments()
    results = {}
    for sp, tp in ((2, 1), (1, 2)):
        groups = create_dit_groups(ParallelLayout.for_dit(EIGHT_HEAD_TABLE, world_size, sp, tp))
        model = load_dit_shard(WeightFiles.open(Path(folder)), EIGHT_HEAD_TABLE, groups, torch.float32, "cpu")
        with torch.no_grad():
            results[sp, tp] = model(*request)
    torch.save(results, Path(output) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_sequence_and_tensor_parallel_ranks_compute_the_single_process_model(tmp_path) -> None:
    folder = tmp_path / "dit"
    write_dit(folder, EIGHT_HEAD_TABLE, seed=10)
    arguments = (2, str(tmp_path / "store"), str(folder), str(tmp_path))
    mp.start_processes(parallel_worker, args=arguments, nprocs=2, join=True, start_method="forkserver")
    request = tiny_fl2va_request(EIGHT_HEAD_TABLE, torch.float32, seed=11).as_h3_arguments()
    with torch.no_grad():
        expected = model_of(EIGHT_HEAD_TABLE, seed=10)(*request)
    for rank in range(2):
        for layout, velocities in torch.load(tmp_path / f"rank{rank}.pt").items():
            for got, want in zip(velocities, expected, strict=True):
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (rank, layout)


@pytest.mark.cuda
def test_on_a_gpu_pinned_projections_build_the_module_tables_and_the_engine_generates(
    pruned_checkpoint,
) -> None:
    """The tables built on the side stream from pinned host projections are the module's own; an engine on the GPU
    (AdaLN offloaded, as for the release) generates from the pruned checkpoint what it does on the CPU, roughly."""
    root, config = pruned_checkpoint
    model = H3DiT(config, dtype=torch.bfloat16, device="cuda")
    model.load_state_dict(native_to_module(random_native_state(config, 9), config), strict=True)
    timesteps = [torch.tensor([0.3, 0.999], device="cuda"), torch.tensor([0.67], device="cuda")]
    expected = [model.modulation(step) for step in timesteps]
    offload_adaln(model, fp8=True)
    assert model.blocks[0].adaln_proj.linear.weight.is_pinned()
    for got, want in zip(build_modulation(model, timesteps), expected, strict=True):
        for block, block_expected in zip(got.blocks, want.blocks, strict=True):
            assert torch.equal(block.wait().shift_attn, block_expected.shift_attn)
        assert all(torch.equal(a, b) for a, b in zip(got.final_tables(), want.final, strict=True))
    request = parity_requests(steps=2, seed=4)["t2va"]
    on_gpu, _ = Engine.from_checkpoint(root, device="cuda", adaln_cache="off").generate(request)
    on_cpu, _ = Engine.from_checkpoint(root, device="cpu", adaln_cache="off").generate(request)
    scale = on_cpu.video_latents.abs().max()
    assert (on_gpu.video_latents.cpu() - on_cpu.video_latents).abs().max() < 0.05 * scale
