"""Tiny random-weight checkpoints in the released folder layouts.

The app's default and every test run on these: the same folder tree, file names, config fields and key sets as the
released MiniMax H3 checkpoint (native per-partition layout or the diffusers root layout), with tiny shapes and
weights drawn from seeded generators so that the same seed gives byte-identical files. Both layouts written from
one seed hold the same weights, so they must generate the same output.

Canvas rules: at the released 768-pixel short edge a tiny VAE (spatial ratio 4) would give ~600k rows per request,
so tiny checkpoints carry a 32-pixel short edge: in the diffusers index as the pipeline configs diffusers reads
(`canvas_short_edge`, `canvas_max_pixels`, `reference_image_short_edge`), and in the native `_minimax_h3` block
under the same names (our extension; the release does not set them and gets the 768 defaults). `dmd_steps` writes a
step-distilled checkpoint: `_minimax_h3.dmd_denoising_steps` in both native partitions (the diffusers layout has no
`_minimax_h3` block, so it cannot carry the rungs).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3engine.checkpoint import (
    audio_vae_format,
    audio_vae_keys,
    dit_format,
    dit_keys,
    video_vae_format,
    video_vae_keys,
)
from h3engine.checkpoint.layout import (
    DIFFUSERS_PIPELINE_CLASS,
    NATIVE_PARTITION_FOLDERS,
    require_empty_folder,
    valid_dmd_steps,
)
from h3engine.checkpoint.text_encoder_files import (
    write_tiny_processor,
    write_tiny_text_encoder,
    write_tiny_tokenizer,
)
from h3engine.models.audio_vae import AudioVAEConfig
from h3engine.models.dit_config import DiTConfig
from h3engine.models.video_vae import VideoVAEConfig

TINY_CANVAS = {"canvas_short_edge": 32, "canvas_max_pixels": 32 * 56, "reference_image_short_edge": 64}
SHIFTS = {"video": 12.0, "audio": 3.0}
PARTITION_TASKS = {"fl2va": ["t2va", "fl2va"], "ref2va": ["ref2va"]}
# Each component draws from its own generator so adding a component never changes another one's weights.
COMPONENT_SEED_OFFSETS = {"fl2va": 1, "ref2va": 2, "video_vae": 3, "audio_vae": 4, "text_encoder": 5}
DIFFUSERS_VERSION = "0.42.1"


def component_seed(seed: int, component: str) -> int:
    return seed * 16 + COMPONENT_SEED_OFFSETS[component]


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def save_sharded(
    state: dict[str, torch.Tensor], folder: Path, stem: str, num_shards: int, index_name: str
) -> None:
    """Split a state dict over `num_shards` files named like the release and write the weight-map index."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    per_shard = -(-len(keys) // num_shards)
    weight_map, total_size = {}, 0
    for shard in range(num_shards):
        name = f"{stem}-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        shard_keys = keys[shard * per_shard : (shard + 1) * per_shard]
        save_file(
            {key: state[key].contiguous() for key in shard_keys},
            str(folder / name),
            metadata={"format": "pt"},
        )
        for key in shard_keys:
            weight_map[key] = name
            total_size += state[key].numel() * state[key].element_size()
    write_json(folder / index_name, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def make_tiny_checkpoint(
    folder: str | Path, seed: int = 0, layout: str = "native", dmd_steps: Sequence[int] | None = None
) -> Path:
    """Write a complete tiny checkpoint (both partitions) into an empty or missing `folder`; with `dmd_steps`
    (strictly decreasing integers in (0, 1000]) a step-distilled one, native layout only."""
    folder = Path(folder)
    require_empty_folder(folder)
    if layout not in ("native", "diffusers"):
        raise ValueError(f"layout must be 'native' or 'diffusers', got {layout!r}")
    if dmd_steps is not None:
        dmd_steps = _checked_dmd_steps(dmd_steps, layout)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if layout == "native":
        _write_native(staging, seed, dmd_steps)
    else:
        _write_diffusers(staging, seed)
    if folder.exists():
        folder.rmdir()
    staging.rename(folder)
    return folder


def _checked_dmd_steps(dmd_steps: Sequence[int], layout: str) -> list[int]:
    rungs = list(dmd_steps)
    if layout != "native":
        raise ValueError("dmd_steps: only the native layout has a _minimax_h3 block to carry them")
    if not valid_dmd_steps(rungs):
        raise ValueError(f"dmd_steps: must be strictly decreasing integers in (0, 1000], got {rungs}")
    return rungs


def _tiny_configs() -> tuple[DiTConfig, VideoVAEConfig, AudioVAEConfig]:
    return DiTConfig.tiny(), VideoVAEConfig.tiny(), AudioVAEConfig.tiny()


def _write_text_side(folder: Path, seed: int, text_dim: int) -> None:
    write_tiny_text_encoder(folder / "text_encoder", component_seed(seed, "text_encoder"), text_dim=text_dim)
    write_tiny_tokenizer(folder / "tokenizer")
    write_tiny_processor(folder / "processor")


@dataclass(frozen=True)
class NativeWeightWriters:
    """How `write_native_tree` writes a tree's weight files: this module draws and saves tiny weights, and
    h3engine.checkpoint.placeholder writes header-only files."""

    dit: Callable[[str, DiTConfig, Path], None]  # (partition, config, the transformer folder)
    video_vae: Callable[[VideoVAEConfig, Path], None]  # (config, the model.safetensors path)
    audio_vae: Callable[[AudioVAEConfig, Path], None]
    text_side: Callable[
        [Path, int], None
    ]  # (the partition folder, the DiT's text_dim): encoder, tokenizer, processor


def write_native_tree(
    root: Path,
    configs: tuple[DiTConfig, VideoVAEConfig, AudioVAEConfig],
    canvas: dict[str, int],
    writers: NativeWeightWriters,
    dmd_steps: list[int] | None = None,
    partitions: Iterable[str] | None = None,
) -> None:
    """Both native partition folders under `root` (or those `partitions` names): configs written here, weight files by
    `writers`; `canvas` goes into `_minimax_h3` (empty: the released 768 defaults)."""
    dit_config, video_config, audio_config = configs
    wanted = set(NATIVE_PARTITION_FOLDERS) if partitions is None else set(partitions)
    if not wanted or not wanted <= set(NATIVE_PARTITION_FOLDERS):
        raise ValueError(
            f"partitions must be some of {', '.join(NATIVE_PARTITION_FOLDERS)}, got {sorted(wanted)}"
        )
    for partition, folder_name in NATIVE_PARTITION_FOLDERS.items():
        if partition not in wanted:
            continue
        folder = root / folder_name
        write_json(
            folder / "model_index.json",
            {
                "_class_name": "MiniMaxH3Pipeline",
                "_diffusers_version": "0.32.2",
                "text_encoder": ["transformers", "MiniMaxH3Qwen3VLHFEncoder"],
                "tokenizer": ["transformers", "Qwen2TokenizerFast"],
                "processor": ["transformers", "Qwen3VLProcessor"],
                "video_vae": ["diffusers", "MiniMaxH3VideoVAE"],
                "audio_vae": ["diffusers", "MiniMaxH3AudioVAE"],
                "scheduler": [None, None],
                "transformer": ["diffusers", "MiniMaxH3DiTModel"],
                "_minimax_h3": {
                    "schema_version": 1,
                    "partition": partition,
                    "tasks": PARTITION_TASKS[partition],
                    "task_aliases": {},
                    "sigma_shift_scales": SHIFTS,
                    **canvas,
                    **({} if dmd_steps is None else {"dmd_denoising_steps": dmd_steps}),
                },
            },
        )
        write_json(folder / "transformer" / "config.json", dit_format.config_to_native(dit_config))
        writers.dit(partition, dit_config, folder / "transformer")

        wrapper, source = video_vae_format.config_to_native(video_config)
        write_json(folder / "video_vae" / "config.json", wrapper)
        write_json(folder / "video_vae" / "source" / "config.json", source)
        writers.video_vae(video_config, folder / "video_vae" / "source" / "model.safetensors")

        audio_json, audio_metadata, audio_yaml = audio_vae_format.config_to_native(audio_config)
        write_json(folder / "audio_vae" / "config.json", audio_json)
        write_json(folder / "audio_vae" / "metadata.json", audio_metadata)
        (folder / "audio_vae" / "config.yaml").write_text(audio_yaml)
        writers.audio_vae(audio_config, folder / "audio_vae" / "model.safetensors")

        writers.text_side(folder, dit_config.text_dim)


def _write_native(root: Path, seed: int, dmd_steps: list[int] | None = None) -> None:
    def save(state: dict[str, torch.Tensor], path: Path) -> None:
        save_file(state, str(path), metadata={"format": "pt"})

    def dit(partition: str, config: DiTConfig, folder: Path) -> None:
        state = dit_keys.random_native_state(config, component_seed(seed, partition))
        save_sharded(state, folder, "model", 2, "model.safetensors.index.json")

    configs = _tiny_configs()
    # Both partitions hold the same VAEs: drawn once.
    video_state = video_vae_keys.random_native_state(configs[1], component_seed(seed, "video_vae"))
    audio_state = audio_vae_keys.random_native_state(configs[2], component_seed(seed, "audio_vae"))
    writers = NativeWeightWriters(
        dit=dit,
        video_vae=lambda _, path: save(video_state, path),
        audio_vae=lambda _, path: save(audio_state, path),
        text_side=lambda folder, text_dim: _write_text_side(folder, seed, text_dim),
    )
    write_native_tree(root, configs, TINY_CANVAS, writers, dmd_steps)


def _component_entry(library: str, class_name: str, subfolder: str) -> list:
    return [
        library,
        class_name,
        {
            "pretrained_model_name_or_path": None,
            "revision": None,
            "subfolder": subfolder,
            "type_hint": [library, class_name],
            "variant": None,
        },
    ]


def _write_diffusers(root: Path, seed: int) -> None:
    dit_config, video_config, audio_config = _tiny_configs()
    index = {
        "_class_name": DIFFUSERS_PIPELINE_CLASS,
        "_blocks_class_name": "MiniMaxH3Blocks",
        "_diffusers_version": DIFFUSERS_VERSION,
        **TINY_CANVAS,
        "text_encoder": _component_entry("transformers", "Qwen3VLForConditionalGeneration", "text_encoder"),
        "tokenizer": _component_entry("transformers", "Qwen2TokenizerFast", "tokenizer"),
        "processor": _component_entry("transformers", "Qwen3VLProcessor", "processor"),
        "vae": _component_entry("diffusers", "AutoencoderKLMiniMaxH3", "vae"),
        "audio_vae": _component_entry("diffusers", "AutoencoderKLMiniMaxH3Audio", "audio_vae"),
        "transformer": _component_entry("diffusers", "MiniMaxH3Transformer3DModel", "transformer"),
        "transformer_ref": _component_entry("diffusers", "MiniMaxH3Transformer3DModel", "transformer_ref"),
        "scheduler": _component_entry("diffusers", "MiniMaxH3Scheduler", "scheduler"),
        "audio_scheduler": _component_entry("diffusers", "MiniMaxH3Scheduler", "audio_scheduler"),
    }
    write_json(root / "modular_model_index.json", index)
    write_json(root / "model_index.json", index)
    for name, shift in (("scheduler", SHIFTS["video"]), ("audio_scheduler", SHIFTS["audio"])):
        write_json(
            root / name / "scheduler_config.json",
            {"_class_name": "MiniMaxH3Scheduler", "_diffusers_version": DIFFUSERS_VERSION, "shift": shift},
        )
    for partition, subfolder in (("fl2va", "transformer"), ("ref2va", "transformer_ref")):
        native = dit_keys.random_native_state(dit_config, component_seed(seed, partition))
        _write_diffusers_model(
            root / subfolder,
            "MiniMaxH3Transformer3DModel",
            dit_format.config_to_diffusers(dit_config),
            dit_keys.native_to_diffusers(native),
        )
    video_native = video_vae_keys.random_native_state(video_config, component_seed(seed, "video_vae"))
    _write_diffusers_model(
        root / "vae",
        "AutoencoderKLMiniMaxH3",
        video_vae_format.config_to_diffusers(video_config),
        video_vae_keys.native_to_diffusers(video_native, video_config),
    )
    audio_native = audio_vae_keys.random_native_state(audio_config, component_seed(seed, "audio_vae"))
    _write_diffusers_model(
        root / "audio_vae",
        "AutoencoderKLMiniMaxH3Audio",
        audio_vae_format.config_to_diffusers(audio_config),
        audio_vae_keys.native_to_diffusers(audio_native),
    )
    _write_text_side(root, seed, dit_config.text_dim)


def _write_diffusers_model(
    folder: Path, class_name: str, config: dict, state: dict[str, torch.Tensor]
) -> None:
    write_json(
        folder / "config.json", {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **config}
    )
    tensors = {key: value.contiguous() for key, value in sorted(state.items())}
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
