"""Step caching (h3engine.engine.sampling.step_cache): the skip rule, its agreement with cache-dit, the DiT with and without it.

What is checked: the rule's warm-up, threshold and consecutive limit; that video and audio are judged apart (an
audio-only change prevents a skip the pooled rows would allow); that its decisions and differences equal cache-dit
1.5.3's DBCache on the same residual sequences; that a cache which never skips computes bit for bit what the plain
forward does (the split block chain is exact) and that "off" passes nothing new to the DiT; a streamed DiT with a
skipping cache against the resident one; two gloo Ulysses ranks taking the same decisions as one process; the
request field, its refusal with rungs, the SGLang shape's `quality`, the CLI flag and the sidecar record.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _lora_helpers import small_lora, write_lora
from _refusals import refused
from _step_cache_helpers import CONFIG, EAGER, FORWARDS, cached_forwards, random_dit, step_request, worker

from h3engine.checkpoint.lora_format import read_lora
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.lora.adapters import Adapter, apply_adapters
from h3engine.engine.resolved import _check_checkpoint_rules
from h3engine.engine.sampling import step_cache
from h3engine.engine.sampling.step_cache import (
    PRESETS,
    CachePreset,
    ReduceGroups,
    StepCache,
    StepDecisions,
    cache_preset,
    relative_differences,
)
from h3engine.errors import RequestError
from h3engine.memory.layers import dit_layers
from h3engine.memory.streaming import LayerStream
from h3engine.models.dit_layers import run_blocks
from h3engine.request.model import CACHE_PRESETS, GenerationRequest
from h3engine.request.shapes import from_dict
from h3engine.request.validate import validate
from ui.history import result_markdown, step_cache_line

RULE = CachePreset("rule", first_blocks=1, last_blocks=0, threshold=0.1, warmup_steps=2, max_consecutive=2)


# --- the rule -----------------------------------------------------------------------------------------------------


def decisions_for(preset: CachePreset, differences: list) -> list[int]:
    """The skipped steps when forward k's differences are differences[k] (asked only when eligible)."""
    rule = StepDecisions(preset)
    for value in differences:
        rule.decide(value if rule.eligible() else None)
    return rule.skipped_steps


def test_warm_up_threshold_and_consecutive_limit() -> None:
    small = (0.01, 0.01)
    assert decisions_for(RULE, [small] * 9) == [2, 3, 5, 6, 8]  # two in a row at most, then one computed
    unlimited = dataclasses.replace(RULE, max_consecutive=-1)
    assert decisions_for(unlimited, [small] * 6) == [2, 3, 4, 5]
    # At the threshold (not below), NaN, infinity, no differences at all: computed.
    for blocked in [(0.1, 0.01), (0.01, float("nan")), (float("inf"),), (), None]:
        assert decisions_for(RULE, [small, small, blocked, small]) == [3], blocked
    rule = StepDecisions(RULE)
    for value in [small] * 4:
        rule.decide(value if rule.eligible() else None)
    assert (rule.forwards, rule.computed, rule.skipped) == (4, 2, 2)


def test_an_audio_only_change_prevents_a_skip() -> None:
    """300 video rows unchanged, 20 audio rows changed by half: pooled, the change is 3 % (below 0.1); per modality
    the audio's 50 % blocks the skip. The same residuals without the audio change skip."""
    torch.manual_seed(0)
    reference = torch.randn(320, 8)
    video, audio = torch.arange(300), torch.arange(300, 320)
    changed = reference.clone()
    changed[audio] *= 1.5
    pooled = float((reference - changed).abs().sum() / reference.abs().sum())
    assert 0.0 < pooled < RULE.threshold
    differences = relative_differences(reference, changed, (video, audio), ReduceGroups())
    assert differences[0] == 0.0 and differences[1] == pytest.approx(0.5)
    for current, skipped in ((changed, []), (reference.clone(), [2])):
        rule = StepDecisions(RULE)
        for _ in range(3):  # two warm-up forwards, then the one that may skip
            eligible = rule.eligible()
            rule.decide(
                relative_differences(reference, current, (video, audio), ReduceGroups()) if eligible else None
            )
        assert rule.skipped_steps == skipped


def test_the_step_cache_skips_on_scripted_residuals(monkeypatch) -> None:
    """StepCache with stand-in blocks whose first-block residual is scripted: video rows 0-7 constant, audio rows
    8-9 doubled at forward 3 only (so forwards 3 and 4 differ from their reference); a skipped forward adds the
    middle residual saved at the last computed one."""
    audio_scale = {3: 2.0}
    forward = {"number": -1}

    def fake_blocks(blocks, modulations, hidden, layout):
        if not blocks:
            return hidden
        if blocks[0] == "first":
            forward["number"] += 1
            residual = torch.ones_like(hidden)
            residual[8:] *= audio_scale.get(forward["number"], 1.0)
            return hidden + residual
        return hidden + 10.0 * (forward["number"] + 1)  # the middle blocks: a residual that names the forward

    monkeypatch.setattr(step_cache, "run_blocks", fake_blocks)
    cache = StepCache(dataclasses.replace(RULE, max_consecutive=-1))
    cache.use_rows(torch.arange(8), torch.arange(8, 10))
    blocks, hidden = ["first", "middle"], torch.zeros(10, 4)
    outputs = [cache.run(blocks, [None, None], hidden, None) for _ in range(6)]
    assert cache.decisions.skipped_steps == [
        2,
        5,
    ]  # forwards 3 and 4: the audio rows moved, the video's did not
    assert [differences[0] for differences in cache.decisions.differences[2:]] == [0.0] * 4
    # Skipped forwards reuse the middle residual of the forward computed before them (forwards 1 and 4).
    assert [float(output[0, 0]) for output in outputs] == [11.0, 21.0, 21.0, 41.0, 51.0, 51.0]
    assert cache.record() == {"preset": "rule", "forwards": 6, "computed": 4, "skipped": 2}


def test_presets_name_the_requests_values_and_cite_the_peers() -> None:
    assert set(CACHE_PRESETS) == {"off", *PRESETS}
    assert cache_preset("off") is None
    # SGLang's MINIMAX_H3_HIGH_QUALITY_CACHE_DIT_CONFIG = (4, 0.04, 1) with Fn 1, Bn 0; vLLM-Omni's alike.
    high = cache_preset("high")
    assert (high.warmup_steps, high.threshold, high.max_consecutive, high.first_blocks, high.last_blocks) == (
        4,
        0.04,
        1,
        1,
        0,
    )
    assert cache_preset("fast").threshold > high.threshold
    with pytest.raises(ValueError, match="unknown step-cache preset"):
        cache_preset("medium")


# --- agreement with cache-dit -------------------------------------------------------------------------------------


def residual_sequence(drifts: list[float], seed: int) -> list[torch.Tensor]:
    """First-block residuals [64, 16] that drift by about drifts[k] (relative L1) from forward k-1 to k."""
    generator = torch.Generator().manual_seed(seed)
    residual = torch.randn(64, 16, generator=generator)
    sequence = [residual]
    for drift in drifts:
        step = torch.randn(64, 16, generator=generator)
        residual = residual + drift * step * residual.abs().mean() / step.abs().mean()
        sequence.append(residual)
    return sequence


def cache_dit_decisions(
    preset: CachePreset, residuals: list[torch.Tensor]
) -> tuple[list[int], dict[int, float]]:
    """cache-dit's DBCache rule on the residuals, called as its block pattern calls it after the Fn blocks."""
    from cache_dit import DBCacheConfig
    from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager

    manager = CachedContextManager(name="h3")
    config = DBCacheConfig(
        Fn_compute_blocks=preset.first_blocks,
        Bn_compute_blocks=preset.last_blocks,
        residual_diff_threshold=preset.threshold,
        max_warmup_steps=preset.warmup_steps,
        max_continuous_cached_steps=preset.max_consecutive,
        enable_separate_cfg=False,
    )
    manager.set_context(manager.new_context(name="h3", cache_config=config))
    skipped = []
    for step, residual in enumerate(residuals):
        manager.mark_step_begin()
        if manager.can_cache(residual, prefix="Fn_residual"):
            manager.add_cached_step()
            skipped.append(step)
        else:
            manager.set_Fn_buffer(residual, prefix="Fn_residual")
    differences = {int(step): value for step, value in manager.get_residual_diffs().items()}
    return skipped, differences


def our_decisions(preset: CachePreset, residuals: list[torch.Tensor]) -> tuple[list[int], dict[int, float]]:
    """Ours on the same residuals, all rows one group (cache-dit pools every row)."""
    rule, reference, rows = StepDecisions(preset), None, torch.arange(residuals[0].shape[0])
    for residual in residuals:
        differences = None
        if rule.eligible() and reference is not None:
            differences = relative_differences(reference, residual, (rows,), ReduceGroups())
        if not rule.decide(differences):
            reference = residual
    computed = {step: values[0] for step, values in enumerate(rule.differences) if values is not None}
    return rule.skipped_steps, computed


@pytest.mark.parametrize(
    "preset", [PRESETS["high"], PRESETS["fast"], dataclasses.replace(RULE, max_consecutive=-1)]
)
def test_decisions_equal_cache_dit_on_the_same_residuals(preset: CachePreset) -> None:
    pytest.importorskip("cache_dit", reason="cache-dit is in the dev extra (make test installs it)")
    drifts = [0.3, 0.2, 0.01, 0.02, 0.015, 0.05, 0.003, 0.2, 0.01, 0.06, 0.02, 0.002, 0.03, 0.15, 0.01, 0.01]
    residuals = residual_sequence(drifts, seed=3)
    ours, our_differences = our_decisions(preset, residuals)
    theirs, their_differences = cache_dit_decisions(preset, residuals)
    assert ours == theirs and ours and len(ours) < len(residuals) - preset.warmup_steps
    assert our_differences.keys() == their_differences.keys()
    for step, value in our_differences.items():
        assert value == pytest.approx(their_differences[step], rel=1e-5)
        assert abs(value - preset.threshold) > 1e-3  # no decision rests on rounding


# --- the DiT ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit():
    return random_dit()


@pytest.fixture(scope="module")
def plain(dit):
    return cached_forwards(dit, None)[0]


def identical(first, second) -> bool:
    return all(
        torch.equal(a, b)
        for pair_a, pair_b in zip(first, second, strict=True)
        for a, b in zip(pair_a, pair_b, strict=True)
    )


def test_a_cache_that_never_skips_computes_the_plain_forward_bit_for_bit(dit, plain) -> None:
    never = dataclasses.replace(EAGER, threshold=0.0)
    outputs, cache = cached_forwards(dit, never)
    assert identical(outputs, plain) and cache.decisions.skipped == 0
    with torch.inference_mode():
        arguments = step_request(0).as_h3_arguments()
        assert identical([dit(*arguments, blocks_runner=run_blocks)], [plain[0]])


def test_a_skipping_cache_stays_close_and_judges_audio_apart(dit, plain) -> None:
    outputs, cache = cached_forwards(dit, EAGER)
    decisions = cache.decisions
    assert decisions.skipped_steps == [1, 2, 4]
    for step, (ours, reference) in enumerate(zip(outputs, plain, strict=True)):
        same = identical([ours], [reference])
        assert same == (step not in decisions.skipped_steps)
        for a, b in zip(ours, reference, strict=True):
            assert float((a - b).norm() / b.norm()) < 0.05
    # Forward 5: the video's first-block residual moved less than the threshold, the audio's more, so it ran.
    video, audio = decisions.differences[5]
    assert video < EAGER.threshold <= audio and 5 not in decisions.skipped_steps
    assert cache.record() == {"preset": "eager", "forwards": FORWARDS, "computed": 5, "skipped": 3}


def test_a_streamed_dit_with_a_skipping_cache_computes_what_the_resident_one_does(dit) -> None:
    resident, resident_cache = cached_forwards(dit, EAGER)
    streamed = random_dit()
    stream = LayerStream(dit_layers(streamed), 0, "cpu", 2)
    outputs, cache = cached_forwards(streamed, EAGER)
    assert identical(outputs, resident)
    assert cache.decisions.skipped_steps == resident_cache.decisions.skipped_steps
    # A skip leaves the ring's cyclic order: the next forward's first layer restarts it (counted, not an error).
    skipped = cache.decisions.skipped_steps
    assert stream.restarts == len([step for step in skipped if step < FORWARDS - 1])
    layers = 1 + CONFIG.num_layers  # the refiner block streams too
    middle = CONFIG.num_layers - EAGER.first_blocks - EAGER.last_blocks
    assert stream.visits == FORWARDS * layers - len(skipped) * middle


def test_a_lora_runs_under_the_cache(dit, plain, tmp_path) -> None:
    """The adapters sit on the linears the cache's blocks call: never skipping is the adapted forward bit for bit,
    a skipping cache computes the adapted forward on the forwards it runs."""
    path = tmp_path / "lora.safetensors"
    write_lora(path, small_lora(CONFIG, seed=1), "original", CONFIG)
    adapted = random_dit()
    apply_adapters(adapted, [Adapter(read_lora(path, head_dim=CONFIG.head_dim))], "cpu")
    reference, _ = cached_forwards(adapted, None)
    assert not identical(reference[:1], plain[:1])  # the adapter changes the output
    never, _ = cached_forwards(adapted, dataclasses.replace(EAGER, threshold=0.0))
    assert identical(never, reference)
    outputs, cache = cached_forwards(adapted, EAGER)
    computed = [step for step in range(FORWARDS) if step not in cache.decisions.skipped_steps]
    assert cache.decisions.skipped and identical(
        [outputs[s] for s in computed], [reference[s] for s in computed]
    )


def test_two_ulysses_ranks_take_the_same_decisions_as_one_process(tmp_path, dit) -> None:
    single, single_cache = cached_forwards(dit, EAGER)
    mp.spawn(worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == single_cache.decisions.skipped_steps
    assert ranks[0]["differences"] == ranks[1]["differences"]
    for ours, theirs in zip(ranks[0]["differences"], single_cache.decisions.differences, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert ours == pytest.approx(theirs, rel=1e-4)
    for rank in ranks:
        for (video, audio), (single_video, single_audio) in zip(rank["outputs"], single, strict=True):
            torch.testing.assert_close(video, single_video, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(audio, single_audio, rtol=1e-4, atol=1e-4)


# --- the request, the CLI, the engine -----------------------------------------------------------------------------


def test_the_request_field_is_checked_everywhere() -> None:
    request = GenerationRequest(task="t2va", prompt="A kite.")
    assert request.cache == "off" and request.to_dict()["cache"] == "off"
    high = dataclasses.replace(request, cache="high")
    assert from_dict(high.to_dict()) == high and validate(high) == []
    for bad in ("medium", "HIGH", 1, None):
        with refused(RequestError, field="cache", says="must be one of off, high, fast"):
            validate(dataclasses.replace(request, cache=bad))
    turbo = dataclasses.replace(high, rungs=(999, 500), steps=2)
    # Two rules on cache: an unknown value, and a value for full-step runs with rungs (a fragment tells which).
    with refused(RequestError, field="cache", says="'high' is for full-step runs"):
        validate(turbo)
    validate(dataclasses.replace(turbo, cache="off"))
    # A step-distilled checkpoint's own rungs: refused by its rules too.
    facts = types.SimpleNamespace(tasks=("t2va",), dmd_steps={"t2va": (999, 500)}, lora_targets={})
    with refused(RequestError, field="cache", says="'fast' is for full-step runs"):
        _check_checkpoint_rules(dataclasses.replace(request, cache="fast", steps=2), facts)
    # SGLang's request-scoped quality: lossless -> off, high -> high.
    sglang = {"task": "t2va", "prompt": "A kite.", "target": {"duration_seconds": 5}}
    assert from_dict(sglang).cache == "off"
    assert from_dict({**sglang, "quality": "high"}).cache == "high"
    with refused(RequestError, field="quality", says="must be one of lossless, high"):
        from_dict({**sglang, "quality": "fast"})


def test_the_cli_flag_is_the_field(tiny_native: Path, tmp_path: Path, capsys) -> None:
    """Refused by the request checker before any model loads, named as the field."""
    arguments = [
        "generate",
        "--checkpoint",
        str(tiny_native),
        "--prompt",
        "A kite.",
        "--out",
        str(tmp_path / "o.mp4"),
    ]
    assert main([*arguments, "--cache", "medium"]) == 2
    assert "error: cache: must be one of off, high, fast, got 'medium'" in capsys.readouterr().err
    assert main([*arguments, "--cache", "high", "--rungs", "999,500"]) == 2
    assert "error: cache: 'high' is for full-step runs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_engine_records_the_preset_and_off_passes_nothing_new(tiny_native: Path, tmp_path: Path) -> None:
    engine = Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)
    dit = engine.store.models_for_task("t2va").dit
    seen: list[set[str]] = []
    hook = dit.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(set(kwargs)), with_kwargs=True
    )
    base = GenerationRequest(task="t2va", prompt="A kite.", steps=6, duration_seconds=4.0)
    sidecars = {}
    try:
        for cache in ("off", "high"):
            files = engine.generate_to_file(dataclasses.replace(base, cache=cache), tmp_path / f"{cache}.mp4")
            sidecars[cache] = json.loads(files.sidecar.read_text(encoding="utf-8"))
    finally:
        hook.remove()
    assert seen[:6] == [{"layout", "modulation"}] * 6  # "off": the call it always was
    assert seen[6:] == [{"layout", "modulation", "blocks_runner"}] * 6
    assert "step_cache" not in sidecars["off"] and sidecars["off"]["request"]["cache"] == "off"
    record = sidecars["high"]["step_cache"]
    assert sidecars["high"]["request"]["cache"] == "high"
    assert record["preset"] == "high" and record["forwards"] == 6 == record["computed"] + record["skipped"]
    # The app and History show it in words.
    line = step_cache_line(record)
    assert (
        line == f"**Step cache** high: computed {record['computed']} of 6 steps ({record['skipped']} skipped)"
    )
    assert line in result_markdown(1, 64, 32, 107, 24, {"denoise_s": 1.0}, record)
    assert step_cache_line(None) is None and step_cache_line({"preset": "high"}) is None


def test_the_memory_check_counts_the_cached_residuals(tiny_native: Path) -> None:
    """Four [S, H] rows of the compute dtype on the denoise phase's working memory, only with a cache."""
    from h3engine.memory.shapes import partition_for_task, request_shape
    from h3engine.memory.sizes import checkpoint_sizes
    from h3engine.memory.working import phase_working

    sizes = checkpoint_sizes(tiny_native)
    partition = partition_for_task(sizes, "t2va")
    off = request_shape(sizes, "t2va", duration_seconds=5, text_tokens=16)
    cached = request_shape(sizes, "t2va", duration_seconds=5, text_tokens=16, step_cache=True)
    working = {
        shape.step_cache: phase_working(partition, shape, sizes.share, "bf16", "cuda")
        for shape in (off, cached)
    }
    added = 4 * off.sequence_rows * partition.dit_config.hidden_size * partition.dtype_bytes
    assert working[True]["denoise"] - working[False]["denoise"] == pytest.approx(added * 1.2, abs=2)
    assert working[True]["decode"] == working[False]["decode"]


def test_the_app_takes_the_preset_as_an_endpoint_parameter() -> None:
    from ui.tabs import CACHE_LABELS, DEFAULT_VALUES
    from ui.task_values import TaskValues, build_request, failing_parameter, parameter_names, request_values

    assert parameter_names("t2va")[-1] == "cache" and DEFAULT_VALUES["cache"] == "off"
    assert set(CACHE_LABELS) == set(CACHE_PRESETS)
    values = {**DEFAULT_VALUES, "prompt": "A kite.", "cache": "fast"}
    inputs = TaskValues.from_inputs("t2va", [values[name] for name in parameter_names("t2va")])
    request = build_request(inputs)
    assert request.cache == "fast" and request_values(request, keep=str)["cache"] == "fast"
    problem = RequestError("cache", "'fast' is for full-step runs")
    assert failing_parameter(problem, inputs) == "cache"
