"""AdaLN tables on disk (h3engine.engine.sampling.adaln_tables): exact, keyed by what they depend on, bounded, robust.

What is compared: a tiny engine's generations with the cache off, with tables computed into an empty cache and with
tables read back from it (a new engine, so that no table stays in memory): bit for bit, because stored tables are the
computed bits. A request whose steps are all cached must not read an AdaLN projection: shown by a DiT whose
projections hold NaN giving the same output. Adapters on AdaLN (and their strengths) key their own tables; a cache
past its bound drops its least recently used files; a truncated file is computed again, with a warning. How each
breaks: a key without the adapters would hand the base model's tables to an adapted DiT (its output would differ from
the uncached one); NaN projections read on a hit would turn the video into NaN.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from _lora_helpers import small_lora, write_lora
from _runtime_helpers import parity_requests

from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.sampling.adaln_tables import AdalnTableCache, StepTables, TableKey, device_identity
from h3engine.engine.sampling.modulation import build_modulation, schedule_modulation, stored_tables
from h3engine.request.model import LoraChoice

OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=3)


@pytest.fixture(scope="module")
def uncached(checkpoint) -> Engine:
    return Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")


def generate(engine: Engine, request):
    output, _ = engine.generate(request)
    return output


def assert_same(got, expected) -> None:
    for name in OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def adaln_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("*.safetensors"))


@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_cached_tables_are_the_computed_bits_and_a_hit_reads_no_projection(
    checkpoint, uncached, tmp_path, task
) -> None:
    request = parity_requests(steps=3, seed=4)[task]
    expected = generate(uncached, request)
    folder = tmp_path / "tables"
    first = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
    assert_same(generate(first, request), expected)
    assert len(adaln_files(folder)) == 3  # one file per step
    # A new engine has nothing in memory: every table comes from the files, and no projection is read.
    second = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
    dit = second.store.models_for_task(task).dit
    for projection in [block.adaln_proj for block in dit.blocks] + [dit.final_layer.adaln_proj]:
        projection.linear.weight.data.fill_(float("nan"))
        projection.linear.bias.data.fill_(float("nan"))
    assert_same(generate(second, request), expected)


def test_the_sidecar_says_where_the_tables_came_from(checkpoint, tmp_path) -> None:
    request = dataclasses.replace(parity_requests(steps=2, seed=4)["t2va"], seed=11)
    folder = tmp_path / "tables"
    sidecars = []
    for run in range(2):
        engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
        files = engine.generate_to_file(request, tmp_path / f"run{run}.mp4")
        sidecars.append(json.loads(files.sidecar.read_text()))
    assert [sidecar["adaln_tables"] for sidecar in sidecars] == ["computed", "cache"]
    assert "adaln_tables_computed_s" in sidecars[0]["timings_s"]
    assert "adaln_tables_cached_s" in sidecars[1]["timings_s"]


def test_a_new_schedule_computes_only_the_steps_it_lacks(checkpoint, tmp_path, caplog) -> None:
    """Steps are cached one by one: a longer grid shares no step with a shorter one (its timesteps differ), but the
    same grid at another seed shares all of them."""
    folder = tmp_path / "tables"
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
    dit = engine.store.models_for_task("t2va").dit
    steps = [torch.tensor([0.25, 0.5]), torch.tensor([0.5, 0.75]), torch.tensor([0.75, 0.75])]
    with caplog.at_level(logging.INFO, logger="h3engine.engine.sampling.modulation"):
        first = schedule_modulation(dit, steps[:2], torch.device("cpu"))
        first.persist()
        assert first.source == "computed" and len(adaln_files(folder)) == 2
        second = schedule_modulation(dit, steps, torch.device("cpu"))
    assert second.source == "computed"
    assert "1 of 3 steps computed, 2 read from" in caplog.text
    for got, expected in zip(second, build_modulation(dit, steps), strict=True):
        assert torch.equal(stored_tables(got).blocks, stored_tables(expected).blocks)
        assert torch.equal(stored_tables(got).final, stored_tables(expected).final)


def test_adapters_on_adaln_and_their_strengths_key_their_own_tables(checkpoint, uncached, tmp_path) -> None:
    config = uncached.store.dit_config(uncached.store.partition_for("t2va"))
    lora_folder = tmp_path / "loras"
    lora_folder.mkdir()
    adaln_lora, blocks_lora = lora_folder / "adaln.safetensors", lora_folder / "blocks.safetensors"
    write_lora(adaln_lora, small_lora(config, 5, only="adaln_proj", shrink=0.5), "diffusers", config)
    write_lora(blocks_lora, small_lora(config, 6, only="mlp"), "diffusers", config)
    base = parity_requests(steps=2, seed=8)["t2va"]
    folder = tmp_path / "tables"
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
    variants = {
        "base": base,
        "adaln 1.0": dataclasses.replace(base, loras=(LoraChoice(str(adaln_lora), 1.0),)),
        "adaln 0.5": dataclasses.replace(base, loras=(LoraChoice(str(adaln_lora), 0.5),)),
        "blocks": dataclasses.replace(base, loras=(LoraChoice(str(blocks_lora), 1.0),)),
    }
    counts = {}
    for name, request in variants.items():
        assert_same(generate(engine, request), generate(uncached, request))
        counts[name] = len(adaln_files(folder))
    # Two steps each; the adapter that leaves AdaLN alone shares the base model's tables.
    assert counts == {"base": 2, "adaln 1.0": 4, "adaln 0.5": 6, "blocks": 6}
    # Read back in another order, each from its own files.
    for name in ("adaln 0.5", "base", "adaln 1.0"):
        fresh = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
        assert_same(generate(fresh, variants[name]), generate(uncached, variants[name]))
    assert len(adaln_files(folder)) == 6


def _tables(value: float, size: int) -> StepTables:
    return StepTables(torch.full((size,), float(value)), torch.full((2,), float(value)))


def test_the_cache_drops_its_least_recently_used_files_past_its_bound(tmp_path) -> None:
    cache = AdalnTableCache(tmp_path, max_bytes=10_000)
    for index in range(4):
        cache.store(f"step{index}", f"d{index}", _tables(index, 500))  # ~2.1 kB each
        os.utime(cache.path(f"step{index}"), ns=(index * 10**9, index * 10**9))
    assert cache.load("step0", "d0") is not None  # now the most recently used
    for index in range(4, 7):
        cache.store(f"step{index}", f"d{index}", _tables(index, 500))
    names = {path.stem for path in cache.files()}
    assert cache.size_bytes() <= 10_000
    assert "step0" in names and "step1" not in names and "step6" in names
    # A file whose metadata does not match what its name stands for is never handed out.
    assert cache.load("step6", "something else") is None and not cache.path("step6").exists()


def test_a_truncated_file_is_computed_again_with_a_warning(checkpoint, uncached, tmp_path, caplog) -> None:
    request = dataclasses.replace(parity_requests(steps=2, seed=4)["t2va"], seed=21)
    folder = tmp_path / "tables"
    generate(Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder)), request)
    broken = adaln_files(folder)[0]
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="h3engine.engine.sampling.adaln_tables"):
        engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache=str(folder))
        assert_same(generate(engine, request), generate(uncached, request))
    assert f"AdaLN table file {broken} is unreadable" in caplog.text
    assert broken.stat().st_size > 0 and len(adaln_files(folder)) == 2
    assert AdalnTableCache(folder).load(broken.stem, _description_of(broken)) is not None


def _description_of(path: Path) -> str:
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return header["__metadata__"]["h3_adaln_tables"]


def test_the_key_names_the_model_adapters_device_and_exact_timesteps() -> None:
    key = TableKey("model", "", device_identity(torch.device("cpu")))
    timesteps = torch.tensor([0.5, 0.25])
    names = {
        key.step_name(timesteps),
        dataclasses.replace(key, model="other").step_name(timesteps),
        dataclasses.replace(key, adapters="lora").step_name(timesteps),
        dataclasses.replace(key, device="cuda:H100").step_name(timesteps),
        key.step_name(torch.tensor([0.25, 0.5])),
        key.step_name(torch.nextafter(timesteps, torch.ones(2))),
    }
    assert len(names) == 6
    assert key.step_name(timesteps.double()) == key.step_name(timesteps)
    assert "torch" in key.device and "cpu" in key.device


def test_stored_tables_are_the_computed_tables(uncached) -> None:
    dit = uncached.store.models_for_task("t2va").dit
    step = build_modulation(dit, [torch.tensor([0.3, 0.9])])[0]
    stored = stored_tables(step)
    assert stored.blocks.shape == (dit.config.num_layers, 6, 2 * 3, dit.config.hidden_size)
    assert torch.equal(stored.blocks[1, 2], step.blocks[1].gate_attn)
    assert torch.equal(stored.final[1], step.final[1])


def test_off_keeps_nothing_and_an_unwritable_folder_is_refused_naming_the_flag(
    checkpoint, tmp_path, capsys
) -> None:
    engine = Engine.from_checkpoint(checkpoint, device="cpu", adaln_cache="off")
    assert engine.store.adaln_cache is None
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    code = main(
        [
            "generate",
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "a kite",
            "--out",
            str(tmp_path / "out.mp4"),
            "--adaln-cache",
            str(blocked / "tables"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --adaln-cache: cannot write to"), err
    assert not (tmp_path / "out.mp4").exists()
