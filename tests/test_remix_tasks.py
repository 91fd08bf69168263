"""Remix tasks on the tiny checkpoint: v2a keeps the source's frames, a2v its audio, extend continues the clip;
the checker refuses bad remixes naming the field, probing each file once; the CLI exits 2 with one line."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from _refusals import cli_refused, refused
from _remix_helpers import (
    RATE,
    SOURCE_FRAMES,
    decoded_audio,
    decoded_frames,
    every_mode,
    remix_request,
    write_sources,
)
from safetensors.torch import load_file

from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import run_generation
from h3engine.engine.resolved import resolve_request
from h3engine.engine.sampling.hold import video_range_mask
from h3engine.engine.sampling.packing import audio_latents_to_rows, patchify_video
from h3engine.errors import RequestError
from h3engine.request.files import MediaFacts, MediaInfo
from h3engine.request.geometry import FPS, Geometry, frames_for_duration
from h3engine.request.model import GenerationRequest
from h3engine.request.remix import Remix

GRID_FRAMES = 107


@pytest.fixture(scope="module")
def engine(tiny_native: Path) -> Engine:
    return Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_sources(tmp_path_factory.mktemp("remix_sources"))


def run(engine: Engine, request: GenerationRequest, mp4: Path):  # noqa: ANN201
    prepared = engine.prepare(request)
    with torch.inference_mode():
        output = run_generation(engine.models_for(request), prepared, engine.device, mp4_path=mp4)
    return prepared, output


def test_v2a_copies_the_source_frames_and_generates_new_audio(
    engine: Engine, sources, tmp_path: Path
) -> None:
    request = remix_request(Remix(mode="v2a", source_video=str(sources["video"])))
    resolved = engine.resolve(request)
    assert resolved.geometry.frames == GRID_FRAMES
    assert any("trimmed to 4.458 s (107 frames" in warning for warning in resolved.warnings)
    files = engine.generate_to_file(resolved, tmp_path / "v2a.mp4")
    source, output = decoded_frames(sources["video"]), decoded_frames(files.video)
    assert len(output) == GRID_FRAMES
    for index in range(GRID_FRAMES):
        assert np.array_equal(output[index], source[index]), index
    # The audio is new: not the source's soundtrack.
    new_audio, old_audio = decoded_audio(files.video), decoded_audio(sources["video"])
    length = min(new_audio.shape[1], old_audio.shape[1])
    assert np.abs(new_audio[:, :length] - old_audio[:, :length]).mean() > 0.05
    assert '"field": "remix.source_video"' in files.sidecar.read_text()


def test_a2v_holds_the_source_audio_over_its_span_and_generates_video(
    engine: Engine, sources, tmp_path: Path
) -> None:
    request = remix_request(Remix(mode="a2v", source_audio=str(sources["audio"])))
    prepared, output = run(engine, request, tmp_path / "a2v.mp4")
    held = prepared.held
    covered = int((held.audio_mask[: prepared.geometry.audio_latents] == 0).sum())
    assert covered == 100  # 2.5 s at 40 latents/s; the rest generated
    rows = audio_latents_to_rows(output.audio_latents)
    assert torch.equal(rows[held.audio_mask == 0], held.audio_clean[held.audio_mask == 0])
    assert held.video_mask is None
    # The file keeps the source waveform over the span it covers (within AAC's tolerance).
    with wave.open(str(sources["audio"])) as file:
        source = np.frombuffer(file.readframes(file.getnframes()), np.int16).reshape(-1, 2).T / 32767
    written = decoded_audio(tmp_path / "a2v.mp4")
    span = slice(4000, 76000)  # inside 2.5 s, clear of the codec's edges
    assert np.abs(written[:, span] - source[:, span]).max() < 0.05
    assert np.abs(written[:, 84000:140000]).mean() > 0.01 or written.shape[1] < 84000
    assert not torch.equal(output.video, torch.zeros_like(output.video))


def test_extend_continues_the_source(engine: Engine, sources, tmp_path: Path) -> None:
    request = remix_request(Remix(mode="extend", source_video=str(sources["video"])), duration=4.0)
    prepared, output = run(engine, request, tmp_path / "extend.mp4")
    geometry, plan = prepared.geometry, prepared.remix
    assert geometry.frames == 124  # 22 overlap frames + 4 s, on the grid
    # The window's first 7 latent frames are the source's last 22 frames, encoded and held.
    held_rows = 7 * geometry.rows_per_frame
    rows = patchify_video(output.video_latents[None], geometry.patch)
    assert torch.equal(rows[:held_rows], prepared.held.video_clean[:held_rows])
    assert bool((prepared.held.video_mask[:held_rows] == 0).all()) and bool(
        (prepared.held.video_mask[held_rows:] == 1).all()
    )
    # The output is the source, then the window after its overlap.
    assert output.video.shape[0] == SOURCE_FRAMES + 124 - 22
    assert torch.equal(output.video[:SOURCE_FRAMES], torch.from_numpy(plan.prefix_frames).float() / 255.0)
    assert output.audio.shape[1] >= (SOURCE_FRAMES + 102) * RATE // 24
    written = decoded_frames(tmp_path / "extend.mp4")
    source = decoded_frames(sources["video"])
    assert len(written) == SOURCE_FRAMES + 102
    assert np.abs(written[SOURCE_FRAMES - 1].astype(float) - source[-1].astype(float)).mean() < 8


def counting_probe(calls: list[str]):  # noqa: ANN201
    from h3engine.media.inputs import probe_media

    def probe(reference) -> MediaInfo:  # noqa: ANN001
        calls.append(reference.path)
        return probe_media(reference)

    return MediaFacts(probe)


@pytest.mark.parametrize(
    ("remix", "field", "says"),
    [
        (Remix(mode="v2a"), "remix.source_video", "is required for 'v2a'"),
        (Remix(mode="a2v"), "remix.source_audio", "is required for 'a2v'"),
        (
            Remix(audio_mask=((1.0, 2.0),)),
            "remix.audio_mask",
            "needs remix.source_audio or remix.source_video",
        ),
        (
            Remix(mode="extend", source_video="x.mp4", overlap_frames=30),
            "remix.overlap_frames",
            "must be 17k + 5",
        ),
        (Remix(mode="v2a", source_video="x.mp4", windows=2), "remix.windows", "only 'extend' chains windows"),
        (Remix(), "remix", "has no mode and no mask"),
    ],
)
def test_the_checker_refuses_a_bad_remix_naming_the_field(remix: Remix, field: str, says: str) -> None:
    """The remix rules (h3engine.request.remix) with their wording; the doors' tests check the field."""
    with refused(RequestError, field=field, says=says):
        resolve_request(remix_request(remix), None)


def test_masks_outside_the_clip_are_refused_and_each_file_is_probed_once(sources) -> None:
    calls: list[str] = []
    inside = Remix(mode="v2a", source_video=str(sources["video"]), audio_mask=((0.5, 1.0), (2.0, 4.4)))
    resolve_request(remix_request(inside), None, counting_probe(calls))
    assert calls == [str(sources["video"])]
    outside = Remix(mode="v2a", source_video=str(sources["video"]), video_mask=((4.0, 4.6),))
    with refused(RequestError, field="remix.video_mask[0]") as caught:
        resolve_request(remix_request(outside), None)
    assert caught.value.problem == "ends at 4.6 s, outside the 4.458 s clip"
    with refused(RequestError, field="remix.video_mask", says="needs remix.source_video"):
        resolve_request(
            remix_request(Remix(mode="a2v", source_audio=str(sources["video"]), video_mask=((0, 1),))), None
        )


def test_the_cli_refuses_a_mask_outside_the_clip_with_one_line(
    capsys, tiny_native: Path, sources, tmp_path
) -> None:
    arguments = [
        "generate",
        "--checkpoint",
        str(tiny_native),
        "--device",
        "cpu",
        "--prompt",
        "rain",
        "--steps",
        "2",
    ]
    code = main(
        [
            *arguments,
            "--task",
            "v2a",
            "--source-video",
            str(sources["video"]),
            "--audio-mask",
            "1-9",
            "--out",
            str(tmp_path / "clip.mp4"),
        ]
    )
    assert code == 2
    assert cli_refused(capsys.readouterr().err, "remix.audio_mask[0]").startswith("ends at 9 s"), (
        "the mask's end"
    )
    code = main([*arguments, "--task", "fl2va", "--video-mask", "0-1", "--out", str(tmp_path / "clip.mp4")])
    assert code == 2
    # The command line's own rule (h3engine.cli.remix), its wording once.
    assert cli_refused(capsys.readouterr().err, "--video-mask").startswith(
        "remix flags run on t2va, v2a, a2v or extend"
    )
    assert not list(tmp_path.iterdir())


def test_a_gloo_worker_group_equals_one_process_and_keeps_the_held_rows(
    capsys, tiny_native: Path, sources, tmp_path: Path
) -> None:
    """Held rows are sharded like any row: a 2-rank CPU group (gloo) gives one process's tensors (fp32, within the
    worker tests' tolerance) and exactly the source's latents on the kept latent frames."""
    masks = ["--source-video", str(sources["video"]), "--video-mask", "0.5-1.5", "--audio-mask", "1-2"]
    arguments = ["generate", "--checkpoint", str(tiny_native), "--device", "cpu", "--dtype", "float32"]
    arguments += ["--prompt", "rain", "--steps", "2", "--duration", "4", *masks]
    tensors = {}
    for name, extra in (("one", []), ("group", ["--world-size", "2"])):
        saved = tmp_path / f"{name}.safetensors"
        assert (
            main([*arguments, *extra, "--out", str(tmp_path / f"{name}.mp4"), "--save-tensors", str(saved)])
            == 0
        )
        tensors[name] = load_file(saved)
    capsys.readouterr()
    for key, expected in tensors["one"].items():
        error = ((tensors["group"][key] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 1e-5, (key, error)
    one, group = tensors["one"]["video_latents"], tensors["group"]["video_latents"]
    geometry = Geometry(32, 56, 107, 32, 8, 14, 178, 2)
    regenerated = video_range_mask(geometry, [(0.5, 1.5)]).reshape(32, -1)[:, 0]
    assert 0 < int(regenerated.sum()) < 32
    for frame in range(32):
        if regenerated[frame] == 0:
            assert torch.equal(one[:, frame], group[:, frame]), frame


def test_v2a_with_decoded_video_writes_the_vaes_frames_and_the_same_new_audio(
    engine: Engine, sources, tmp_path: Path
) -> None:
    """--decoded-video: the frames come from the VAE (not a copy of the source's), the audio is the copying run's."""
    copied = engine.generate_to_file(
        remix_request(Remix(mode="v2a", source_video=str(sources["video"]))), tmp_path / "copied.mp4"
    )
    decoded = engine.generate_to_file(
        remix_request(Remix(mode="v2a", source_video=str(sources["video"]), decoded_video=True)),
        tmp_path / "decoded.mp4",
    )
    source, frames = decoded_frames(sources["video"]), decoded_frames(decoded.video)
    assert len(frames) == GRID_FRAMES
    # The tiny VAE's round trip is far from its input: not the source's frames, and not a stream copy.
    assert np.abs(frames[0].astype(float) - source[0].astype(float)).mean() > 8
    assert np.array_equal(decoded_audio(decoded.video), decoded_audio(copied.video))
    assert '"decoded_video": true' in decoded.sidecar.read_text()


@pytest.mark.parametrize("profile", ["streamed", "low-memory"])
def test_every_remix_mode_under_a_memory_profile_equals_the_resident_engine(
    engine: Engine, sources, tmp_path: Path, tiny_native: Path, profile: str
) -> None:
    """The held rows ride through a streamed DiT (and the low-memory profile) like any row: bit for bit."""
    other = Engine.from_checkpoint(tiny_native, device="cpu", dtype=torch.float32, memory_profile=profile)
    assert other.plan.profile == profile
    for mode, remix in every_mode(sources).items():
        request = remix_request(remix)
        _, resident = run(engine, request, tmp_path / f"{mode}-resident.mp4")
        _, streamed = run(other, request, tmp_path / f"{mode}-{profile}.mp4")
        assert torch.equal(streamed.video_latents, resident.video_latents), mode
        assert torch.equal(streamed.audio_latents, resident.audio_latents), mode


def test_chained_windows_extend_twice_in_one_process_and_on_a_gloo_group(
    capsys, tiny_native: Path, sources, tmp_path: Path
) -> None:
    """--windows 2: window 2 extends window 1's MP4; the output is the source and two continuations, and the windows'
    folder is gone; on a 2-rank CPU group and on split stage groups each window is one job of the group. (Their
    tensors are not compared: the second window starts from the first one's encoded MP4, where a 1e-6 difference
    can flip a pixel's rounding.)"""
    arguments = ["generate", "--checkpoint", str(tiny_native), "--device", "cpu", "--dtype", "float32"]
    arguments += [
        "--prompt",
        "rain",
        "--steps",
        "2",
        "--task",
        "extend",
        "--source-video",
        str(sources["video"]),
    ]
    arguments += ["--duration", "4", "--windows", "2"]
    window = frames_for_duration(22 / FPS + 4)  # the default overlap of 22 frames, then 4 s
    source = decoded_frames(sources["video"])
    capture = tmp_path / "capture"  # the group's: its rank 0 records the last window
    for name, extra in (
        ("one", []),
        ("group", ["--world-size", "2", "--capture", str(capture)]),
        ("split", ["--stage-layout", "split"]),
    ):
        out = tmp_path / name / "clip.mp4"
        out.parent.mkdir()
        assert main([*arguments, *extra, "--out", str(out)]) == 0
        frames = decoded_frames(out)
        assert len(frames) == SOURCE_FRAMES + 2 * (window - 22), name
        # The source comes first, through two H.264 generations (each window writes it again): noise frames lose
        # ~10 levels a pixel that way, where an unrelated noise frame differs by ~85.
        assert np.abs(frames[0].astype(float) - source[0].astype(float)).mean() < 20, name
        assert sorted(path.name for path in out.parent.iterdir()) == ["clip.json", "clip.mp4"], name
        assert capsys.readouterr().err.count("decoding the video and the audio") == 2, name
    index = json.loads((capture / "index.json").read_text())
    assert (
        index["request"]["remix"]["windows"] == 1 and ".windows-" in index["request"]["remix"]["source_video"]
    )
    assert [entry["name"] for entry in index["boundaries"]][-1] == "waveform"
