"""Loading the DiT and both VAEs from either released layout, strictly.

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
from typing import Any

import torch
import yaml

from h3engine.checkpoint import audio_vae_keys, dit_format, video_vae_keys
from h3engine.checkpoint.layout import CheckpointLayout, PartitionPaths, read_json
from h3engine.checkpoint.safetensors_io import WeightFiles, placed
from h3engine.errors import CheckpointError
from h3engine.models.audio_vae import AudioVAE, AudioVAEConfig
from h3engine.models.dit import H3DiT
from h3engine.models.video_vae import VideoVAE, VideoVAEConfig

StateDict = dict[str, torch.Tensor]


def _identity(state: StateDict) -> StateDict:
    return state


@dataclass
class ComponentSource:
    """One component on disk: how to build our module and how to read and rename its tensors.

    `config` is the component's parsed config (DiTConfig, VideoVAEConfig, AudioVAEConfig): the sharded loaders of
    h3engine.parallel build from it and read the same `files`.
    """

    name: str
    config: Any
    build: Callable[[], torch.nn.Module]
    files: WeightFiles
    to_file_names: Callable[[StateDict], StateDict]
    from_file_names: Callable[[StateDict], StateDict]

    def expected_state(self) -> StateDict:
        """Our module's state dict on the meta device (keys, shapes and target dtypes, no memory)."""
        with torch.device("meta"):
            return self.build().state_dict()

    def check(self) -> None:
        expected = self.to_file_names(self.expected_state())
        self.files.check({key: tuple(tensor.shape) for key, tensor in expected.items()})

    def load(self, device: torch.device) -> torch.nn.Module:
        with torch.device("meta"):
            module = self.build()
        expected = module.state_dict()
        file_names = self.to_file_names(expected)
        self.files.check({key: tuple(tensor.shape) for key, tensor in file_names.items()})
        if self.to_file_names is _identity:
            # Native layout: stream tensor by tensor straight to the device, so the host never holds the whole model.
            file_state = {key: self._read(key, tensor.dtype, device) for key, tensor in expected.items()}
            state = self.from_file_names(file_state)
        else:
            file_state = {key: self.files.tensor(key) for key in file_names}
            native = self.from_file_names(file_state)
            state = {key: placed(native[key], device, tensor.dtype) for key, tensor in expected.items()}
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


def _read_yaml(path) -> dict:
    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise CheckpointError(f"{path}: unreadable YAML ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a YAML mapping")
    return value


def dit_source(layout: CheckpointLayout, paths: PartitionPaths, dtype: torch.dtype) -> ComponentSource:
    config_path = paths.dit / "config.json"
    raw = read_json(config_path)
    try:
        if layout.kind == "native":
            config = dit_format.config_from_native(raw)
        else:
            config = dit_format.config_from_diffusers(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{config_path}: invalid DiT config ({error})") from None
    native = layout.kind == "native"
    return ComponentSource(
        name=f"{paths.partition} transformer",
        config=config,
        build=lambda: H3DiT(config, dtype=dtype),
        files=WeightFiles.open(paths.dit),
        # The file's names and shapes are the module's for the native layout: only the QKV row order differs.
        to_file_names=_identity if native else partial(dit_format.module_to_diffusers, config=config),
        from_file_names=partial(
            dit_format.native_to_module if native else dit_format.diffusers_to_module, config=config
        ),
    )


def video_vae_source(layout: CheckpointLayout, paths: PartitionPaths) -> ComponentSource:
    wrapper_path = paths.video_vae / "config.json"
    wrapper = read_json(wrapper_path)
    try:
        if layout.kind == "native":
            source_folder = paths.video_vae / wrapper.get("source_path", "source")
            source_config_path = source_folder / "config.json"
            config = VideoVAEConfig.from_native(wrapper, read_json(source_config_path))
            weights = source_folder / wrapper.get("source_safetensors_path", "model.safetensors")
        else:
            config = VideoVAEConfig.from_diffusers(wrapper)
            weights = paths.video_vae
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{wrapper_path}: invalid video VAE config ({error})") from None
    native = layout.kind == "native"
    return ComponentSource(
        name="video VAE",
        config=config,
        build=lambda: VideoVAE(config),
        files=WeightFiles.open(weights),
        to_file_names=_identity if native else partial(video_vae_keys.native_to_diffusers, config=config),
        from_file_names=_identity if native else partial(video_vae_keys.diffusers_to_native, config=config),
    )


def audio_vae_source(layout: CheckpointLayout, paths: PartitionPaths) -> ComponentSource:
    config_path = paths.audio_vae / "config.json"
    raw = read_json(config_path)
    try:
        if layout.kind == "native":
            metadata = read_json(paths.audio_vae / raw.get("source_metadata_path", "metadata.json"))
            yaml_path = paths.audio_vae / raw.get("source_config_path", "config.yaml")
            config = AudioVAEConfig.from_native(
                raw, metadata, _read_yaml(yaml_path) if yaml_path.is_file() else None
            )
            weights = paths.audio_vae / raw.get("source_safetensors_path", "model.safetensors")
        else:
            config = AudioVAEConfig.from_diffusers(raw)
            weights = paths.audio_vae
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{config_path}: invalid audio VAE config ({error})") from None
    native = layout.kind == "native"
    return ComponentSource(
        name="audio VAE",
        config=config,
        build=lambda: AudioVAE(config),
        files=WeightFiles.open(weights),
        to_file_names=_identity if native else audio_vae_keys.native_to_diffusers,
        from_file_names=_identity if native else audio_vae_keys.diffusers_to_native,
    )
