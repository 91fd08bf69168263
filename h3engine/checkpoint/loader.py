"""Loading the DiT and both VAEs from either released layout, and the text encoder, strictly.

Every component goes through the same two phases:
* `check`: read the config files and the safetensors headers, and compare the file's key set and shapes with
  the ones our module declares (converted to the file's naming for the diffusers layout). Nothing is read but
  headers, so the engine checks every component of every partition before it accepts a request.
* `load`: build the module on the meta device, read each tensor (whole, lazily, through `safe_open`), convert it to
  our naming, cast it to the dtype our module declares for it (which is how the released precision rules are kept:
  the DiT's fp32 islands stay fp32 when the rest is bf16, both VAEs stay fp32), and assign it on the target device.

Our modules' state-dict keys are the native checkpoint keys, so the native layout needs no renaming; the diffusers
layout is converted with the pure functions of `<component>_keys.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from h3engine.checkpoint import audio_vae_keys, dit_format, video_vae_keys
from h3engine.checkpoint.audio_vae_format import read_audio_vae_config
from h3engine.checkpoint.component_files import VAE_PREFIXES, open_component_file
from h3engine.checkpoint.dit_file_weights import DiTFileWeights
from h3engine.checkpoint.layout import CheckpointLayout, PartitionPaths, read_json
from h3engine.checkpoint.safetensors_io import (
    DeferredReads,
    FileExtent,
    WeightFiles,
    parked,
    placed,
    row_extents,
)
from h3engine.checkpoint.text_encoder_files import (
    check_text_encoder_files,
    open_text_encoder_files,
    read_text_encoder_tensors,
)
from h3engine.checkpoint.video_vae_format import read_video_vae_config
from h3engine.errors import CheckpointError
from h3engine.models.audio_vae import AudioVAE
from h3engine.models.dit import H3DiT
from h3engine.models.stored_linear import store_linears
from h3engine.models.text_encoder import H3TextEncoder
from h3engine.models.video_vae import VideoVAE

StateDict = dict[str, torch.Tensor]


def _identity(state: StateDict) -> StateDict:
    return state


@dataclass
class ComponentSource:
    """One component on disk: how to build our module and how to read and rename its tensors.

    `config` is the component's parsed config (DiTConfig, VideoVAEConfig, AudioVAEConfig): the sharded loaders of
    h3engine.models.parallel build from it and read the same `files`.
    """

    name: str
    config: Any
    build: Callable[[], torch.nn.Module]
    files: WeightFiles
    to_file_names: Callable[[StateDict], StateDict]
    from_file_names: Callable[[StateDict], StateDict]
    # One module key's tensor as loading makes it, on the host, in the given dtype (a deferred read, see `load`);
    # None: this layout cannot read a key alone (the diffusers VAEs, whose renames need their neighbours).
    read_key: Callable[[str, torch.dtype], torch.Tensor] | None = None
    # Where a module key's bytes lie in the files, when they are stored as the module holds them (None: unknown).
    key_extents: Callable[[str, torch.dtype], tuple[FileExtent, ...] | None] | None = None
    # A key the files store in FP8: its raw reader and extents (h3engine.checkpoint.safetensors_io.DeferredReads.fp8).
    key_fp8: Callable[[str], Any] | None = None

    def expected_state(self) -> StateDict:
        """Our module's state dict on the meta device (keys, shapes and target dtypes, no memory)."""
        with torch.device("meta"):
            return self.build().state_dict()

    def check(self) -> None:
        expected = self.to_file_names(self.expected_state())
        self.files.check({key: tuple(tensor.shape) for key, tensor in expected.items()})

    def load(self, device: torch.device, deferred: DeferredReads | None = None) -> torch.nn.Module:
        """The component on `device`; the keys `deferred` wants are not read: each gets a parked tensor and a
        reader (`read_key`)."""
        with torch.device("meta"):
            module = self.build()
        expected = module.state_dict()
        file_names = self.to_file_names(expected)
        self.files.check({key: tuple(tensor.shape) for key, tensor in file_names.items()})
        wanted = [key for key in expected if deferred is not None and deferred.wants(key)]
        if wanted and self.read_key is None:
            raise ValueError(f"{self.name}: this checkpoint layout cannot read its tensors one key at a time")
        remembered = [key for key in expected if deferred is not None and deferred.remembers(key)]
        for key in [*wanted, *remembered] if self.read_key is not None else []:
            dtype = expected[key].dtype
            extents = self.key_extents(key, dtype) if self.key_extents is not None else None
            fp8 = self.key_fp8(key) if self.key_fp8 is not None else None
            deferred.add(key, partial(self.read_key, key, dtype), extents, fp8)
        if self.to_file_names is _identity:
            # Native layout: stream tensor by tensor straight to the device, so the host never holds the whole model,
            # each tensor converted as it is read, so the device never holds a converted tensor beside its original.
            state = {}
            for key, tensor in expected.items():
                if key not in wanted:
                    state.update(self.from_file_names({key: self._read(key, tensor.dtype, device)}))
        else:
            # Each renamed tensor is dropped once placed, so at most one is held twice. The file tensors of deferred
            # keys (their whole attention and feed-forward, siblings included) are not read.
            skipped = set(self.to_file_names({key: expected[key] for key in wanted})) if wanted else set()
            native = self.from_file_names(
                {key: self.files.tensor(key) for key in file_names if key not in skipped}
            )
            state = {
                key: placed(native.pop(key), device, tensor.dtype)
                for key, tensor in expected.items()
                if key not in wanted
            }
        state.update({key: parked(expected[key].shape, expected[key].dtype) for key in wanted})
        module.load_state_dict(state, strict=True, assign=True)
        _materialize_computed_buffers(module, device)
        return module.eval().requires_grad_(False)

    def _read(self, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        try:
            return placed(self.files.tensor(key), device, dtype)
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"{self.files.infos[key].file}: cannot read tensor '{key}' ({error})"
            ) from None


def _materialize_computed_buffers(module: torch.nn.Module, device: torch.device) -> None:
    """Buffers that are not in the file (recomputed from the config) are rebuilt on the target device."""
    for submodule in module.modules():
        reset = getattr(submodule, "reset_computed_buffers", None)
        if reset is not None:
            reset(device)
    for name, buffer in module.named_buffers():
        if buffer.is_meta:
            raise RuntimeError(f"buffer '{name}' was neither loaded nor recomputed")


def read_dit_config(layout: CheckpointLayout, paths: PartitionPaths) -> Any:
    """The DiT config of a partition (h3engine.models.dit_config.DiTConfig) from its config.json, with the AdaLN form
    (exact or pruned) that its weight files' headers show (h3engine.checkpoint.dit_pruned; a single file that
    replaces the folder's weights, `paths.dit_weights`, is its reader's to inspect)."""
    config_path = paths.dit / "config.json"
    raw = read_json(config_path)
    try:
        if layout.kind == "native":
            config = dit_format.config_from_native(raw)
        else:
            config = dit_format.config_from_diffusers(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{config_path}: invalid DiT config ({error})") from None
    if paths.dit_weights is not None:
        return config
    return dit_format.adaln_form_of_files(WeightFiles.open(paths.dit), config, layout.kind == "native")


def read_video_vae_config_of(layout: CheckpointLayout, paths: PartitionPaths) -> Any:
    """The video VAE config of a partition (h3engine.models.video_vae.VideoVAEConfig) from its config files alone."""
    return _read_config("video VAE", read_video_vae_config, paths.video_vae, layout)[0]


def dit_source(layout: CheckpointLayout, paths: PartitionPaths, dtype: torch.dtype) -> ComponentSource:
    config = read_dit_config(layout, paths)
    if paths.dit_weights is not None:
        return dit_file_source(paths, config, dtype)
    native = layout.kind == "native"
    files = WeightFiles.open(paths.dit)
    return ComponentSource(
        name=f"{paths.partition} transformer",
        config=config,
        build=lambda: H3DiT(config, dtype=dtype),
        files=files,
        # The file's names and shapes are the module's for the native layout: only the QKV row order differs.
        to_file_names=_identity if native else partial(dit_format.module_to_diffusers, config=config),
        from_file_names=partial(
            dit_format.native_to_module if native else dit_format.diffusers_to_module, config=config
        ),
        read_key=partial(_read_dit_key, files, config),
        key_extents=lambda key, dtype: dit_format.module_extents(
            dit_format.as_native_files(files, config), config, key, dtype
        ),
        key_fp8=lambda key: dit_format.module_fp8(dit_format.as_native_files(files, config), config, key),
    )


def dit_file_source(paths: PartitionPaths, config: Any, dtype: torch.dtype) -> ComponentSource:
    """The DiT of `paths` from the single file that replaces its weights (`--dit FILE`: a community GGUF or ComfyUI
    single file): its config from the partition's folder with the AdaLN form the file's shapes show, its quantized
    linears kept as the file stores them (StoredLinear), its keys and QKV row order the module's own, so nothing is
    renamed or reordered."""
    file = paths.dit_weights
    files = DiTFileWeights.open_file(file, config)
    config = dit_format.adaln_form_from_shapes(files.logical_shapes, config, where=lambda key: str(file))
    files.config = config

    def build() -> torch.nn.Module:
        dit = H3DiT(config, dtype=dtype)
        store_linears(dit, files.stored_forms)
        return dit

    return _file_source(f"{paths.partition} transformer ({file.name})", config, build, files)


def _file_source(
    name: str, config: Any, build: Callable[[], torch.nn.Module], files: WeightFiles
) -> ComponentSource:
    """A component whose weight files (a community file's view) hold the module's own keys: nothing is renamed."""
    return ComponentSource(
        name=name,
        config=config,
        build=build,
        files=files,
        to_file_names=_identity,
        from_file_names=_identity,
        read_key=lambda key, dtype: placed(files.tensor(key), "cpu", dtype),
        key_extents=lambda key, dtype: row_extents(files.infos[key], dtype),
    )


def _read_dit_key(files: WeightFiles, config: Any, key: str, dtype: torch.dtype) -> torch.Tensor:
    """One module key of a DiT in either layout (a diffusers one read as native), QKV rows stacked, on the host."""
    native = dit_format.as_native_files(files, config)
    return placed(dit_format.native_to_module({key: native.tensor(key)}, config)[key], "cpu", dtype)


def video_vae_source(layout: CheckpointLayout, paths: PartitionPaths) -> ComponentSource:
    config, weights = _read_config("video VAE", read_video_vae_config, paths.video_vae, layout)
    if paths.video_vae_weights is not None:
        return component_file_source("video VAE", config, lambda: VideoVAE(config), paths.video_vae_weights)
    key_maps = (
        partial(video_vae_keys.native_to_diffusers, config=config),
        partial(video_vae_keys.diffusers_to_native, config=config),
    )
    return _component_source("video VAE", layout, config, lambda: VideoVAE(config), weights, key_maps)


def audio_vae_source(layout: CheckpointLayout, paths: PartitionPaths) -> ComponentSource:
    config, weights = _read_config("audio VAE", read_audio_vae_config, paths.audio_vae, layout)
    if paths.audio_vae_weights is not None:
        return component_file_source("audio VAE", config, lambda: AudioVAE(config), paths.audio_vae_weights)
    key_maps = (audio_vae_keys.native_to_diffusers, audio_vae_keys.diffusers_to_native)
    return _component_source("audio VAE", layout, config, lambda: AudioVAE(config), weights, key_maps)


def component_file_source(
    name: str, config: Any, build: Callable[[], torch.nn.Module], file: Path
) -> ComponentSource:
    """A VAE whose weights are the single file `file` (`--video-vae` / `--audio-vae`), its config its folder's: the
    file's names are the module's (behind a prefix, h3engine.checkpoint.component_files), so nothing is renamed;
    each tensor is cast (a quantized one dequantized) to the dtype the module declares for it."""
    with torch.device("meta"):
        expected = build().state_dict()
    files = open_component_file(file, name, expected, VAE_PREFIXES)
    return _file_source(f"{name} ({file.name})", config, build, files)


def _read_config(
    what: str, read: Callable[..., tuple[Any, Path]], folder: Path, layout: CheckpointLayout
) -> tuple[Any, Path]:
    """`read(folder, native=...)`: a component's config and the path of its weights; an invalid config field
    becomes a CheckpointError naming the folder's config.json."""
    try:
        return read(folder, native=layout.kind == "native")
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{folder / 'config.json'}: invalid {what} config ({error})") from None


def _component_source(
    name: str,
    layout: CheckpointLayout,
    config: Any,
    build: Callable[[], torch.nn.Module],
    weights: Path,
    key_maps: tuple[Callable[[StateDict], StateDict], Callable[[StateDict], StateDict]],
) -> ComponentSource:
    """A component whose weights are `weights` in `layout`, renamed by `key_maps` (native -> diffusers, back)
    in the diffusers layout only."""
    native = layout.kind == "native"
    to_diffusers, to_native = key_maps
    files = WeightFiles.open(weights)
    return ComponentSource(
        name=name,
        config=config,
        build=build,
        files=files,
        to_file_names=_identity if native else to_diffusers,
        from_file_names=_identity if native else to_native,
        read_key=(lambda key, dtype: placed(files.tensor(key), "cpu", dtype)) if native else None,
        key_extents=(lambda key, dtype: row_extents(files.infos[key], dtype)) if native else None,
    )


def check_text_encoder(folder: Path, weights: Path | None = None) -> None:
    """Check the text encoder of `folder` (its weights those of `weights` where given) by headers alone: every tensor
    H3 needs at its shape, nothing unknown (CheckpointError naming the file and the tensor)."""
    config, weight_files = open_text_encoder_files(folder, weights)
    with torch.device("meta"):
        encoder = H3TextEncoder(config)
    check_text_encoder_files(encoder, weight_files)


def text_encoder_skeleton(
    folder: Path, weights: Path | None = None
) -> tuple[WeightFiles, Callable[[], H3TextEncoder]]:
    """The text encoder's weight files (headers) and a builder of the module they fill, a community file's quantized
    linears as StoredLinear layers (build it on meta to name its tensors)."""
    config, weight_files = open_text_encoder_files(folder, weights, keep_quantized=True)

    def build() -> H3TextEncoder:
        encoder = H3TextEncoder(config)
        store_linears(encoder, getattr(weight_files, "stored_forms", {}))
        return encoder

    return weight_files, build


def load_text_encoder(
    folder: Path,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    deferred: DeferredReads | None = None,
    weights: Path | None = None,
) -> H3TextEncoder:
    """H3's text encoder from a stock Qwen3-VL `text_encoder/` folder, reading only the tensors H3 needs (see
    `text_encoder_files`): our module's keys are the stock keys, so nothing is renamed. The keys `deferred` wants are
    left unread (a parked tensor and a reader each). `weights`: a single file replacing the folder's weights, its
    quantized linears kept so (StoredLinear)."""
    weight_files, skeleton = text_encoder_skeleton(folder, weights)
    device = torch.device(device)
    with torch.device("meta"):
        encoder = skeleton()
    needed_shapes = check_text_encoder_files(encoder, weight_files)
    read_text_encoder_tensors(encoder, weight_files, needed_shapes, device, dtype, deferred)
    encoder.rebuild_computed_buffers(device)
    return encoder.eval().requires_grad_(False)
