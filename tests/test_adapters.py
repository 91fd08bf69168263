"""LoRA adapters applied beside the DiT's linears (h3engine.engine.lora.adapters, a request's `loras`), in one process.

Whole T2VA generations at fp32 on a tiny checkpoint equal diffusers 0.42.1's pipeline after `load_lora_weights`
(peft's unfused LoRA layers), one LoRA or two with strengths; strength 0 and removal give the base outputs
bit-exactly; an AdaLN LoRA takes effect after a cached schedule; bad adapters change nothing; FP8 linears carry the
update beside them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import assert_changed, assert_equal, loras_loaded, small_lora, write_lora
from _parity_helpers import reference_pipeline, relative_l2
from _refusals import refused

from benchmarks._packed_request import max_relative_error
from h3engine.checkpoint.dit_format import native_to_module
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.lora_format import read_lora
from h3engine.engine.engine import Engine
from h3engine.engine.lora import adapters as adapters_module
from h3engine.engine.lora.adapters import (
    Adapter,
    LoraFiles,
    adapted_layers,
    applied_adapters,
    apply_adapters,
    remove_adapters,
)
from h3engine.errors import RequestError
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.models.parallel.dit import _apply_tensor_parallel
from h3engine.models.parallel.groups import GroupMembership
from h3engine.models.quantization import Fp8Linear, quantize_dit_linears
from h3engine.request.files import Reference
from h3engine.request.model import MAX_LORAS, GenerationRequest, LoraChoice

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "A red fox runs through fresh snow at dawn. <d>[English] Look at that!</d> Wind hisses softly."
STEPS, SEED = 3, 11
REQUEST = GenerationRequest(task="t2va", prompt=PROMPT, steps=STEPS, seed=SEED, recipe="diffusers")
# fp32 everywhere; measured ~1e-7 (the LoRA moves the outputs by ~1e-1, see `assert_changed`).
PARITY_BOUND = 1e-5
# Quantized vs unquantized tiny DiT, max relative error per velocity (tests/test_fp8.py measures and explains it).
FP8_DIT_ERROR_BOUND = 2.0**-3


def generate(engine: Engine, *loras: tuple[Path, float] | tuple[Path, float, str]):
    """The request with these LoRAs (path, strength[, target]); returns its output tensors."""
    choices = tuple(LoraChoice(str(lora[0]), *lora[1:]) for lora in loras)
    output, _ = engine.generate(dataclasses.replace(REQUEST, loras=choices))
    return output


def tiny_dit(state: dict[str, torch.Tensor]) -> H3DiT:
    model = H3DiT(DiTConfig.tiny(), dtype=torch.float32)
    model.load_state_dict(native_to_module(state, DiTConfig.tiny()), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("diffusers", seed=3)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def base(engine: Engine):
    return generate(engine)


def lora_file(tmp_path: Path, engine: Engine, layout: str, seed: int, only: str = "") -> Path:
    path = tmp_path / f"{layout}_{seed}{only}.safetensors"
    write_lora(
        path,
        small_lora(engine.store.dit_config("fl2va"), seed, only),
        layout,
        engine.store.dit_config("fl2va"),
    )
    return path


def reference_generation(folder: Path, loras: list[tuple[Path, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' T2VA pipeline with the files loaded by `load_lora_weights`, each at its strength."""
    pipe = reference_pipeline(folder, "t2va")
    with loras_loaded(pipe, loras):
        state = pipe(
            prompt=PROMPT,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(SEED),
            output_type="pt",
        )
    return state.get("videos")[0].permute(0, 2, 3, 1).float(), state.get("audio")[0].float()


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_t2va_with_a_lora_equals_diffusers(engine, base, checkpoint, tmp_path, layout: str) -> None:
    path = lora_file(tmp_path, engine, layout, seed=5)
    output = generate(engine, (path, 1.0, "transformer"))
    reference_video, reference_audio = reference_generation(checkpoint, [(path, 1.0)])
    assert relative_l2(output.video, reference_video) <= PARITY_BOUND
    assert relative_l2(output.audio, reference_audio) <= PARITY_BOUND
    assert_changed(output, base)  # the comparison can fail: without the LoRA the outputs are ~10 % off


def test_two_loras_with_strengths_equal_diffusers(engine, base, checkpoint, tmp_path) -> None:
    first, second = lora_file(tmp_path, engine, "diffusers", 6), lora_file(tmp_path, engine, "kohya", 7)
    loras = [(first, 0.7), (second, -0.4)]
    output = generate(engine, *[(path, strength, "transformer") for path, strength in loras])
    first_only = generate(engine, (first, 0.7, "transformer"))
    reference_video, reference_audio = reference_generation(checkpoint, loras)
    assert relative_l2(output.video, reference_video) <= PARITY_BOUND
    assert relative_l2(output.audio, reference_audio) <= PARITY_BOUND
    assert_changed(output, first_only)  # the second adapter counts


def test_strength_zero_removal_and_switching_are_exact(engine, base, tmp_path) -> None:
    first, second = lora_file(tmp_path, engine, "original", 8), lora_file(tmp_path, engine, "peft", 9)
    dit = engine.store.models_for_partition("fl2va").dit
    weights = {name: tensor.clone() for name, tensor in dit.state_dict().items()}

    zero = generate(engine, (first, 0.0, "transformer"))
    assert_equal(zero, base)
    assert adapted_layers(dit) == 0

    with_first = generate(engine, (first, 1.0, "transformer"))
    assert_changed(with_first, base)
    with_second = generate(engine, (second, 1.0, "transformer"))
    assert_changed(with_second, with_first)
    again = generate(engine, (first, 1.0, "transformer"))
    assert_equal(again, with_first)

    removed = generate(engine)
    assert_equal(removed, base)
    assert adapted_layers(dit) == 0
    for name, tensor in dit.state_dict().items():
        assert torch.equal(tensor, weights[name]), name  # the weights were never written


def test_an_adaln_lora_takes_effect_after_a_cached_schedule(engine, base, checkpoint, tmp_path) -> None:
    """The AdaLN tables of a schedule are cached per DiT (h3engine.engine.sampling.modulation): `base` filled the cache for this
    request, so an adapter on the AdaLN projections must make the engine build them again."""
    path = lora_file(tmp_path, engine, "diffusers", 10, only="adaln_proj")
    output = generate(engine, (path, 1.0, "transformer"))
    fresh = Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    expected = generate(fresh, (path, 1.0, "transformer"))
    assert_changed(output, base)
    assert_equal(output, expected)


def test_bad_adapters_are_refused_before_anything_changes(engine, base, tmp_path) -> None:
    good = lora_file(tmp_path, engine, "original", 12)
    with_good = generate(engine, (good, 0.5, "transformer"))
    wider = dataclasses.replace(DiTConfig.tiny(), hidden_size=2 * DiTConfig.tiny().hidden_size)
    misfit = tmp_path / "misfit.safetensors"
    write_lora(misfit, small_lora(wider, 13), "original", wider)
    ref_only = tmp_path / "ref_only.safetensors"
    ref_config = engine.store.dit_config("ref2va")
    write_lora(ref_only, small_lora(ref_config, 14), "diffusers_ref", ref_config)
    not_lora = tmp_path / "notes.safetensors"
    not_lora.write_text("not a safetensors file")
    # (the adapter, the field at fault, what the message must name). The wording of each is checked where it is
    # made: the file's (LoraError) in tests/test_lora_format.py, the request's in tests/test_request.py; the target
    # rule's here.
    cases = [
        ((misfit, 1.0, "transformer"), "loras[1]", "'misfit.safetensors'"),
        # This module's own wording (h3engine.engine.lora.adapters), once.
        (
            (ref_only, 1.0, "transformer"),
            "loras[1]",
            "targets 'transformer_ref', not 'transformer' (the partition",
        ),
        ((ref_only, 1.0), "loras[1].target", "'ref_only.safetensors' targets 'transformer_ref'"),
        ((not_lora, 1.0, "transformer"), "loras[1]", "'notes.safetensors'"),
        ((good, float("nan"), "transformer"), "loras[1].strength", None),
        ((good, 4.5, "transformer"), "loras[1].strength", None),
        ((good, 1.0, "vae"), "loras[1].target", None),
        ((good, 1.0, "transformer_ref"), "loras[1].target", None),
        ((tmp_path / "gone.safetensors", 1.0), "loras[1].path", None),
        ((tmp_path, 1.0), "loras[1].path", None),
    ]
    dit = engine.store.models_for_partition("fl2va").dit
    applied = applied_adapters(dit)
    for lora, field, named in cases:
        with refused(RequestError, field=field, names=(named,) if named else ()) as raised:
            generate(engine, (good, 0.5, "transformer"), lora)
        assert str(tmp_path) not in str(raised.value) and "\n" not in str(raised.value)
        assert applied_adapters(dit) is applied
    assert_equal(generate(engine, (good, 0.5, "transformer")), with_good)
    too_many = [(good, 0.1, "transformer")] * (MAX_LORAS + 1)
    with refused(RequestError, field="loras"):
        generate(engine, *too_many)


def test_a_request_runs_only_its_partitions_adapter(engine, base, tmp_path) -> None:
    """A `transformer_ref.` file goes to the Ref2VA DiT by its prefix (diffusers' default), an unprefixed one to
    the FL2VA DiT unless its target says transformer_ref; a request applies nothing to the other DiT."""
    ref_path, plain = tmp_path / "ref.safetensors", lora_file(tmp_path, engine, "original", 15)
    config = engine.store.dit_config("ref2va")
    write_lora(ref_path, small_lora(config, 15), "diffusers_ref", config)
    assert_equal(generate(engine), base)
    fl2va_dit = engine.store.models_for_partition("fl2va").dit
    reference = Reference("image", str(tmp_path / "unused.png"))
    ref2va = dataclasses.replace(REQUEST, task="ref2va", references=(reference,))
    for lora, layers in [
        (LoraChoice(str(ref_path)), "transformer_ref"),
        (LoraChoice(str(plain), 1, "transformer_ref"), None),
    ]:
        ref_dit = engine.models_for(dataclasses.replace(ref2va, loras=(lora,))).dit
        assert adapted_layers(ref_dit) == len(read_lora(lora.path).layers(layers)) > 0
        assert adapted_layers(fl2va_dit) == 0
    with refused(RequestError, field="loras[0].target") as caught:
        engine.models_for(dataclasses.replace(ref2va, loras=(LoraChoice(str(plain)),)))
    # The target rule's wording (made in h3engine.engine.lora.adapters): the file, its DiT and the way out.
    assert caught.value.problem.startswith("'original_15.safetensors' targets 'transformer' ")
    assert caught.value.problem.endswith("set target to transformer_ref"), caught.value


def test_the_sidecar_records_each_adapter(engine, tmp_path) -> None:
    path = lora_file(tmp_path, engine, "kohya", 16)
    request = dataclasses.replace(REQUEST, loras=(LoraChoice(str(path), 0.25),))
    files = engine.generate_to_file(request, tmp_path / "out.mp4")
    sidecar = json.loads(files.sidecar.read_text())
    record = {
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "strength": 0.25,
        "target": "transformer",
    }
    assert sidecar["adapters"] == [record]
    assert sidecar["request"]["loras"] == [{"path": str(path), "strength": 0.25, "target": None}]
    assert engine.record(REQUEST)["adapters"] == []


def test_fp8_linears_carry_the_update_beside_them(tmp_path) -> None:
    config = DiTConfig.tiny()
    state = random_native_state(config, 2468)
    path = tmp_path / "lora.safetensors"
    write_lora(path, small_lora(config, 17, shrink=0.1), "original", config)  # well beyond the FP8 noise
    adapter = Adapter(read_lora(path))
    request = tiny_fl2va_request(config, torch.float32, 2469)

    fused = tiny_dit(state)  # the reference: the dense update added to the fp32 weights
    with torch.no_grad():
        plain = fused(*request.as_h3_arguments())
        for module, layer in adapter.lora.layers().items():
            fused.get_submodule(module).weight += layer.delta()
        reference = fused(*request.as_h3_arguments())
    quantized = tiny_dit(state)
    quantize_dit_linears(quantized)
    apply_adapters(quantized, [adapter])
    block = quantized.blocks[0]
    hidden = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        assert isinstance(block.mlp.fc2, Fp8Linear)
        fc2_input = torch.randn(5, config.ffn_dim)
        expected = Fp8Linear.forward(block.mlp.fc2, fc2_input) + block.mlp.fc2.low_rank_update(fc2_input)
        assert torch.equal(block.mlp.fc2(fc2_input), expected)
        chunks = block.attn.qkv_proj.forward_chunks(hidden, 3)
        updates = block.attn.qkv_proj.low_rank_update.chunks(hidden, 3)
        for got, part, update in zip(block.attn._project_qkv(hidden), chunks, updates, strict=True):
            assert torch.equal(got, part + update)
        candidate = quantized(*request.as_h3_arguments())
    for reference_velocity, candidate_velocity, plain_velocity in zip(
        reference, candidate, plain, strict=True
    ):
        error = max_relative_error(candidate_velocity, reference_velocity)
        assert error < FP8_DIT_ERROR_BOUND
        assert max_relative_error(plain_velocity, reference_velocity) > 4 * error
    remove_adapters(quantized)
    never_adapted = tiny_dit(state)
    quantize_dit_linears(never_adapted)
    with torch.no_grad():
        pairs = zip(
            quantized(*request.as_h3_arguments()), never_adapted(*request.as_h3_arguments()), strict=True
        )
        assert all(torch.equal(restored, expected) for restored, expected in pairs)


def test_a_tensor_parallel_rank_holds_its_slice_of_the_factors(tmp_path) -> None:
    """Every update fits the rank's shard of its linear (tests/test_parallel_adapters.py checks the outputs)."""
    config = DiTConfig.tiny()
    path = tmp_path / "lora.safetensors"
    write_lora(path, small_lora(config, 18), "original", config)
    sharded = H3DiT(config, torch.float32, "meta")
    _apply_tensor_parallel(sharded, GroupMembership(None, 2, 1))
    lora = read_lora(path)
    assert apply_adapters(sharded, [Adapter(lora)], "cpu") == len(lora.layers()) == adapted_layers(sharded)
    for module in lora.layers():
        linear = sharded.get_submodule(module)
        update = linear.low_rank_update
        assert (update.up.shape[0], update.down.shape[1]) == tuple(linear.weight.shape), module


def test_a_lora_file_is_read_once_until_it_changes(engine, tmp_path, monkeypatch) -> None:
    path = lora_file(tmp_path, engine, "original", 19)
    reads: list[str] = []
    read_lora_once = adapters_module.read_lora
    monkeypatch.setattr(
        adapters_module, "read_lora", lambda p, **kw: reads.append(p) or read_lora_once(p, **kw)
    )
    request = dataclasses.replace(REQUEST, loras=(LoraChoice(str(path), 0.5),))
    dit = engine.models_for(request).dit
    applied = applied_adapters(dit)
    assert engine.models_for(dataclasses.replace(request)).dit is dit
    assert applied_adapters(dit) is applied  # the same file at the same strength: applied once
    assert len(reads) == 1
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    engine.models_for(request)
    assert len(reads) == 2 and applied_adapters(dit) is not applied  # a changed file is read again


def test_lora_files_keeps_the_last_files_it_read(engine, tmp_path) -> None:
    paths = [lora_file(tmp_path, engine, "kohya", 20 + index) for index in range(3)]
    files = LoraFiles(capacity=2)
    first = [files.read(path)[0] for path in paths]
    assert files.read(paths[2])[0] is first[2] and files.read(paths[1])[0] is first[1]
    assert files.read(paths[0])[0] is not first[0]  # evicted: read again
