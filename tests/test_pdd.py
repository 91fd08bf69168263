"""PDD acceleration adapters (h3engine.checkpoint.pdd_format, h3engine.engine.sampling.pdd): a tiny adapter in the
published layout (alibaba-pai's MiniMax-H3-*-Acc-8Step files: bare `.lora_down` / `.lora_up` on diffusers names,
32-interval `proj_out` / `audio_proj_out` banks) read, blended per step as the reference blends them (restated here
on its own), run on the tiny checkpoint as the preset runs it, and refused by file and tensor when malformed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _lora_helpers import ours_as_diffusers
from _refusals import cli_refused, refused
from safetensors.torch import load_file, save_file
from torch import Tensor

from h3engine.checkpoint.dit_keys import diffusers_keys, native_state_shapes
from h3engine.checkpoint.layout import detect_layout
from h3engine.checkpoint.loader import dit_source
from h3engine.checkpoint.lora_format import LoraError, check_lora_fits, read_lora
from h3engine.checkpoint.pdd_format import PddAdapterFile, check_pdd_fits, read_pdd_adapter
from h3engine.cli import main as cli
from h3engine.engine.engine import Engine
from h3engine.engine.lora.adapters import LoraFiles, LoraHeaders
from h3engine.engine.lora.library import LoraLibrary, TurboSettings, turbo_settings
from h3engine.engine.sampling.pdd import StepHeads, install_heads, remove_heads
from h3engine.engine.sampling.schedule import Schedule
from h3engine.errors import RequestError
from h3engine.models.dit_config import DiTConfig
from h3engine.request.model import GenerationRequest, LoraChoice

N, BLOCK, RANK, ALPHA = 32, 4, 4, 8.0
HEADS = {"final_layer.video_out": "proj_out", "final_layer.audio_out": "audio_proj_out"}


def dit_config(checkpoint: Path) -> DiTConfig:
    layout = detect_layout(checkpoint)
    return dit_source(layout, layout.for_task("t2va"), torch.float32).config


def backbone_factors(config: DiTConfig, seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """diffusers module -> (down [r, in], up [out, r]) for every module the published adapters train: each block's
    to_q / to_k / to_v / to_out.0 / ff.net.0.proj / ff.net.2 / adaln_proj.linear, the refiner's the same but AdaLN."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for key, shape in native_state_shapes(config).items():
        module = key.removesuffix(".weight")
        if len(shape) != 2 or "blocks." not in module:
            continue
        out_features, in_features = shape
        targets = [target.removesuffix(".weight") for target in diffusers_keys(key)]
        for target in targets:
            rows = out_features // len(targets)
            down = torch.randn(RANK, in_features, generator=generator) * 0.05
            factors[target] = (down, torch.randn(rows, RANK, generator=generator))
    return factors


def head_banks(config: DiTConfig, seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = native_state_shapes(config)
    banks = {}
    for module, prefix in HEADS.items():
        out_features, in_features = shapes[f"{module}.weight"]
        banks[f"{prefix}.weight"] = torch.randn(N, out_features, in_features, generator=generator) * 0.3
        banks[f"{prefix}.bias"] = torch.randn(N, out_features, generator=generator) * 0.1
    return banks


def write_pdd(
    path: Path, config: DiTConfig, seed: int = 0, banks: dict[str, Tensor] | None = None, **metadata: str
) -> Path:
    """A PDD adapter in the published layout, its tensors bf16 as released."""
    tensors = {}
    for module, (down, up) in backbone_factors(config, seed).items():
        tensors[f"{module}.lora_down"], tensors[f"{module}.lora_up"] = down, up
    tensors |= head_banks(config, seed) if banks is None else banks
    tensors = {key: tensor.to(torch.bfloat16).contiguous() for key, tensor in tensors.items()}
    entries = {"pdd_num_steps": str(N), "pdd_block_size": str(BLOCK), "lora_alpha": str(ALPHA)} | metadata
    save_file(tensors, str(path), metadata=entries)
    return path


def request(pdd: Path | None = None, **fields: object) -> GenerationRequest:
    loras = () if pdd is None else (LoraChoice(str(pdd)),)
    values = dict(task="t2va", prompt="a fox in the snow", duration_seconds=4.0, steps=8, seed=7, loras=loras)
    return GenerationRequest(**(values | fields))


@pytest.fixture(scope="module")
def engine(tiny_native: Path) -> Engine:
    return Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)


def engine_config(engine: Engine) -> DiTConfig:
    return engine.store.dit_config(engine.store.partition_for("t2va"))


# --- the published blend, restated ---------------------------------------------------------------------------------


def published_blend(bank: Tensor, shift: float, first: int, last: int) -> Tensor:
    """The reference's block mean (VideoX-Fun `pdd_time_grid` / `pdd_sampling_plan`), written out: on the ascending
    grid t_n = 1 - shift*s/(1 + (shift-1)*s), s = 1 - n/N, the heads of [first, last) weighted by h_n = t_{n+1} - t_n
    over their sum, in fp64."""

    def t(n: int) -> float:
        s = 1.0 - n / N
        return 1.0 - shift * s / (1.0 + (shift - 1.0) * s)

    steps = {n: t(n + 1) - t(n) for n in range(first, last)}
    span = math.fsum(steps.values())
    return sum(bank[n].double() * (h / span) for n, h in steps.items())


@pytest.mark.parametrize("forwards", [8, 4])
def test_each_step_blends_the_heads_it_spans_as_published(
    tmp_path: Path, engine: Engine, forwards: int
) -> None:
    config = engine_config(engine)
    adapter = read_pdd_adapter(write_pdd(tmp_path / "pdd.safetensors", config))
    dit = engine.store.models_for_task("t2va").dit
    install_heads(dit, adapter.heads, torch.device("cpu"))
    try:
        heads = StepHeads(dit, Schedule.build(forwards, recipe="sglang"))
    finally:
        remove_heads(dit)
    width = N // forwards
    assert len(heads.blends) == forwards
    for step, blend in enumerate(heads.blends):
        for module, shift in (("final_layer.video_out", 12.0), ("final_layer.audio_out", 3.0)):
            weight_bank, bias_bank = adapter.heads.banks[module]
            span = (step * width, (step + 1) * width)
            for ours, bank in zip(blend[module], (weight_bank, bias_bank), strict=True):
                torch.testing.assert_close(
                    ours.double(), published_blend(bank, shift, *span), rtol=1e-6, atol=1e-7
                )


def test_the_reader_maps_the_backbone_onto_our_modules(tmp_path: Path, tiny_native: Path) -> None:
    """The backbone reads as the same updates as an ordinary diffusers LoRA file of the same factors."""
    config = dit_config(tiny_native)
    path = write_pdd(tmp_path / "pdd.safetensors", config)
    adapter, _ = LoraFiles().read(path)  # the engine's reader tells the layout by the header
    assert (
        isinstance(adapter, PddAdapterFile) and adapter.layout == "pdd" and list(adapter.partitions) == [None]
    )
    factors = {
        module: (down.bfloat16().float(), up.bfloat16().float())
        for module, (down, up) in backbone_factors(config, 0).items()
    }
    tensors = {}
    for module, (down, up) in factors.items():
        tensors[f"transformer.{module}.lora_A.weight"], tensors[f"transformer.{module}.lora_B.weight"] = (
            down,
            up,
        )
    adapter_config = json.dumps({"transformer.lora_alpha": ALPHA, "transformer.r": RANK})
    save_file(
        tensors, str(tmp_path / "plain.safetensors"), metadata={"lora_adapter_metadata": adapter_config}
    )
    plain = read_lora(tmp_path / "plain.safetensors").layers("transformer")
    layers = adapter.layers()
    assert set(layers) == set(plain) and len(layers) == 5 * config.num_layers + 4 * config.num_refiner_layers
    for module, layer in layers.items():
        torch.testing.assert_close(layer.delta(), plain[module].delta(), rtol=1e-6, atol=1e-6)
    # ... and as their dense diffusers updates, alpha / r applied.
    ours = ours_as_diffusers({module: layer.delta() for module, layer in layers.items()}, config)
    for module, (down, up) in factors.items():
        torch.testing.assert_close(ours[module], up @ down * (ALPHA / RANK), rtol=1e-5, atol=1e-6)
    # A header-only read gives the same shapes.
    shapes, _ = LoraHeaders().read(path)
    assert shapes.heads.banks["final_layer.video_out"][0].is_meta
    assert {m: x.down.shape for m, x in shapes.layers().items()} == {
        m: x.down.shape for m, x in layers.items()
    }


# --- the engine ------------------------------------------------------------------------------------------------------


def test_the_preset_runs_eight_steps_on_the_nine_point_grid(tmp_path: Path, engine: Engine) -> None:
    config = engine_config(engine)
    pdd = write_pdd(tmp_path / "pdd.safetensors", config)
    steps = []
    prepared = engine.prepare(request(pdd))
    expected = torch.tensor(
        [12 * b / (1 + 11 * b) for b in torch.linspace(1, 0, 9, dtype=torch.float64).tolist()],
        dtype=torch.float64,
    )
    assert prepared.schedule.num_steps == 8
    torch.testing.assert_close(prepared.schedule.video_sigmas.double(), expected, rtol=0, atol=1e-6)
    output, _ = engine.generate(request(pdd), on_step=lambda event: steps.append(event))
    assert len(steps) == 8
    plain, _ = engine.generate(request())
    assert not torch.allclose(output.video_latents, plain.video_latents, atol=1e-3)
    assert not torch.allclose(output.audio_latents, plain.audio_latents, atol=1e-3)
    # The heads matter: the backbone alone gives another result.
    backbone_only = write_pdd(tmp_path / "backbone.safetensors", config, banks=heads_of(engine))
    same_backbone, _ = engine.generate(request(backbone_only))
    assert not torch.allclose(output.video_latents, same_backbone.video_latents, atol=1e-3)


def heads_of(engine: Engine) -> dict[str, Tensor]:
    """32 copies of the checkpoint's own output heads, as a bank."""
    final = engine.store.models_for_task("t2va").dit.final_layer
    banks = {}
    for module, prefix in HEADS.items():
        linear = final.get_submodule(module.removeprefix("final_layer."))
        banks[f"{prefix}.weight"] = linear.weight.detach().expand(N, *linear.weight.shape).clone()
        banks[f"{prefix}.bias"] = linear.bias.detach().expand(N, *linear.bias.shape).clone()
    return banks


def test_with_its_own_heads_the_backbone_runs_as_an_ordinary_lora(tmp_path: Path, engine: Engine) -> None:
    """Heads that are the checkpoint's own (bf16-rounded, as a bank would store them) leave the backbone LoRA, which
    then equals the same factors applied as an ordinary LoRA on the same 8-step schedule."""
    config = engine_config(engine)
    banks = heads_of(engine)
    pdd = write_pdd(tmp_path / "pdd.safetensors", config, banks=banks)
    tensors = {}
    for module, (down, up) in backbone_factors(config, 0).items():
        tensors[f"transformer.{module}.lora_A.weight"] = down.bfloat16().float()
        tensors[f"transformer.{module}.lora_B.weight"] = up.bfloat16().float()
    adapter_config = json.dumps({"transformer.lora_alpha": ALPHA, "transformer.r": RANK})
    save_file(
        tensors, str(tmp_path / "plain.safetensors"), metadata={"lora_adapter_metadata": adapter_config}
    )
    # The ordinary LoRA on a checkpoint whose heads are the bank's bf16 values: swap them in for that run.
    dit = engine.store.models_for_task("t2va").dit
    originals = {
        name: tensor.clone() for name, tensor in dit.final_layer.state_dict().items() if "_out." in name
    }
    output, _ = engine.generate(request(pdd))
    try:
        with torch.no_grad():
            for name, tensor in originals.items():
                dit.final_layer.state_dict()[name].copy_(tensor.bfloat16().float())
        plain, _ = engine.generate(request(tmp_path / "plain.safetensors"))
    finally:
        with torch.no_grad():
            for name, tensor in originals.items():
                dit.final_layer.state_dict()[name].copy_(tensor)
    torch.testing.assert_close(output.video_latents, plain.video_latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(output.audio_latents, plain.audio_latents, rtol=1e-4, atol=1e-5)


def test_a_forward_no_step_armed_is_refused(tmp_path: Path, engine: Engine) -> None:
    adapter = read_pdd_adapter(write_pdd(tmp_path / "pdd.safetensors", engine_config(engine)))
    dit = engine.store.models_for_task("t2va").dit
    install_heads(dit, adapter.heads, torch.device("cpu"))
    try:
        with pytest.raises(RuntimeError, match="no step armed them"):
            dit.final_layer.video_out(torch.zeros(1, dit.config.hidden_size))
    finally:
        remove_heads(dit)
    assert (
        dit.final_layer.video_out(torch.zeros(1, dit.config.hidden_size)).shape[-1]
        == dit.config.video_patch_dim
    )


# --- the preset ------------------------------------------------------------------------------------------------------


def test_the_library_and_the_turbo_preset_know_a_pdd_adapter(tmp_path: Path, tiny_native: Path) -> None:
    folder = tmp_path / "loras"
    folder.mkdir()
    write_pdd(folder / "MiniMax-H3-FL2VA-Acc-8Step.safetensors", dit_config(tiny_native))
    (entry,) = LoraLibrary(folder).entries
    assert entry.turbo == TurboSettings(
        8, 12.0, 3.0, (), "MiniMax-H3-FL2VA-Acc-8Step.safetensors, a PDD adapter", True
    )
    assert entry.label().endswith("· PDD)") and entry.targets == ()
    assert turbo_settings([entry.turbo]).steps == 8
    assert turbo_settings([entry.turbo], recipe="diffusers").steps == 9  # it counts the terminal grid point


def generate(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", str(checkpoint), "--prompt", "A fox in the snow.", "--device", "cpu"] + [
        "--dtype", "float32", "--duration", "4", "--out", str(out), "--progress", "plain", *extra
    ]  # fmt: skip


def test_the_cli_pdd_preset(capsys, tmp_path: Path, tiny_native: Path) -> None:
    config = dit_config(tiny_native)
    pdd = write_pdd(tmp_path / "pdd.safetensors", config)
    out = tmp_path / "a.mp4"
    assert cli.main(generate(tiny_native, out, "--pdd", str(pdd))) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    settings = {key: sidecar["request"][key] for key in ("steps", "rungs", "flow_shift", "audio_flow_shift")}
    assert settings == {"steps": 8, "rungs": [], "flow_shift": 12.0, "audio_flow_shift": 3.0}
    assert sidecar["request"]["loras"] == [{"path": str(pdd), "strength": 1.0, "target": "transformer"}]
    # --turbo with the adapter as a --lora is the same preset; the diffusers recipe counts 9 steps for 8 forwards.
    out = tmp_path / "b.mp4"
    assert cli.main(generate(tiny_native, out, "--lora", str(pdd), "--turbo", "--recipe", "diffusers")) == 0
    assert json.loads(out.with_suffix(".json").read_text())["request"]["steps"] == 9
    capsys.readouterr()
    plain = tmp_path / "plain.safetensors"
    save_file(
        {"transformer.transformer_blocks.0.ff.net.2.lora_A.weight": torch.zeros(2, config.ffn_dim)},
        str(plain),
    )
    for flags, field in (
        (("--pdd", str(plain)), "--pdd"),  # an ordinary LoRA
        (("--pdd", str(tmp_path / "none.safetensors")), "--pdd"),
        (("--pdd", str(pdd), "--steps", "6"), "steps"),
        (("--pdd", str(pdd), "--flow-shift", "6"), "flow_shift"),
    ):
        assert cli.main(generate(tiny_native, tmp_path / "c.mp4", *flags)) == 2
        problem = cli_refused(capsys.readouterr().err, field)
        assert (
            field != "--pdd"
            or "plain.safetensors' is not a PDD adapter" in problem
            or "none.safetensors" in problem
        )
    assert not (tmp_path / "c.mp4").exists()


# --- refusals --------------------------------------------------------------------------------------------------------


def test_the_recipe_is_held(tmp_path: Path, engine: Engine) -> None:
    pdd = write_pdd(tmp_path / "pdd.safetensors", engine_config(engine))
    other = write_pdd(tmp_path / "other.safetensors", engine_config(engine), seed=1)
    engine.resolve(request(pdd))
    engine.resolve(request(pdd, steps=4))  # blocks of 8 intervals: the reference's 4-forward grouping
    engine.resolve(request(pdd, steps=9, recipe="diffusers"))
    cases = [
        (request(pdd, steps=50), "steps", "use 8 or 4 steps with the sglang recipe"),
        (request(pdd, steps=16), "steps", "the heads were trained on blocks of 4 or 8"),
        (request(pdd, steps=8, recipe="diffusers"), "steps", "use 9 or 5 steps with the diffusers recipe"),
        (request(pdd, flow_shift=6.0), "flow_shift", "trained at flow shifts 12 / 3, got 6"),
        (request(pdd, audio_flow_shift=2.0), "audio_flow_shift", "got 2"),
        (request(pdd, cache="high"), "cache", "needs every one"),
        (request(pdd, rungs=(999, 750, 500, 250), steps=4), "rungs", "not rungs"),
        (request(loras=(LoraChoice(str(pdd), 0.5),)), "loras[0].strength", "strength 1 only, got 0.5"),
        (request(loras=(LoraChoice(str(pdd)), LoraChoice(str(other)))), "loras[1]", "a second PDD adapter"),
    ]
    for bad, field, says in cases:
        with refused(RequestError, field=field, says=says):
            engine.resolve(bad)


def test_malformed_files_are_refused_by_file_and_tensor(tmp_path: Path, tiny_native: Path) -> None:
    config = dit_config(tiny_native)
    plain = tmp_path / "style.safetensors"
    save_file(
        {"transformer.transformer_blocks.0.ff.net.2.lora_A.weight": torch.zeros(2, config.ffn_dim)},
        str(plain),
    )
    with refused(LoraError, names=("'style.safetensors'", "is not a PDD adapter", "'proj_out.weight'")):
        read_pdd_adapter(plain)
    banks = head_banks(config, 0)

    def written(name: str, **changes: Tensor | None) -> Path:
        tensors = {key: value for key, value in (banks | changes).items() if value is not None}
        return write_pdd(tmp_path / name, config, banks=tensors)

    cases = {
        "narrow.safetensors": ({"proj_out.weight": banks["proj_out.weight"][:, :, :-1]}, "proj_out.weight", "the DiT's final_layer.video_out.weight is"),
        "few.safetensors": ({"audio_proj_out.weight": banks["audio_proj_out.weight"][:31]}, "audio_proj_out.weight", "not [32, out, in]"),
        "bias.safetensors": ({"proj_out.bias": banks["proj_out.bias"][:, :-1]}, "proj_out.bias", "beside 'proj_out.weight'"),
        "missing.safetensors": ({"audio_proj_out.bias": None}, "audio_proj_out.bias", "is missing"),
        "nan.safetensors": ({"proj_out.bias": torch.full_like(banks["proj_out.bias"], math.nan)}, "proj_out.bias", "NaN"),
    }  # fmt: skip
    for name, (changes, tensor, says) in cases.items():
        path = written(name, **changes)
        with refused(LoraError, names=(repr(name), repr(tensor), says)):
            check_pdd_fits(read_pdd_adapter(path), config)
    # The factors and the metadata name theirs too.
    path = write_pdd(tmp_path / "grid.safetensors", config, pdd_num_steps="30")
    with refused(LoraError, names=("'grid.safetensors'", "'pdd_num_steps' 30", "'pdd_block_size' 4")):
        read_pdd_adapter(path)
    tensors = load_file(str(write_pdd(tmp_path / "odd.safetensors", config)))
    del tensors["transformer_blocks.0.ff.net.2.lora_up"]
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    with refused(
        LoraError, names=("'odd.safetensors'", "'transformer_blocks.0.ff.net.2.lora_down'", "no .lora_up")
    ):
        read_pdd_adapter(tmp_path / "odd.safetensors")
    tensors["transformer_blocks.0.ff.net.2.lora_up"] = torch.zeros(config.hidden_size, RANK)
    tensors["transformer_blocks.9.attn.to_q.lora_down"] = torch.zeros(RANK, config.hidden_size)
    tensors["transformer_blocks.9.attn.to_q.lora_up"] = torch.zeros(config.hidden_size, RANK)
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    with refused(LoraError, names=("'transformer_blocks.9.attn.to_q.lora_down'", "names no linear layer")):
        check_lora_fits(read_pdd_adapter(tmp_path / "odd.safetensors"), config)


def test_a_misfit_adapter_is_refused_by_request_field(tmp_path: Path, engine: Engine) -> None:
    config = engine_config(engine)
    banks = head_banks(config, 0)
    narrow = write_pdd(
        tmp_path / "narrow.safetensors",
        config,
        banks=banks | {"proj_out.weight": banks["proj_out.weight"][:, :, :-1]},
    )
    with refused(RequestError, field="loras[0]", names=("narrow.safetensors", "'proj_out.weight'")):
        engine.resolve(request(narrow))
