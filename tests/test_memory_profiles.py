"""Memory profiles (h3engine.memory.placement): the profile name is checked, phases hold the right components, outputs agree.

How "moved" is seen on the CPU: the low-memory placement under test copies with `torch.clone`, so a component on
the compute device is one whose parameters and buffers no longer share storage with their home tensors (the ones
recorded at load), and a component at home is one that shares all of them again. A recording placement notes, on
entering and on leaving each phase, where every component is. What is compared: the phase order of an FL2VA request
(conditioning, text encode, denoise, decode) with exactly that phase's components away from home inside it and all
of them home outside; everything home again after a cancel and after a failed copy; bit-identical outputs between
the two profiles; the flag's error on the engine, the worker replica and the CLI (exit code 2). On a GPU: the
low-memory engine keeps its models in pinned host memory between requests (the DiT's AdaLN weights included) and
generates exactly what the resident engine does, and so does a low-memory worker rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from _lora_helpers import small_lora, write_lora
from _refusals import refused
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from h3engine.checkpoint.layout import detect_layout
from h3engine.cli.main import main
from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions
from h3engine.engine.pipeline import Models
from h3engine.errors import GenerationCancelled, RequestError
from h3engine.memory.homes import pin_in_place
from h3engine.memory.placement import Placement
from h3engine.models.parallel.groups import RuntimeLayout
from h3engine.request.files import Keyframe
from h3engine.request.model import GenerationRequest, LoraChoice
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import TERMINAL_EVENTS, JobFinished
from h3engine.runtime.workers import ProcessReplica, validated_spec

COMPONENTS = ("dit", "text_encoder", "video_vae", "audio_vae")
EVENT_TIMEOUT_S = 300


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(module.parameters(), module.buffers()))


def storages(module: nn.Module) -> list[int]:
    return [tensor.data_ptr() for tensor in tensors_of(module)]


class RecordingPlacement(Placement):
    """A low-memory placement whose copies are CPU clones, noting where each component is around every phase."""

    def __init__(self, profile: str, device: torch.device) -> None:
        super().__init__(profile, device, transfer=torch.clone)
        self.homes: dict[str, list[int]] = {}
        self.components: dict[str, nn.Module] = {}
        self.log: list[tuple[str, str, dict[str, str]]] = []

    def watch(self, models: Models) -> None:
        self.components = {name: getattr(models, name) for name in COMPONENTS}
        self.homes = {name: storages(module) for name, module in self.components.items()}

    def where(self) -> dict[str, str]:
        """Each component: "home" (every tensor on its home storage), "away" (none), "split" otherwise."""
        places = {}
        for name, module in self.components.items():
            at_home = [now == home for now, home in zip(storages(module), self.homes[name], strict=True)]
            places[name] = "home" if all(at_home) else "away" if not any(at_home) else "split"
        return places

    @contextmanager
    def resident_for(self, phase: str, modules: Iterable[nn.Module | None]) -> Iterator[None]:
        try:
            with super().resident_for(phase, modules):
                self.log.append(("enter", phase, self.where()))
                yield
        finally:
            self.log.append(("leave", phase, self.where()))


class RecordingEngine(Engine):
    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        return RecordingPlacement(memory_profile, device)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=5)


@pytest.fixture(scope="module")
def fl2va_request(tmp_path_factory) -> GenerationRequest:
    image = tmp_path_factory.mktemp("keyframe") / "first.png"
    pixels = np.random.default_rng(0).integers(0, 256, (40, 72, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image)
    return GenerationRequest(
        task="fl2va",
        prompt="A lantern sways in the wind.",
        duration_seconds=4,
        steps=2,
        seed=3,
        keyframes=(Keyframe(str(image), "first"),),
    )


@pytest.fixture(scope="module")
def low_memory(checkpoint, fl2va_request):
    """A low-memory engine (CPU clones as the device copies), its placement and one FL2VA output."""
    engine = RecordingEngine.from_checkpoint(checkpoint, device="cpu", memory_profile="low-memory")
    placement = engine.placement
    placement.watch(engine.store.models_for_partition(engine.layout.for_task("fl2va").partition))
    output, _ = engine.generate(fl2va_request)
    return engine, placement, output


def expected_places(away: tuple[str, ...]) -> dict[str, str]:
    return {name: "away" if name in away else "home" for name in COMPONENTS}


def test_low_memory_phases_hold_only_their_components(low_memory) -> None:
    _, placement, _ = low_memory
    all_home = expected_places(())
    assert placement.log == [
        ("enter", "conditioning", expected_places(("video_vae", "audio_vae"))),
        ("leave", "conditioning", all_home),
        ("enter", "text_encode", expected_places(("text_encoder",))),
        ("leave", "text_encode", all_home),
        ("enter", "denoise", expected_places(("dit",))),
        ("leave", "denoise", all_home),
        ("enter", "decode", expected_places(("video_vae", "audio_vae"))),
        ("leave", "decode", all_home),
    ]
    assert placement.where() == all_home and placement.phase is None


def test_profiles_generate_identical_outputs(checkpoint, fl2va_request, low_memory) -> None:
    _, _, low_memory_output = low_memory
    resident = Engine.from_checkpoint(checkpoint, device="cpu", memory_profile="resident")
    assert resident.placement.profile == "resident"
    output, _ = resident.generate(fl2va_request)
    for name in ("video", "audio", "video_latents", "audio_latents"):
        assert torch.equal(getattr(output, name), getattr(low_memory_output, name)), name


def test_a_cancelled_request_leaves_every_component_home(low_memory) -> None:
    engine, placement, _ = low_memory
    placement.log.clear()
    polls = itertools.count()
    request = GenerationRequest(task="t2va", prompt="A quiet pond.", duration_seconds=4, steps=2)
    with pytest.raises(GenerationCancelled):
        # Poll 0 comes before the text encode, poll 1 before the first step.
        engine.generate(request, should_cancel=lambda: next(polls) == 1)
    assert [(event, phase) for event, phase, _ in placement.log] == [
        ("enter", "text_encode"),
        ("leave", "text_encode"),
        ("enter", "denoise"),
        ("leave", "denoise"),
    ]
    assert placement.where() == expected_places(()) and placement.phase is None


def test_a_failed_copy_sends_everything_home_and_phases_do_not_nest() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    module.register_buffer("table", torch.arange(4.0))
    copies = itertools.count()

    def clone_then_fail(tensor: torch.Tensor) -> torch.Tensor:
        if next(copies) == 3:
            raise torch.OutOfMemoryError("no room on the device")
        return tensor.clone()

    placement = Placement("low-memory", "cpu", transfer=clone_then_fail)
    placement.adopt(module, "audio_vae")
    homes = storages(module)
    with pytest.raises(torch.OutOfMemoryError), placement.resident_for("denoise", [module]):
        pass
    assert storages(module) == homes and placement.phase is None

    placement = Placement("low-memory", "cpu", transfer=torch.clone)
    placement.adopt(module, "audio_vae")
    with placement.resident_for("decode", [module, None]):
        assert all(now != home for now, home in zip(storages(module), homes, strict=True))
        with pytest.raises(RuntimeError, match="'text_encode' entered while 'decode'"):
            with placement.resident_for("text_encode", [module]):
                pass
    assert storages(module) == homes


def test_the_resident_profile_moves_nothing() -> None:
    module = nn.Linear(4, 4)
    placement = Placement("resident", "cpu", transfer=torch.clone)
    assert placement.adopt(module, "audio_vae") is module and placement.load_device(
        "audio_vae"
    ) == torch.device("cpu")
    homes = storages(module)
    with placement.resident_for("denoise", [module]):
        assert storages(module) == homes


def test_pinning_packs_tensors_into_best_filled_power_of_two_slabs_and_stops_at_a_failed_allocation() -> None:
    generator = torch.Generator().manual_seed(0)
    shapes_and_dtypes = [
        ((100,), torch.float32),  # 400 bytes, 512 aligned
        ((3, 50), torch.bfloat16),  # 300 -> 512
        ((300,), torch.float32),  # 1200 -> 1280: more than a slab, an allocation of its own
        ((20,), torch.int64),  # 160 -> 256
        ((7,), torch.bool),  # 7 -> 256
        ((64,), torch.float32),  # 256
    ]
    tensors = [
        nn.Parameter(torch.randn(shape, generator=generator).to(dtype), requires_grad=False)
        for shape, dtype in shapes_and_dtypes
    ]
    originals = [tensor.detach().clone() for tensor in tensors]
    allocations = []

    def allocate(size: int) -> torch.Tensor:
        allocations.append(size)
        return torch.empty(size, dtype=torch.uint8)

    identities = [id(tensor) for tensor in tensors]
    pin_in_place(tensors, slab_bytes=1024, allocate=allocate)
    # The first slab takes 512 + 512 (filled whole, the larger on a tie with 512 alone); the three 256-byte tensors
    # fill a 512-byte slab and a 256-byte one whole, where one 1024-byte slab would waste a quarter.
    assert allocations == [1024, 1280, 512, 256]
    slabs = [tensor.untyped_storage().data_ptr() for tensor in tensors]
    assert slabs[0] == slabs[1] and slabs[3] == slabs[4] and len(set(slabs)) == 4
    assert [id(tensor) for tensor in tensors] == identities
    for tensor, original in zip(tensors, originals, strict=True):
        assert tensor.dtype == original.dtype and torch.equal(tensor, original)

    def fail_second(size: int) -> torch.Tensor:
        allocations.append(size)
        if len(allocations) == 6:
            raise RuntimeError("no more pinnable memory")
        return torch.empty(size, dtype=torch.uint8)

    before = [tensor.untyped_storage().data_ptr() for tensor in tensors]
    pin_in_place(tensors, slab_bytes=1024, allocate=fail_second)
    after = [tensor.untyped_storage().data_ptr() for tensor in tensors]
    assert after[0] == after[1] not in before and after[2:] == before[2:]
    for tensor, original in zip(tensors, originals, strict=True):
        assert torch.equal(tensor, original)


def test_an_unknown_profile_is_refused_naming_the_flag_and_a_known_one_reaches_the_ranks(checkpoint) -> None:
    for build in (
        lambda: Engine.from_checkpoint(checkpoint, device="cpu", memory_profile="tiny-gpu"),
        lambda: ProcessReplica(checkpoint, ("cpu",), options=EngineOptions(memory_profile="tiny-gpu")),
    ):
        with refused(
            RequestError, field="--memory-profile", says="auto, resident, streamed, low-memory"
        ) as caught:
            build()
        assert "'tiny-gpu'" in caught.value.problem
    low_memory = EngineOptions(memory_profile="low-memory")
    spec = validated_spec(detect_layout(checkpoint), ("cpu",), RuntimeLayout.choose(1), low_memory)
    assert spec.options.memory_profile == "low-memory"


def test_the_cli_refuses_an_unknown_profile_with_exit_code_2(capsys, tmp_path) -> None:
    out = tmp_path / "o.mp4"
    code = main(
        ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a fox", "--out", str(out),
         "--memory-profile", "huge"]
    )  # fmt: skip
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.startswith("error: --memory-profile:") and "'huge'" in stderr and stderr.count("\n") == 1
    assert not out.exists()


def test_adapters_run_under_every_profile_alike(checkpoint, fl2va_request, low_memory, tmp_path) -> None:
    """A LoRA's factors ride on the layers beside their weights (h3engine.engine.lora.adapters), not as parameters, so they are
    where the forward runs while the DiT moves for its phase: low-memory with an adapter equals resident with it."""
    _, _, base = low_memory
    engine = RecordingEngine.from_checkpoint(checkpoint, device="cpu", memory_profile="low-memory")
    engine.placement.watch(engine.store.models_for_partition(engine.layout.for_task("fl2va").partition))
    config = engine.store.models_for_task("fl2va").dit.config
    path = tmp_path / "style.safetensors"
    write_lora(path, small_lora(config, 4), "diffusers", config)
    request = dataclasses.replace(fl2va_request, loras=(LoraChoice(str(path), 0.7),))
    adapted, _ = engine.generate(request)
    expected, _ = Engine.from_checkpoint(checkpoint, device="cpu").generate(request)
    for name in ("video", "audio"):
        assert torch.equal(getattr(adapted, name), getattr(expected, name)), name
        assert not torch.equal(getattr(adapted, name), getattr(base, name)), name
    assert ("enter", "denoise", expected_places(("dit",))) in engine.placement.log
    assert engine.placement.where() == expected_places(())


@pytest.mark.cuda
def test_low_memory_on_a_gpu_keeps_models_in_host_memory_and_equals_resident(
    checkpoint, fl2va_request
) -> None:
    low_memory = Engine.from_checkpoint(checkpoint, device="cuda", memory_profile="low-memory")
    models = low_memory.store.models_for_partition(low_memory.layout.for_task("fl2va").partition)

    def check_host_resident() -> None:
        for name in COMPONENTS:
            for tensor in tensors_of(getattr(models, name)):
                # Pinned: the placement's home copies and the DiT's offloaded AdaLN weights alike.
                assert tensor.device.type == "cpu" and tensor.is_pinned(), name

    check_host_resident()
    outputs = [low_memory.generate(fl2va_request)[0]]
    check_host_resident()
    outputs.append(low_memory.generate(fl2va_request)[0])  # the DiT's cached AdaLN tables, same result
    check_host_resident()
    resident = Engine.from_checkpoint(checkpoint, device="cuda")
    expected, _ = resident.generate(fl2va_request)
    for output in outputs:
        for name in ("video", "audio", "video_latents", "audio_latents"):
            assert torch.equal(getattr(output, name), getattr(expected, name)), name


@pytest.mark.cuda
def test_a_low_memory_worker_rank_generates_what_the_resident_engine_does(
    checkpoint, fl2va_request, tmp_path
) -> None:
    resident = Engine.from_checkpoint(checkpoint, device="cuda:0")
    expected = tmp_path / "resident.safetensors"
    resident.generate_to_file(fl2va_request, tmp_path / "resident.mp4", save_tensors_path=expected)
    del resident
    torch.cuda.empty_cache()
    front = EngineFront(
        [ProcessReplica(checkpoint, ("cuda:0",), options=EngineOptions(memory_profile="low-memory"))],
        tmp_path,
    )
    try:
        got = tmp_path / "rank.safetensors"
        handle = front.submit(fl2va_request, tmp_path / "rank.mp4", got)
        event = handle.next_event(timeout=EVENT_TIMEOUT_S)
        while event is not None and not isinstance(event, TERMINAL_EVENTS):
            event = handle.next_event(timeout=EVENT_TIMEOUT_S)
        assert isinstance(event, JobFinished), event
        assert json.loads(Path(event.sidecar_path).read_text())["memory_profile"] == "low-memory"
        got_tensors, expected_tensors = load_file(got), load_file(expected)
        for name, tensor in expected_tensors.items():
            assert torch.equal(got_tensors[name], tensor), name
    finally:
        front.shutdown()
