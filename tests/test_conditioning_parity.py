"""FL2VA and Ref2VA generations against diffusers 0.42.1 on a tiny random-weight checkpoint (fp32, CPU).

Both sides read the same files (PNG, WAV, H.264/AAC MP4 written here): ours through `Engine.generate` (the request,
its validation, `h3engine.media.inputs`, fitting/normalization, the presentation, the conditioning encodes), the
reference through its own `from_file` loaders and `ModularPipeline` with `recipe="diffusers"`'s generator. Both DiTs
are hooked and the inputs of every forward are compared: layout tensors (tags, positions, row indices), timesteps
and the initial rows (condition rows included) must be *equal*; the text states and the reference-audio condition
rows (our audio VAE encoder matches diffusers' to ~1e-6, not bit for bit) within 1e-5. The decoded video and audio
must agree to a relative L2 of 1e-4.

The tiny audio VAE keeps the released hop (40 latents per second); the audio and video clips here are shorter
than validation's 2 s minimum to keep the runs small, so those cases skip request validation.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from _parity_helpers import (
    DIT_INPUT_NAMES,
    reference_objects,
    reference_pipeline,
    reference_run,
    relative_l2,
    synthetic_image,
)
from _refusals import refused
from PIL import Image

from h3engine.cli.main import main
from h3engine.cli.specs import parse_reference_spec
from h3engine.engine.conditioning.encode import (
    fit_keyframes,
    reference_image_size,
    reference_video_encode_frames,
    resample_waveform,
    sinc_resample_kernel,
)
from h3engine.engine.conditioning.presentation import qwen_video_sampling
from h3engine.engine.engine import Engine
from h3engine.engine.pipeline import prepare_request, run_generation
from h3engine.engine.resolved import ResolvedRequest, new_media_facts, request_geometry
from h3engine.engine.sampling.schedule import Schedule
from h3engine.errors import RequestError
from h3engine.media.mux import write_mp4
from h3engine.request.file_rules import resolve_duration_seconds
from h3engine.request.files import Keyframe, Reference
from h3engine.request.model import GenerationRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "At 0.00 seconds <Picture 1> is fully referenced. A fox runs through snow; wind hisses softly."
REF_PROMPT = "<Picture 1> walks along the beach in the style of <Picture 2>, humming softly."
# timestep, timestep_indices, token_tags, position_ids, video_indices, audio_indices.
EXACT_INPUTS = DIT_INPUT_NAMES[3:9]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("diffusers", seed=3)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference_pipelines(checkpoint) -> dict:
    return {workflow: reference_pipeline(checkpoint, workflow) for workflow in ("fl2va", "ref2va")}


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("media")
    files = {}
    for name, size, seed in (("wide", (72, 40), 1), ("tall", (40, 64), 2), ("square", (50, 60), 3)):
        files[name] = folder / f"{name}.png"
        synthetic_image(*size, seed).save(files[name])
    # Short clips (0.1 s of mono voice; 13 frames, the fewest the text encoder's 2 fps sampling takes, with their
    # soundtrack): validation wants clips of 2 s, so the parity runs that use them skip it (see `our_run`).
    rng = np.random.default_rng(4)
    files["voice"] = folder / "voice.wav"
    voice = rng.normal(0, 0.2, (3_200, 1)).astype(np.float32)
    soundfile.write(files["voice"], voice, 32_000, subtype="FLOAT")
    frames = np.stack([np.asarray(synthetic_image(64, 36, 10 + index)) for index in range(13)])
    files["clip"] = folder / "clip.mp4"
    soundtrack = rng.normal(0, 0.2, (2, 17_334)).astype(np.float32)
    write_mp4(files["clip"], frames.astype(np.float32) / 255, soundtrack)
    # 20 frames at 30 fps, held onto 24 fps (16 frames) by both loaders; the muxer gives it a silent soundtrack.
    files["clip30"] = folder / "clip30.mp4"
    frames30 = np.stack([np.asarray(synthetic_image(36, 64, 30 + index)) for index in range(20)])
    write_mp4(files["clip30"], frames30.astype(np.float32) / 255, np.zeros((2, 0), np.float32), fps=30)
    for rate in (44_100, 48_000):
        files[f"voice{rate}"] = folder / f"voice{rate}.wav"
        soundfile.write(files[f"voice{rate}"], rng.normal(0, 0.2, (rate // 8, 2)).astype(np.float32), rate)
    return files


# ------------------------------------------------------------------------------------------------ runs and checks


def unchecked(engine: Engine, request: GenerationRequest) -> ResolvedRequest:
    """`request` resolved on the engine's checkpoint without the request rules (media the rules refuse)."""
    media = new_media_facts()
    geometry = request_geometry(request, engine.facts, media)
    return ResolvedRequest(request, (), media, resolve_duration_seconds(request, media), geometry, None)


def our_run(engine: Engine, request: GenerationRequest, validated: bool = True):
    """The DiT inputs of every forward, the output, the geometry and the encoded conditioning of one request.

    `validated=False` runs the stages of `Engine.generate` without its validation, for media shorter than the
    request rules allow (cheap reference-audio rows on the tiny audio VAE); the files are read all the same.
    """
    models = engine.store.models_for_partition(engine.layout.for_task(request.task).partition)
    calls: list[dict] = []
    prepared = []
    prepare = engine.prepare

    def capture(module, args) -> None:
        calls.append({name: value.clone() for name, value in zip(DIT_INPUT_NAMES, args, strict=True)})

    def keep_prepared(*args, **kwargs):
        prepared.append(prepare(*args, **kwargs))
        return prepared[-1]

    handle = models.dit.register_forward_pre_hook(capture)
    engine.prepare = keep_prepared
    try:
        if validated:
            output, geometry = engine.generate(request)
        else:
            schedule = Schedule.build(request.steps, recipe=request.recipe)
            prepared.append(prepare_request(unchecked(engine, request), models, engine.layout.canvas))
            with torch.inference_mode():
                geometry = prepared[0].geometry
                output = run_generation(
                    models, dataclasses.replace(prepared[0], schedule=schedule), engine.device
                )
    finally:
        handle.remove()
        del engine.prepare
    return calls, output, geometry, prepared[0].conditions


def assert_same_dit_inputs(ours: list[dict], reference: list[dict], num_condition_audio_rows: int) -> None:
    assert len(ours) == len(reference) >= 1
    for our_call, reference_call in zip(ours, reference, strict=True):
        for name in ("timestep", "timestep_indices"):
            assert torch.equal(our_call[name], reference_call[name].reshape(our_call[name].shape)), name
    our_first, reference_first = ours[0], {name: value.squeeze(0) for name, value in reference[0].items()}
    for name in EXACT_INPUTS + ("text_indices",):
        assert our_first[name].dtype == reference_first[name].dtype, name
        assert torch.equal(our_first[name], reference_first[name]), name
    # Every video row before the first step: the noised condition rows and the initial noise.
    assert torch.equal(our_first["hidden_states"], reference_first["hidden_states"])
    our_audio, reference_audio = our_first["audio_hidden_states"], reference_first["audio_hidden_states"]
    assert our_audio.shape == reference_audio.shape
    assert torch.equal(our_audio[num_condition_audio_rows:], reference_audio[num_condition_audio_rows:])
    if num_condition_audio_rows:
        condition_error = relative_l2(
            our_audio[:num_condition_audio_rows], reference_audio[:num_condition_audio_rows]
        )
        assert condition_error <= 1e-5, condition_error
    text_error = relative_l2(our_first["encoder_hidden_states"], reference_first["encoder_hidden_states"])
    assert text_error <= 1e-5, text_error


def assert_same_outputs(output, reference_video: torch.Tensor, reference_audio: torch.Tensor) -> None:
    assert output.video.shape == reference_video.shape
    assert output.audio.shape == reference_audio.shape
    video_error = relative_l2(output.video, reference_video)
    audio_error = relative_l2(output.audio, reference_audio)
    assert video_error <= 1e-4, video_error
    assert audio_error <= 1e-4, audio_error


# ------------------------------------------------------------------------------------------------ FL2VA


@pytest.mark.parametrize(
    ("keyframe_files", "expected_canvas"),
    [
        ((("first", "wide"),), (32, 56)),
        ((("last", "tall"),), (48, 32)),
        ((("first", "wide"), ("last", "square")), (32, 56)),
    ],
    ids=["first", "last", "first_last"],
)
def test_fl2va_matches_diffusers(engine, reference_pipelines, media, keyframe_files, expected_canvas) -> None:
    from diffusers.utils import load_image

    steps, seed = 3, 11
    keyframes = tuple(Keyframe(path=str(media[name]), position=position) for position, name in keyframe_files)
    request = GenerationRequest(
        task="fl2va", prompt=PROMPT, steps=steps, seed=seed, recipe="diffusers", keyframes=keyframes
    )
    ours, output, geometry, _ = our_run(engine, request)
    images = {("image" if k.position == "first" else "last_image"): load_image(k.path) for k in keyframes}
    reference, reference_video, reference_audio = reference_run(
        reference_pipelines["fl2va"], prompt=PROMPT, num_inference_steps=steps, seed=seed, **images
    )

    assert (geometry.height, geometry.width, geometry.frames) == (*expected_canvas, 124)
    rows_per_keyframe = geometry.rows_per_frame
    assert engine_layout_condition_rows(ours) == len(keyframes) * rows_per_keyframe
    assert_same_dit_inputs(ours, reference, num_condition_audio_rows=0)
    assert_same_outputs(output, reference_video, reference_audio)
    # The comparison can fail: another keyframe conditions differently.
    other = tuple(Keyframe(path=str(media["square"]), position=k.position) for k in keyframes)
    other_calls, *_ = our_run(engine, dataclasses.replace(request, keyframes=other, steps=2))
    assert not torch.equal(other_calls[0]["hidden_states"], ours[0]["hidden_states"])


def engine_layout_condition_rows(calls: list[dict]) -> int:
    """Condition video rows of a call: those whose timestep is the visual condition level (0.999)."""
    first = calls[0]
    row_timesteps = first["timestep"][first["timestep_indices"]]
    return int((row_timesteps[first["video_indices"]] == torch.tensor(0.999)).sum())


def test_keyframe_fitting_arithmetic() -> None:
    """Stretch for the first keyframe; for the second, round() sizing and (src - dst) // 2 centring."""
    first, second = synthetic_image(90, 50, 5), synthetic_image(61, 47, 6)
    fitted = fit_keyframes([first, second], 32, 56)
    assert [image.size for image in fitted] == [(56, 32), (56, 32)]
    assert np.array_equal(np.asarray(fitted[0]), np.asarray(first.resize((56, 32), Image.Resampling.LANCZOS)))
    # 61x47 covering 56x32: scale max(56/61, 32/47) = 0.918, resized round(56.0) x round(43.15) = 56x43, top 5.
    resized = second.resize((56, 43), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(fitted[1]), np.asarray(resized.crop((0, 5, 56, 37))))
    assert fit_keyframes([first], 50, 90)[0] is first


# ------------------------------------------------------------------------------------------------ Ref2VA


@pytest.mark.parametrize(
    ("reference_files", "validated", "expected_blocks"),
    [
        ((("image", "wide"), ("image", "tall")), True, "IMAGE(16,28) IMAGE(26,16)"),
        (
            (("image", "square"), ("audio", "voice"), ("image", "wide")),
            False,
            "IMAGE(20,16) AUDIO(4) IMAGE(16,28)",
        ),
        ((("video", "clip"), ("image", "tall")), False, "VIDEO(2,8,14,22) IMAGE(26,16)"),
        ((("image", "wide"), ("video", "clip30")), False, "IMAGE(16,28) VIDEO(2,14,8,27)"),
    ],
    ids=["images", "images_audio_clip", "video_with_soundtrack", "video_30fps"],
)
def test_ref2va_matches_diffusers(
    engine, reference_pipelines, media, reference_files, validated, expected_blocks
) -> None:
    steps, seed = 3, 5
    references = tuple(Reference(kind=kind, path=str(media[name])) for kind, name in reference_files)
    request = GenerationRequest(
        task="ref2va", prompt=REF_PROMPT, steps=steps, seed=seed, recipe="diffusers", references=references
    )
    ours, output, geometry, conditions = our_run(engine, request, validated)
    reference, reference_video, reference_audio = reference_run(
        reference_pipelines["ref2va"],
        prompt=REF_PROMPT,
        references=reference_objects(references),
        num_frames=geometry.frames,
        num_inference_steps=steps,
        seed=seed,
    )

    assert (geometry.height, geometry.width, geometry.frames) == (32, 56, 124)
    assert describe_blocks(conditions.reference_blocks) == expected_blocks
    condition_audio_rows = sum(rows.shape[0] for rows in conditions.audio_rows)
    assert_same_dit_inputs(ours, reference, num_condition_audio_rows=condition_audio_rows)
    assert_same_outputs(output, reference_video, reference_audio)


@pytest.mark.parametrize("rate", [44_100, 48_000])
def test_ref2va_resampled_audio_matches_diffusers(engine, reference_pipelines, media, rate) -> None:
    """Audio away from 32 kHz: the reference resamples with torchaudio, which this machine may not have."""
    pytest.importorskip("torchaudio")
    references = (Reference("image", str(media["tall"])), Reference("audio", str(media[f"voice{rate}"])))
    request = GenerationRequest(
        task="ref2va", prompt=REF_PROMPT, steps=2, seed=7, recipe="diffusers", references=references
    )
    ours, output, geometry, conditions = our_run(engine, request, validated=False)
    reference, reference_video, reference_audio = reference_run(
        reference_pipelines["ref2va"],
        prompt=REF_PROMPT,
        references=reference_objects(references),
        num_frames=geometry.frames,
        num_inference_steps=2,
        seed=7,
    )
    assert describe_blocks(conditions.reference_blocks) == "IMAGE(26,16) AUDIO(5)"
    assert_same_dit_inputs(ours, reference, num_condition_audio_rows=conditions.audio_rows[0].shape[0])
    assert_same_outputs(output, reference_video, reference_audio)


def describe_blocks(blocks) -> str:
    names = []
    for block in blocks:
        fields = [value for value in block.__dict__.values()]
        names.append(
            f"{type(block).__name__.removesuffix('Reference').upper()}({','.join(map(str, fields))})"
        )
    return " ".join(names)


def test_ref2va_uses_its_own_partition(engine) -> None:
    fl2va, ref2va = engine.store.models_for_partition("fl2va"), engine.store.models_for_partition("ref2va")
    assert fl2va.dit is not ref2va.dit
    assert not torch.equal(next(fl2va.dit.parameters()), next(ref2va.dit.parameters()))


def test_reference_normalization_rules() -> None:
    # 64-px reference short edge, multiple 8: 72x40 -> 115.2x64 -> 112x64; 4:1 is allowed, beyond is not.
    assert reference_image_size(72, 40, short_edge=64, multiple=8) == (112, 64)
    assert reference_image_size(2000, 3000, short_edge=2048, multiple=32) == (2048, 3072)
    assert reference_image_size(400, 100, short_edge=64, multiple=8) == (256, 64)
    with pytest.raises(ValueError):
        reference_image_size(401, 100, short_edge=64, multiple=8)
    assert [reference_video_encode_frames(count) for count in (13, 22, 38, 39, 124, 130)] == [
        22,
        22,
        22,
        39,
        124,
        124,
    ]


def test_qwen_video_sampling_and_timestamps() -> None:
    indices, block_times = qwen_video_sampling(124)
    assert indices == [12 * sample for sample in range(11)]
    assert [f"<{time:.1f} seconds>" for time in block_times][:3] == [
        "<0.2 seconds>",
        "<1.2 seconds>",
        "<2.2 seconds>",
    ]
    assert len(block_times) == 6 and block_times[-1] == 5.0  # 11 samples padded to 12 by repeating the last
    assert qwen_video_sampling(13)[0] == [0, 12]
    with pytest.raises(ValueError):
        qwen_video_sampling(12)


# ------------------------------------------------------------------------------------------------ resampling


def test_resampler_matches_torchaudio() -> None:
    torchaudio = pytest.importorskip("torchaudio")
    generator = torch.Generator().manual_seed(0)
    for source_rate, length in ((44_100, 44_117), (48_000, 9_601), (22_050, 5_000), (16_000, 3), (8_000, 1)):
        waveform = torch.randn(2, length, generator=generator)
        expected = torchaudio.transforms.Resample(source_rate, 32_000)(waveform)
        assert torch.equal(resample_waveform(waveform, source_rate, 32_000), expected)


def test_resampler_against_recorded_torchaudio_values() -> None:
    """Values recorded from torchaudio 2.11.1's `transforms.Resample`, for machines without torchaudio."""
    recorded = {
        44_100: ((320, 1, 459), 320.14937559538885, 214.26128709037596, 0.059433743357658386),
        48_000: ((2, 1, 23), 2.0009317666535935, 1.2303284828629688, 0.0033806809224188328),
        16_000: ((2, 1, 15), 2.0009139528747255, 1.8454927883722831, 0.6259110569953918),
    }
    for source_rate, (shape, total, energy, sample) in recorded.items():
        divisor = math.gcd(source_rate, 32_000)
        kernel = sinc_resample_kernel(source_rate // divisor, 32_000 // divisor)[0].double()
        assert tuple(kernel.shape) == shape
        assert float(kernel.sum()) == pytest.approx(total, rel=1e-9)
        assert float((kernel * kernel).sum()) == pytest.approx(energy, rel=1e-9)
        assert float(kernel[1, 0, 7]) == pytest.approx(sample, rel=1e-6)
    times = torch.arange(4410, dtype=torch.float64) / 44_100
    tones = torch.stack(
        [torch.sin(2 * math.pi * 440 * times), 0.5 * torch.cos(2 * math.pi * 1000 * times)]
    ).float()
    resampled = resample_waveform(tones, 44_100, 32_000).double()
    assert resampled.shape == (2, 3200)
    assert float(resampled.abs().sum()) == pytest.approx(3053.435740598412, rel=1e-6)
    assert float(resampled[0, 1000]) == pytest.approx(-1.000424861907959, rel=1e-5)
    assert float(resampled[1, 3199]) == pytest.approx(0.5089029669761658, rel=1e-5)


# ------------------------------------------------------------------------------------------------ engine and CLI


def test_sidecar_records_input_hashes(engine, media, tmp_path) -> None:
    import hashlib
    import json

    request = GenerationRequest(
        task="fl2va",
        prompt=PROMPT,
        steps=1,
        keyframes=(Keyframe(path=str(media["wide"]), position="first"),),
    )
    written = engine.generate_to_file(request, tmp_path / "out.mp4")
    sidecar = json.loads(written.sidecar.read_text())
    expected = hashlib.sha256(media["wide"].read_bytes()).hexdigest()
    assert sidecar["inputs"] == [
        {"field": "keyframes[0]", "position": "first", "path": str(media["wide"]), "sha256": expected}
    ]
    assert (sidecar["geometry"]["width"], sidecar["geometry"]["height"]) == (56, 32)


def test_engine_refuses_bad_files_with_request_errors(engine, media, tmp_path) -> None:
    missing = str(tmp_path / "missing.png")
    with refused(RequestError, field="keyframes[0]", path=missing):
        engine.validate(
            GenerationRequest(
                task="fl2va", prompt=PROMPT, keyframes=(Keyframe(path=missing, position="first"),)
            )
        )
    with refused(RequestError, field="keyframes"):
        engine.validate(
            GenerationRequest(
                task="ref2va",
                prompt="<Picture 1> walks along the beach.",
                keyframes=(Keyframe(path=str(media["wide"]), position="first"),),
                references=(Reference("image", str(media["tall"])),),
            )
        )
    short = tmp_path / "short.wav"
    soundfile.write(short, np.zeros((8_000, 2), np.float32), 32_000)
    with refused(RequestError, field="references[1]"):
        engine.validate(
            GenerationRequest(
                task="ref2va",
                prompt=REF_PROMPT,
                references=(Reference("image", str(media["wide"])), Reference("audio", str(short))),
            )
        )


def test_parse_reference_spec() -> None:
    assert parse_reference_spec("image:/a/b.png") == {"kind": "image", "path": "/a/b.png"}
    assert parse_reference_spec("video:clip.mp4@1.5") == {
        "kind": "video",
        "path": "clip.mp4",
        "start_seconds": 1.5,
    }
    assert parse_reference_spec("image:me@2x.png") == {"kind": "image", "path": "me@2x.png"}
    assert parse_reference_spec("image:shot@2") == {"kind": "image", "path": "shot@2"}
    assert parse_reference_spec("video:a@b@3") == {"kind": "video", "path": "a@b", "start_seconds": 3.0}
    assert parse_reference_spec("audio:file:///x/v.wav") == {"kind": "audio", "path": "file:///x/v.wav"}
    for bad in ("picture:/a.png", "image:", "/a/b.png"):
        with refused(RequestError, field="--ref"):
            parse_reference_spec(bad)


def run_cli(capsys, *arguments: str) -> tuple[int, str]:
    """`python -m h3engine generate ...` in this process (its startup imports are paid once); (exit code, stderr)."""
    code = main(["generate", *arguments])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("--first-frame", "/nonexistent/first.png"), "first.png"),
        (("--ref", "photo:/a.png"), "--ref: expected KIND:PATH"),
        (("--ref", "audio:/nonexistent/voice.wav", "--ref", "image:/nonexistent/x.png"), "voice.wav"),
        (
            tuple(argument for _ in range(10) for argument in ("--ref", "image:/nonexistent/x.png")),
            "at most 9 image",
        ),
        (("--task", "t2va", "--last-frame", "/nonexistent/last.png"), "keyframes"),
    ],
    ids=["missing_keyframe", "bad_ref_spec", "missing_reference", "too_many_refs", "frames_for_t2va"],
)
def test_cli_refuses_bad_inputs_with_exit_code_2(capsys, tmp_path, arguments, message) -> None:
    # No checkpoint is needed: the request and its files are checked before anything loads.
    out = tmp_path / "o.mp4"
    code, stderr = run_cli(
        capsys, "--checkpoint", str(tmp_path / "none"), "--prompt", "a fox", "--out", str(out), *arguments
    )
    assert code == 2, stderr
    assert message in stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1
    assert not out.exists()


def test_cli_generates_ref2va_from_files(capsys, checkpoint, media, tmp_path) -> None:
    out = tmp_path / "ref.mp4"
    code, stderr = run_cli(
        capsys, "--checkpoint", str(checkpoint), "--prompt", REF_PROMPT, "--steps", "1", "--device", "cpu",
        "--dtype", "float32", "--ref", f"image:{media['wide']}", "--ref", f"image:{media['tall']}", "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    assert out.is_file() and out.with_suffix(".json").is_file()
