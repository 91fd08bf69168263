"""Layer streaming (h3engine.memory.streaming) and the streamed placement: the same outputs as resident weights, bit
for bit, because the same math runs on the same values; and the ring really streams (k layers ahead, cyclically).

What is compared: a tiny DiT with every ring depth and number of resident layers against itself resident; the
order in which a ring fills its slots (layer i + depth starts copying into the slot layer i frees); an engine under
the `streamed` profile against the resident one for T2VA, FL2VA and Ref2VA, with and without a LoRA, at world size
1 and on two gloo ranks; FP8 storage against the dequantized weights it stands for. How a broken prefetch shows: a
ring that fetches the wrong layer next restarts (counted) and copies more; a ring that points a layer at another
layer's slot computes different outputs. Both are checked here to fail.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _dit_helpers import tiny_fl2va_request
from _lora_helpers import small_lora, write_lora
from _refusals import cli_refused
from _runtime_helpers import events_until_done, parity_requests
from safetensors.torch import load_file

from h3engine.cli.main import main
from h3engine.engine.conditioning.text_states import TEXT_STATES
from h3engine.engine.engine import Engine
from h3engine.engine.options import EngineOptions
from h3engine.memory.homes import dequantized, quantizable
from h3engine.memory.layers import dit_layers
from h3engine.memory.placement import Placement
from h3engine.memory.plan import RESIDENT, ModelPlacement, resident_plan
from h3engine.memory.stream_layout import streamed_tensors
from h3engine.memory.streaming import LayerStream
from h3engine.models.dit import H3DiT
from h3engine.models.dit_config import DiTConfig
from h3engine.request.model import LoraChoice
from h3engine.runtime.front import EngineFront
from h3engine.runtime.messages import JobFinished
from h3engine.runtime.workers import ProcessReplica

EVENT_TIMEOUT_S = 300
OUTPUTS = ("video", "audio", "video_latents", "audio_latents")


# --- the ring on a DiT ------------------------------------------------------------------------------------------


def random_dit(num_layers: int = 5, dtype: torch.dtype = torch.float32, **widths: int) -> H3DiT:
    """A tiny DiT with `num_layers` blocks (+ 1 refiner block), every weight drawn (no block is an identity)."""
    config = dataclasses.replace(DiTConfig.tiny(), num_layers=num_layers, **widths)
    torch.manual_seed(0)
    dit = H3DiT(config, dtype=dtype)
    with torch.no_grad():
        for parameter in dit.parameters():
            parameter.normal_(0.0, 0.3)
    return dit.eval().requires_grad_(False)


def copy_of(dit: H3DiT) -> H3DiT:
    twin = H3DiT(dit.config, dtype=dit.compute_dtype)
    twin.load_state_dict(dit.state_dict())
    return twin.eval().requires_grad_(False)


def forward(dit: H3DiT, request) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        return dit(*request.as_h3_arguments())


@pytest.fixture(scope="module")
def dit_and_request():
    dit = random_dit()
    request = tiny_fl2va_request(dit.config, torch.float32, seed=1)
    return dit, request, forward(dit, request)


@pytest.mark.parametrize(("depth", "resident_layers"), [(1, 0), (2, 0), (3, 2), (6, 0), (9, 1)])
def test_a_streamed_dit_computes_what_the_resident_one_does(dit_and_request, depth, resident_layers) -> None:
    dit, request, expected = dit_and_request
    streamed = copy_of(dit)
    stream = LayerStream(dit_layers(streamed), resident_layers, "cpu", depth)
    layers = len(stream.layers)
    for forward_number in range(1, 4):
        got = forward(streamed, request)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert stream.visits == forward_number * layers and stream.restarts == 0
    # Every visit after the first `depth` layers was fetched by the release of the layer `depth` visits before.
    assert stream.copied_bytes == (stream.depth + 3 * layers) * stream.images[0].numel()


def test_between_visits_a_streamed_layer_holds_no_weights(dit_and_request) -> None:
    dit, _, _ = dit_and_request
    streamed = copy_of(dit)
    LayerStream(dit_layers(streamed), 0, "cpu", 2)
    weight = streamed.blocks[0].attn.qkv_proj.weight
    assert weight.shape == dit.blocks[0].attn.qkv_proj.weight.shape and weight.stride() == (0, 0)
    assert torch.isnan(weight).all()
    # What is not streamed (norms, AdaLN projections) keeps its values.
    assert torch.equal(streamed.blocks[0].norm1.weight, dit.blocks[0].norm1.weight)
    assert torch.equal(streamed.blocks[0].adaln_proj.linear.weight, dit.blocks[0].adaln_proj.linear.weight)


class RecordingStream(LayerStream):
    """Notes every slot fill and every visit, in order."""

    def __init__(self, *args, **kwargs) -> None:
        self.log: list[tuple[str, int, int]] = []
        super().__init__(*args, **kwargs)

    def _fill_slot(self, layer: int, slot: int) -> None:
        self.log.append(("fill", layer, slot))
        super()._fill_slot(layer, slot)

    def acquire(self, layer: int) -> None:
        super().acquire(layer)
        self.log.append(("compute", layer, self._current[1]))


def test_the_ring_fetches_depth_layers_ahead_cyclically(dit_and_request) -> None:
    dit, request, _ = dit_and_request
    streamed = copy_of(dit)
    stream = RecordingStream(dit_layers(streamed), 0, "cpu", 3)
    layers = len(stream.layers)
    for _ in range(2):
        forward(streamed, request)
    expected = [("fill", 0, 0), ("fill", 1, 1), ("fill", 2, 2)]
    for visit in range(2 * layers):
        layer, slot = visit % layers, visit % 3
        expected += [("compute", layer, slot), ("fill", (visit + 3) % layers, slot)]
    assert stream.log == expected


def test_a_ring_that_fetches_the_wrong_layer_next_is_caught(dit_and_request) -> None:
    dit, request, expected = dit_and_request
    streamed = copy_of(dit)
    stream = LayerStream(dit_layers(streamed), 0, "cpu", 3)
    stream._following = lambda layer: (layer + 2) % len(stream.layers)
    got = forward(streamed, request)
    # The ring notices each visit it did not prepare and reloads (still correct, but every such visit is a stall).
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert stream.restarts > 0


def test_a_ring_that_points_a_layer_at_another_slot_computes_something_else(dit_and_request) -> None:
    dit, request, expected = dit_and_request
    streamed = copy_of(dit)
    stream = LayerStream(dit_layers(streamed), 0, "cpu", 3)
    original = stream.acquire

    def off_by_one_slot(layer: int) -> None:
        original(layer)
        wrong = stream._slots[(stream._current[1] + 1) % stream.depth]
        for placed in stream.tensors[layer]:
            placed.tensor.data = placed.in_slot(wrong)

    stream.acquire = off_by_one_slot
    for index, layer in enumerate(stream.layers):
        layer.get_submodule("attn")._forward_pre_hooks.clear()
        layer.get_submodule("attn").register_forward_pre_hook(lambda m, a, i=index: stream.acquire(i))
    got = forward(streamed, request)
    assert not torch.equal(got[0], expected[0])


def test_fp8_storage_streams_the_weights_it_stands_for() -> None:
    # Wide enough that the 256-byte alignment of each tensor in the home is a small share of its bytes.
    dit = random_dit(dtype=torch.bfloat16, hidden_size=256, num_heads=4, head_dim=64, ffn_dim=512)
    request = tiny_fl2va_request(dit.config, torch.bfloat16, seed=2)
    bf16 = forward(dit, request)
    reference = copy_of(dit)
    for layer in dit_layers(reference).layers:
        for _, _, tensor in streamed_tensors(dit_layers(reference), layer):
            if quantizable(tensor):
                tensor.data = dequantized(tensor.data)
    expected = forward(reference, request)
    streamed = copy_of(dit)
    stream = LayerStream(dit_layers(streamed), 0, "cpu", 2, quantize=True)
    got = forward(streamed, request)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not torch.equal(got[0], bf16[0])
    # The home holds e4m3 values and row scales: about half the bf16 bytes.
    bf16_bytes = sum(t.numel() * 2 for _, _, t in streamed_tensors(dit_layers(dit), dit.blocks[0]))
    assert 0.5 <= stream.images[-1].numel() / bf16_bytes < 0.52


# --- the engine under the streamed profile ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> Path:
    return tiny_checkpoints("native", seed=7)


@pytest.fixture(scope="module")
def engines(checkpoint):
    return {
        profile: Engine.from_checkpoint(checkpoint, device="cpu", memory_profile=profile)
        for profile in ("resident", "streamed")
    }


@pytest.fixture(scope="module")
def lora_files(checkpoint, tmp_path_factory, engines) -> dict[str, Path]:
    """task -> a LoRA file for its DiT (keys prefixed `transformer.` or `transformer_ref.`)."""
    folder = tmp_path_factory.mktemp("lora")
    files = {}
    for task, layout in (("t2va", "diffusers"), ("fl2va", "diffusers"), ("ref2va", "diffusers_ref")):
        config = engines["resident"].store.dit_config(engines["resident"].store.partition_for(task))
        files[task] = folder / f"{layout}.safetensors"
        write_lora(files[task], small_lora(config, 4), layout, config)
    return files


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_the_streamed_engine_generates_what_the_resident_one_does(
    engines, lora_files, task, with_lora
) -> None:
    request = parity_requests(steps=2, seed=5)[task]
    if with_lora:
        request = dataclasses.replace(request, loras=(LoraChoice(str(lora_files[task]), 0.7),))
    expected, _ = engines["resident"].generate(request)
    streamed_engine = engines["streamed"]
    models = streamed_engine.store.models_for_task(task)
    streams = {
        name: streamed_engine.placement.stream_of(getattr(models, name))
        for name in ("dit", "text_encoder", "video_vae")
    }
    visits = {name: stream.visits for name, stream in streams.items()}
    TEXT_STATES.forget(
        models.text_encoder
    )  # the same prompt ran before: stream the encoder again all the same
    got, _ = streamed_engine.generate(request)
    for name in OUTPUTS:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    for name, stream in streams.items():
        assert stream.visits > visits[name] and stream.restarts == 0, name
        assert not stream.is_open, name  # each phase closed its ring


def test_streamed_worker_ranks_generate_what_resident_ranks_do(checkpoint, lora_files, tmp_path) -> None:
    """Two gloo ranks (Ulysses 2 x TP 1 DiT, TP 2 text encoder: each rank streams its shards) for each task, and
    T2VA and Ref2VA with a LoRA (each rank applies its slice of the factors)."""
    requests = parity_requests(steps=2, seed=9)
    for task in ("t2va", "ref2va"):
        requests[f"{task}+lora"] = dataclasses.replace(
            requests[task], loras=(LoraChoice(str(lora_files[task]), 0.7),)
        )
    tensors: dict[str, dict[str, Path]] = {}
    for profile in ("resident", "streamed"):
        replica = ProcessReplica(
            checkpoint, ("cpu", "cpu"), options=EngineOptions(dtype="float32", memory_profile=profile)
        )
        front = EngineFront([replica], tmp_path / profile)
        try:
            tensors[profile] = {}
            for task, request in requests.items():
                path = tmp_path / profile / f"{task}.safetensors"
                handle = front.submit(request, tmp_path / profile / f"{task}.mp4", path)
                events = events_until_done(handle, EVENT_TIMEOUT_S)
                assert isinstance(events[-1], JobFinished), events[-1]
                tensors[profile][task] = path
        finally:
            front.shutdown()
    for task in requests:
        resident, streamed = load_file(tensors["resident"][task]), load_file(tensors["streamed"][task])
        for name, tensor in resident.items():
            assert torch.equal(streamed[name], tensor), (task, name)
    for task in ("t2va", "ref2va"):  # the adapter did change what the streamed ranks computed
        adapted, base = (load_file(tensors["streamed"][name])["video"] for name in (f"{task}+lora", task))
        assert not torch.equal(adapted, base), task


# --- both DiT partitions warm in host memory -----------------------------------------------------------------------


class WarmPartitions(Engine):
    """Everything resident, both DiT partitions with a host home; "the device" copies are CPU clones, so which
    partition is on the device shows as which DiT's tensors no longer share storage with their home."""

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        plan = dataclasses.replace(resident_plan(), other_partition_home="pinned")
        return Placement(plan, device, transfer=torch.clone)


def at_home(placement: Placement, module: torch.nn.Module) -> bool:
    return all(tensor.data_ptr() == home.data_ptr() for tensor, home in placement._held[module].warm)


def away(placement: Placement, module: torch.nn.Module) -> bool:
    return all(tensor.data_ptr() != home.data_ptr() for tensor, home in placement._held[module].warm)


def test_a_partition_switch_moves_one_dit_home_and_the_other_onto_the_device(checkpoint, engines) -> None:
    engine = WarmPartitions.from_checkpoint(checkpoint, device="cpu")
    requests = parity_requests(steps=1, seed=2)
    dits = {task: engine.store.models_for_task(task).dit for task in ("t2va", "ref2va")}
    placement = engine.placement
    assert all(placement._held[dit].warm for dit in dits.values())
    for task in ("t2va", "ref2va", "t2va", "ref2va"):
        got, _ = engine.generate(requests[task])
        expected, _ = engines["resident"].generate(requests[task])
        assert torch.equal(got.video, expected.video) and torch.equal(got.audio, expected.audio), task
        other = "ref2va" if task == "t2va" else "t2va"
        assert away(placement, dits[task]) and at_home(placement, dits[other]), task
        assert engine.store.partition_on_device == engine.store.partition_for(task)


# --- homes in the memory-mapped checkpoint files -------------------------------------------------------------------


class MappedEngine(Engine):
    """Every model's layers streamed straight from the checkpoint files (no host copy), the DiT's first block
    resident; the rest resident."""

    def _make_placement(self, memory_profile: str, device: torch.device) -> Placement:
        mapped = ModelPlacement(layers="streamed", other="resident", home="mapped", ring_depth=2)
        models = {name: mapped for name in ("text_encoder", "video_vae")}
        models["dit"] = dataclasses.replace(mapped, resident_layers=1)
        models["audio_vae"] = RESIDENT
        return Placement(dataclasses.replace(resident_plan(), models=models), device)


@pytest.mark.parametrize("layout", ["native", "diffusers"])
def test_layers_streamed_from_the_mapped_files_compute_what_resident_ones_do(
    tiny_checkpoints, layout
) -> None:
    checkpoint = tiny_checkpoints(layout, seed=7)
    resident = Engine.from_checkpoint(checkpoint, device="cpu", memory_profile="resident")
    mapped = MappedEngine.from_checkpoint(checkpoint, device="cpu")
    for task, request in parity_requests(steps=2, seed=4).items():
        expected, _ = resident.generate(request)
        got, _ = mapped.generate(request)
        for name in OUTPUTS:
            assert torch.equal(getattr(got, name), getattr(expected, name)), (layout, task, name)
    models = mapped.store.models_for_task("ref2va")
    dit_stream = mapped.placement.stream_of(models.dit)
    encoder_stream = mapped.placement.stream_of(models.text_encoder)
    for stream in (dit_stream, encoder_stream):  # nothing held: read at each visit, through the host ring
        assert all(image is None for image in stream.images) and stream.layer_reads >= stream.visits > 0
    assert (
        dit_stream.visits > 0 and dit_stream.restarts == 0 and len(dit_stream.layers) == 2
    )  # 1 refiner + 2 - 1
    # The diffusers layout's video VAE renames need their neighbours: its layers wait in host memory instead.
    video_stream = mapped.placement.stream_of(models.video_vae)
    assert (
        all(image is None for image in video_stream.images) == (layout == "native")
        and video_stream.visits > 0
    )


# --- FP8 weight storage ----------------------------------------------------------------------------------------


def test_fp8_weights_compute_the_same_resident_or_streamed_and_their_error_is_measured(engines) -> None:
    """`--weights fp8` rounds the DiT's and the text encoder's large linears (and the AdaLN projections) through e4m3
    with row scales: resident (dequantized at load) and streamed (dequantized into the ring) compute with the same
    values, so their outputs are equal bit for bit; against bf16 the outputs move, by a relative error reported here
    (on random weights it says nothing about picture quality)."""
    checkpoint = engines["resident"].layout.root
    request = parity_requests(steps=2, seed=6)["t2va"]
    bf16, _ = engines["resident"].generate(request)
    outputs = {}
    for profile in ("resident", "streamed"):
        engine = Engine.from_checkpoint(checkpoint, device="cpu", memory_profile=profile, weights="fp8")
        assert engine.record()["weight_format"] == "fp8"
        outputs[profile], _ = engine.generate(request)
    for name in OUTPUTS:
        assert torch.equal(getattr(outputs["streamed"], name), getattr(outputs["resident"], name)), name
    latents, reference = outputs["resident"].video_latents.double(), bf16.video_latents.double()
    relative_l2 = (torch.linalg.vector_norm(latents - reference) / torch.linalg.vector_norm(reference)).item()
    # e4m3 keeps 3 mantissa bits: each weight moves by up to 2^-4 of itself; two steps of a tiny model stay close.
    assert 1e-4 < relative_l2 < 0.2, relative_l2


# --- the flags ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "field", "says"),
    [
        # parse_gib's wording: tests/test_memory_plan.py.
        (["--gpu-memory", "abc"], "--gpu-memory", None),
        (["--host-memory", "-3"], "--host-memory", None),
        (["--weights", "int4"], "--weights", "expected one of bf16, fp8, got 'int4'"),
    ],
)
def test_the_cli_refuses_a_bad_memory_flag_naming_it(
    capsys, checkpoint, tmp_path, flags, field, says
) -> None:
    arguments = ["generate", "--checkpoint", str(checkpoint), "--prompt", "a fox", "--device", "cpu"]
    assert main([*arguments, "--out", str(tmp_path / "o.mp4"), *flags]) == 2
    problem = cli_refused(capsys.readouterr().err, field)
    assert says is None or problem == says
    assert not list(tmp_path.iterdir())


def test_the_cli_streams_in_fp8_and_the_sidecar_says_how(capsys, checkpoint, tmp_path) -> None:
    out = tmp_path / "clip.mp4"
    arguments = [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "a fox",
        "--device",
        "cpu",
        "--steps",
        "2",
    ]
    flags = ["--memory-profile", "streamed", "--weights", "fp8", "--quiet"]
    assert main([*arguments, "--out", str(out), *flags]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["weight_format"] == "fp8" and sidecar["memory_profile"] == "streamed"
    assert sidecar["memory_plan"]["dit"].startswith("streamed (ring of 2")


def test_fp8_linears_stream_their_fp8_buffers(checkpoint) -> None:
    """`--fp8-linear` swaps the blocks' linears for FP8 layers made from the loaded weights (so those layers are read
    at load, not deferred); a streamed DiT then streams their e4m3 weights and scales as they are."""
    request = parity_requests(steps=2, seed=1)["t2va"]
    outputs = {}
    for profile in ("resident", "streamed"):
        engine = Engine.from_checkpoint(checkpoint, device="cpu", memory_profile=profile, fp8_linear=True)
        outputs[profile], _ = engine.generate(request)
    for name in OUTPUTS:
        assert torch.equal(getattr(outputs["streamed"], name), getattr(outputs["resident"], name)), name
    stream = engine.placement.stream_of(engine.store.models_for_task("t2va").dit)
    assert {placed.dtype for placed in stream.tensors[-1]} >= {torch.float8_e4m3fn, torch.float32}
    assert stream.visits > 0 and stream.restarts == 0
