"""`make-placeholder-checkpoint --weights int8|fp8_scaled` (h3engine.checkpoint.single_file_placeholder): each DiT a
community single safetensors file whose data is a hole, listed in gguf_files.json.

Oracles: `convert --weights int8` on a checkpoint of the same shapes writes the same header (keys, dtypes, shapes,
offsets, configs; the metadata aside), so the placeholder plans as the converted file would; the file's length is
its header and the data the header promises; the reader and the planner see the same placeholder flag a GGUF
placeholder raises. The tiny DiT's rows are 8 to 32 wide (no whole ConvRot group of 256): the header comparison is
also made on a DiT of 256- and 512-wide linears (WIDE), where layers are quantized.

How it breaks: a config tensor left in the hole (zeros: the reader refuses the file), the placeholder flag not read
from a single file, a format chosen otherwise than the converter's, a stored order not safetensors', a file whose
data was written (not sparse), `--pruned-adaln` ignored.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3engine.checkpoint import dit_format
from h3engine.checkpoint.dit_keys import random_native_state
from h3engine.checkpoint.layout import DIT_FILES_JSON, detect_layout
from h3engine.checkpoint.loader import dit_source, read_dit_config
from h3engine.checkpoint.placeholder import PRUNED_RANK, PRUNED_TABLE_ROWS, make_placeholder_checkpoint
from h3engine.checkpoint.safetensors_io import read_raw_header
from h3engine.checkpoint.single_file_placeholder import write_single_file_placeholder
from h3engine.checkpoint.single_files import SingleFile
from h3engine.cli.main import main
from h3engine.models.dit_config import DiTConfig
from h3engine.models.stored_linear import StoredLinear

GIB = 1 << 30
# A DiT of 256- and 512-wide linears (fc2 288 wide, condition_proj 8): the sizes tests/test_int8_convert.py uses.
WIDE = {"hidden_size": 512, "num_heads": 2, "head_dim": 128, "ffn_dim": 288, "time_embed_dim": 256}
NAMES = {
    "int8": "fl2va-dit-int8_convrot.safetensors",
    "fp8_scaled": "fl2va-dit-fp8_e4m3_scaled.safetensors",
    "nvfp4": "fl2va-dit-nvfp4.safetensors",
}


def records(path: Path) -> list[tuple[str, object]]:
    """The header's tensor records in stored order (`__metadata__` aside)."""
    header, _, _ = read_raw_header(path)
    return [(key, entry) for key, entry in header.items() if key != "__metadata__"]


def data_end(path: Path) -> int:
    """Where the data the header promises ends: the header's length plus the last tensor's end."""
    _, base, _ = read_raw_header(path)
    return base + max(entry["data_offsets"][1] for _, entry in records(path))


def plan(folder: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    flags = ["--gpu-memory", "24", "--host-memory", "64", "--json"]
    assert main(["plan-memory", "--checkpoint", str(folder), *flags]) == 0
    return json.loads(capsys.readouterr().out)


def planned_dit_bytes(report: dict) -> int:
    """The bytes the plan gives the served DiT (its layers, other tensors and AdaLN projections)."""
    return sum(c["bytes"] for c in report["components"] if c["name"].split(".")[0] == "dit")


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "pruned"])
@pytest.mark.parametrize("weights", ["int8", "fp8_scaled", "nvfp4"])
def test_a_tiny_single_file_placeholder_loads_plans_and_checks(tmp_path, capsys, weights, pruned) -> None:
    extra = ["--pruned-adaln"] if pruned else []
    folder = tmp_path / "placeholder"
    assert main(["make-placeholder-checkpoint", str(folder), "--tiny", "--weights", weights, *extra]) == 0
    listed = json.loads((folder / DIT_FILES_JSON).read_text())
    assert listed == {p: NAMES[weights].replace("fl2va", p) for p in ("fl2va", "ref2va")}
    path = folder / listed["fl2va"]
    assert path.stat().st_size == data_end(path)  # the header and a hole of the data's length
    single = SingleFile.open(path)  # the configs were written: a hole would make them unreadable zeros
    assert single.placeholder and single.metadata["h3.placeholder"] == "hole"
    if weights == "fp8_scaled":
        assert single.formats()["fp8_e4m3_scaled"] > 0
        assert single.records["blocks.0.mlp.fc1.weight"].config == {"format": "float8_e4m3fn"}
    if weights == "nvfp4":
        assert single.formats()["nvfp4"] > 0
        assert single.records["blocks.0.mlp.fc1.weight"].config == {"format": "nvfp4"}
    layout = detect_layout(folder)
    paths = layout.partitions["fl2va"]
    assert paths.dit_weights == path
    source = dit_source(layout, paths, torch.bfloat16)
    assert source.files.placeholder  # as DiTFileWeights.is_placeholder is for a GGUF placeholder
    table = source.files.logical_shapes.get("adaln_t_table")
    assert table == ((PRUNED_TABLE_ROWS, PRUNED_RANK) if pruned else None)
    stored = planned_dit_bytes(plan(folder, capsys))
    bf16 = tmp_path / "bf16"
    make_placeholder_checkpoint(bf16, tiny=True, pruned_adaln=pruned)
    # Smaller than bf16's (the tiny int8 file's linears are INT8 per row: no whole 256-column group to rotate).
    bf16_bytes = planned_dit_bytes(plan(bf16, capsys))
    assert stored < bf16_bytes
    assert main(["check-checkpoint", str(folder), "--deep"]) == 0
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("fl2va") and " dit " in line
    )
    assert "ok (" in row and "placeholder" in row


def test_an_engine_loads_a_tiny_fp8_scaled_placeholder(tmp_path) -> None:
    from h3engine.engine.engine import Engine

    folder = make_placeholder_checkpoint(tmp_path / "p", tiny=True, weights="fp8_scaled")
    engine = Engine.from_checkpoint(folder, device="cpu", adaln_cache="off")
    dit = engine.store.models_for_task("t2va").dit
    assert any(isinstance(module, StoredLinear) for module in dit.modules())
    assert engine.store.placeholder and engine.record()["weights"] == "placeholder"


def test_the_int8_placeholder_header_is_the_converters(tiny_checkpoints, tmp_path) -> None:
    """On the tiny checkpoint (seed 3) and on a DiT of 256- and 512-wide linears: `convert --weights int8`'s file and
    the placeholder's hold the same records in the same order, and the same layer configs."""
    checkpoint = tiny_checkpoints("native", seed=3)
    converted = tmp_path / "converted"
    assert (
        main(["convert", "--checkpoint", str(checkpoint), "--weights", "int8", "--out", str(converted)]) == 0
    )
    placeholder = tmp_path / "placeholder"
    assert (
        main(["make-placeholder-checkpoint", str(placeholder), "--tiny", "--seed", "3", "--weights", "int8"])
        == 0
    )
    for name in NAMES["int8"], NAMES["int8"].replace("fl2va", "ref2va"):
        assert records(placeholder / name) == records(converted / name)

    wide = tmp_path / "wide"
    shutil.copytree(checkpoint, wide)
    config = dataclasses.replace(DiTConfig.tiny(), **WIDE)
    folder = wide / "FL2VA" / "transformer"
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dit_format.config_to_native(config)))
    save_file(
        random_native_state(config, seed=3), str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    wide_out = tmp_path / "wide_converted"
    assert main(["convert", "--checkpoint", str(wide), "--weights", "int8", "--out", str(wide_out)]) == 0
    path = tmp_path / "wide_placeholder.safetensors"
    write_single_file_placeholder(
        path, read_dit_config(detect_layout(wide), detect_layout(wide).partitions["fl2va"]), "int8"
    )
    assert records(path) == records(wide_out / NAMES["int8"])
    ours, theirs = SingleFile.open(path), SingleFile.open(wide_out / NAMES["int8"])
    assert ours.formats() == theirs.formats() and ours.formats()["int8_convrot"] > 0
    assert {k: r.config for k, r in ours.records.items()} == {k: r.config for k, r in theirs.records.items()}
    assert ours.placeholder and not theirs.placeholder


def test_real_bytes_of_a_hole_dit_is_refused(tmp_path, capsys) -> None:
    folder = tmp_path / "p"
    assert main(["make-placeholder-checkpoint", str(folder), "--weights", "int8", "--real-bytes", "dit"]) == 2
    assert "--real-bytes" in capsys.readouterr().err
    assert not folder.exists()


@pytest.mark.parametrize("pruned", [True, False], ids=["pruned", "full"])
def test_a_released_size_int8_placeholder_is_sparse_and_plans(tmp_path, capsys, pruned) -> None:
    """One partition at the released shapes, written in seconds as a hole. Published sizes (Comfy-Org's files, from
    ../shared/docs/CONSUMER_HARDWARE.md §1.1): INT8 ConvRot 19.53 GiB pruned, 31.70 GiB not pruned. Ours (measured
    18.79 / 30.93 GiB) is what `convert --weights int8` writes, within 4 % of each: linears of whole 256-column
    groups in INT8 ConvRot, the others (the exact AdaLN projections' 2688 columns) in INT8 per row."""
    folder = tmp_path / "released"
    extra = ["--pruned-adaln"] if pruned else []
    try:
        start = time.monotonic()
        flags = ["--weights", "int8", "--partitions", "fl2va", *extra]
        assert main(["make-placeholder-checkpoint", str(folder), *flags]) == 0
        seconds = time.monotonic() - start
        path = folder / NAMES["int8"]
        size, on_disk = path.stat().st_size, path.stat().st_blocks * 512
        form = "pruned" if pruned else "full"
        with capsys.disabled():
            print(
                f"\nint8 {form}: {size / GIB:.2f} GiB, {on_disk / 2**20:.1f} MiB on disk, made in {seconds:.1f} s"
            )
        assert size == data_end(path) and seconds < 60
        assert on_disk < 64 << 20  # a hole (the header is ~100 kB; file systems may allocate some blocks)
        published = 19.53 if pruned else 31.70
        assert abs(size / GIB - published) < 0.05 * published
        report = plan(folder, capsys)
        stored = planned_dit_bytes(report)
        assert abs(stored - size) < 0.01 * size  # the file's bytes, header aside
        bf16 = make_placeholder_checkpoint(tmp_path / "bf16", partitions=["fl2va"], pruned_adaln=pruned)
        assert stored < 0.75 * planned_dit_bytes(plan(bf16, capsys))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(tmp_path / "bf16", ignore_errors=True)


def test_a_released_size_pruned_nvfp4_placeholder_sits_between_its_bounds(tmp_path) -> None:
    """One pruned partition at the released shapes in NVFP4: at least every weight of the bf16 pruned DiT (37.46 GiB,
    ../shared/docs/CONSUMER_HARDWARE.md §1.1) at NVFP4's 4.5 bits (e2m1 + one e4m3 scale per 16), at most the smallest
    published pruned NVFP4 file (11.67 GiB; the published ones keep more layers in higher precision)."""
    folder = tmp_path / "released"
    try:
        flags = ["--weights", "nvfp4", "--partitions", "fl2va", "--pruned-adaln"]
        assert main(["make-placeholder-checkpoint", str(folder), *flags]) == 0
        size = (folder / NAMES["nvfp4"]).stat().st_size / GIB
        assert 37.46 * 4.5 / 16 <= size <= 11.67
    finally:
        shutil.rmtree(folder, ignore_errors=True)
