"""The read rate of a checkpoint's disk (h3engine.memory.disk): given, measured once past the page cache and kept in
the cache folder, or the default where nothing can be measured (a placeholder's holes, a filesystem without
O_DIRECT). How it breaks: a rate measured again at every start costs a read each time (the second call here would
call the measurement, which raises); a placeholder measured would report the speed of reading holes."""

from __future__ import annotations

import json
import os

from _refusals import refused

from h3engine.checkpoint.placeholder import make_placeholder_checkpoint
from h3engine.errors import RequestError
from h3engine.memory import disk
from h3engine.memory.cost import DEFAULT_DISK_BYTES_PER_SECOND


def test_a_given_rate_wins_and_bad_ones_are_refused_naming_the_flag() -> None:
    assert disk.parse_gbps("1.9") == 1.9e9
    assert disk.disk_read_rate("/nonexistent", None, 3e9) == (3e9, "--disk-read-gbps")
    for text in ("0", "-1", "fast", "nan", "inf"):
        with refused(RequestError, field="--disk-read-gbps"):
            disk.parse_gbps(text)


def test_a_placeholder_is_not_measured(tmp_path) -> None:
    folder = make_placeholder_checkpoint(tmp_path / "placeholder", tiny=True)
    rate, source = disk.disk_read_rate(folder, tmp_path / "cache")
    assert rate == DEFAULT_DISK_BYTES_PER_SECOND and source.startswith("default (no weight bytes")
    assert not (tmp_path / "cache").exists()


def test_a_measured_rate_is_kept_per_disk_and_read_back(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(2 * disk.MEASURE_CHUNK_BYTES))
    monkeypatch.setattr(disk, "measure_read_rate", lambda path, limit=disk.MEASURE_BYTES: 1.25e9)
    assert disk.disk_read_rate(folder, tmp_path / "cache") == (1.25e9, "measured now on model.safetensors")
    kept = json.loads((tmp_path / "cache" / disk.RATES_FILE).read_text())
    assert kept == {str(os.stat(folder / "model.safetensors").st_dev): 1.25e9}

    def never(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(disk, "measure_read_rate", never)
    rate, source = disk.disk_read_rate(folder, tmp_path / "cache")
    assert rate == 1.25e9 and source.startswith("measured earlier")


def test_the_measurement_reads_the_file_or_says_it_cannot(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(2 * disk.MEASURE_CHUNK_BYTES))
    rate = disk.measure_read_rate(path)
    assert rate is None or rate > 0  # None where the filesystem refuses O_DIRECT (tmpfs)
    small = tmp_path / "small.safetensors"
    small.write_bytes(b"x" * 1024)
    assert disk.measure_read_rate(small) is None
