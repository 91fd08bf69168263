"""A GGUF DiT file read as a component's weight files, under our module's keys (`--dit FILE.gguf`).

A community GGUF DiT holds the native key names behind the single-file prefix (stripped by `GGUFFile`), QKV rows
stacked as our module computes them, its large linears in ggml block types, the rest in F32, F16 or BF16.
`GGUFWeightFiles` presents it as `WeightFiles`: a float tensor under its own name, dtype and shape, its place in
the file known (a loader casts it; a stream reads it from the file where no cast is needed); a block-type weight
`X.weight` as the module key `X.quantized` of a `StoredLinear` (h3engine.models.stored_linear), uint8 [rows, row
bytes], the file's bytes as they are, which the layer dequantizes where it computes (`stored_types` lists them for
`store_linears`); `rope.inv_freq`, which community files leave out, computed from the config.

Refusals (CheckpointError naming the file and the tensor), before anything loads: another model's file (its
`general.architecture` named), a block type we do not read, a quantized tensor that is not a 2-D linear weight, a
tensor missing, extra or of another shape than the module's (`WeightFiles.check`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from h3engine.checkpoint.dit_keys import ROPE_KEY
from h3engine.checkpoint.gguf_blocks import GGMLType
from h3engine.checkpoint.gguf_files import GGUFFile, GGUFTensor
from h3engine.checkpoint.safetensors_io import TensorInfo, WeightFiles
from h3engine.errors import CheckpointError
from h3engine.models.dit_config import DiTConfig
from h3engine.models.dit_layers import rope_inverse_frequencies
from h3engine.models.stored_linear import QUANTIZED_BUFFER

# The GGUF float types and the torch dtype their bytes are.
FLOAT_TYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
WEIGHT_SUFFIX = ".weight"
# A tensor every H3 DiT file holds: a file without it is another model's.
FIRST_BLOCK_QKV = "blocks.0.attn.qkv_proj.weight"


def quantized_key(name: str) -> str:
    """The module key of a block-type weight `X.weight`: `X.quantized`."""
    return name.removesuffix(WEIGHT_SUFFIX) + "." + QUANTIZED_BUFFER


class GGUFWeightFiles(WeightFiles):
    """The tensors of one GGUF DiT file under the module's keys (see the module doc)."""

    def __init__(self, gguf: GGUFFile, config: DiTConfig) -> None:
        gguf.check_supported()
        self.gguf = gguf
        self.config = config
        self.records: dict[str, GGUFTensor] = {}
        # Module path of a StoredLinear -> the ggml type of its weight.
        self.stored_types: dict[str, int] = {}
        infos: dict[str, TensorInfo] = {}
        for name, record in gguf.tensors.items():
            if record.ggml_type in FLOAT_TYPES:
                key, dtype, shape = name, FLOAT_TYPES[GGMLType(record.ggml_type)], record.shape
            else:
                if not name.endswith(WEIGHT_SUFFIX) or len(record.shape) != 2:
                    raise CheckpointError(
                        f"{gguf.path}: tensor {record.stored_name!r} is stored as {record.type_name}, which only a "
                        "linear layer's 2-D weight may be"
                    )
                key, dtype = quantized_key(name), torch.uint8
                shape = (record.shape[0], record.nbytes // record.shape[0])
                self.stored_types[name.removesuffix(WEIGHT_SUFFIX)] = record.ggml_type
            self.records[key] = record
            infos[key] = TensorInfo(gguf.path, dtype, tuple(shape), offset=record.offset)
        if not {FIRST_BLOCK_QKV, quantized_key(FIRST_BLOCK_QKV)} & infos.keys():
            raise CheckpointError(
                f"{gguf.path}: not an H3 DiT file (general.architecture {gguf.architecture!r}, {len(infos)} tensors, "
                f"no {FIRST_BLOCK_QKV!r})"
            )
        if ROPE_KEY not in infos:
            infos[ROPE_KEY] = TensorInfo(gguf.path, torch.float32, (config.rope_freq_dim,))
        super().__init__(infos, str(gguf.path))

    @classmethod
    def open_file(cls, path: Path, config: DiTConfig) -> GGUFWeightFiles:
        return cls(GGUFFile.open(path), config)

    def _read(self, key: str, rows: slice | None = None, columns: slice | None = None) -> Tensor:
        record = self.records.get(key)
        if record is None:  # rope.inv_freq, left out of the file
            return rope_inverse_frequencies(self.config.rope_freq_dim, self.config.rope_theta)
        info = self.infos[key]
        tensor = record.raw.view(info.dtype).view(info.shape)
        if rows is not None:
            tensor = tensor[rows]
        if columns is not None:
            if info.dtype == torch.uint8:
                raise CheckpointError(
                    f"{self.gguf.path}: tensor {record.stored_name!r} is quantized by rows; its "
                    "columns cannot be read apart"
                )
            tensor = tensor[:, columns]
        return tensor
