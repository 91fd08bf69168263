"""Which AdaLN form a DiT's files hold (h3engine.models.dit_config.DiTConfig.adaln_form), from their tensor shapes.

`adaln_form_from_shapes(shapes, config)` returns `config` with `adaln_rank` / `adaln_table_rows` set from the native
keys' shapes: `adaln_t_table` [rows, rank] (the published table form), `adaln_curve.mean` and `adaln_curve.basis`
(our basis form, h3engine.checkpoint.prune_adaln), neither (exact); every AdaLN projection must then be that many
inputs wide. A contradiction (a table beside 2688-wide projections, a basis without its mean, a table beside a time
embedder, a config.json that says otherwise) is a CheckpointError naming the tensor and, given `where`, its file.
config.json may state the form (`adaln_rank`, `adaln_table_rows`, or ComfyUI's `adaln_curve_grid` for the rows):
`adaln_fields_from_json` / `adaln_fields_to_json`. Only the native layout holds a pruned form (`adaln_form_of_files`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.errors import CheckpointError
from h3engine.models.dit_adaln import TABLE_KEY
from h3engine.models.dit_config import DiTConfig

MEAN_KEY = "adaln_curve.mean"
BASIS_KEY = "adaln_curve.basis"
TIME_EMBEDDER_KEY = "time_embedder.proj_out.weight"
# config.json names of the table's rows: ours, then ComfyUI's (they must agree when both are given).
_ROW_FIELDS = ("adaln_table_rows", "adaln_curve_grid")
_RANK_FIELD = "adaln_rank"

Shapes = Mapping[str, tuple[int, ...]]


def projection_keys(config: DiTConfig) -> list[str]:
    """The native keys of every AdaLN projection's weight: each block's, then the final layer's."""
    blocks = [f"blocks.{index}.adaln_proj.linear.weight" for index in range(config.num_layers)]
    return [*blocks, "final_layer.adaln_proj.linear.weight"]


def _named(key: str, where: Callable[[str], str] | None) -> str:
    return f"{where(key)}: tensor '{key}'" if where is not None else f"DiT tensor '{key}'"


def _projection_width(
    shapes: Shapes, config: DiTConfig, where: Callable[[str], str] | None
) -> tuple[str, int]:
    """(the first projection's key, its input width); every projection present must be a 2-D matrix that wide."""
    present = [key for key in projection_keys(config) if key in shapes]
    if not present:
        raise CheckpointError(f"{_named(projection_keys(config)[0], where)} is missing (no AdaLN projection)")
    first = present[0]
    for key in present:
        shape = tuple(shapes[key])
        if len(shape) != 2 or shape[1] != shapes[first][-1]:
            raise CheckpointError(
                f"{_named(key, where)} is {list(shape)}, but '{first}' is {list(shapes[first])}: every AdaLN "
                "projection reads the same input"
            )
    return first, shapes[first][1]


def _require_width(
    key: str, shape: tuple[int, ...], width: int, form: str, where: Callable[[str], str] | None
) -> None:
    if shape[1] != width:
        raise CheckpointError(
            f"{_named(key, where)} is {list(shape)}, but {form} needs AdaLN projections {width} inputs wide"
        )


def _agree(config: DiTConfig, rank: int, rows: int, evidence: str) -> None:
    """config.json may state the form (0: not stated); what it states must be what the files hold (`rank` 0: the
    exact form, `rows` 0: no table)."""
    rank_agrees = config.adaln_rank in (0, rank) if rank else config.adaln_rank == 0
    rows_agree = config.adaln_table_rows in (0, rows) if rows else config.adaln_table_rows == 0
    if not (rank_agrees and rows_agree):
        raise CheckpointError(
            f"config.json states adaln_rank {config.adaln_rank} and adaln_table_rows {config.adaln_table_rows}, "
            f"but {evidence}"
        )


def adaln_form_from_shapes(
    shapes: Shapes, config: DiTConfig, *, where: Callable[[str], str] | None = None
) -> DiTConfig:
    """`config` with its AdaLN form set from the files' native keys and shapes (CheckpointError on a contradiction,
    naming the tensor and, when `where(key)` gives it, the file holding it)."""
    shapes = {key: tuple(shape) for key, shape in shapes.items()}
    has_embedder = any(key.startswith("time_embedder.") for key in shapes)
    first, width = _projection_width(shapes, config, where)
    if TABLE_KEY in shapes:
        table = shapes[TABLE_KEY]
        if len(table) != 2 or table[0] < 2 or table[1] < 1:
            raise CheckpointError(f"{_named(TABLE_KEY, where)} is {list(table)}, expected [rows >= 2, rank]")
        beside = [key for key in shapes if key in (MEAN_KEY, BASIS_KEY) or key.startswith("time_embedder.")]
        if beside:
            raise CheckpointError(
                f"{_named(beside[0], where)} sits beside '{TABLE_KEY}': the published table form has no time "
                "embedder and no basis (which form is this file?)"
            )
        rows, rank = table
        form = f"the table form ('{TABLE_KEY}' {list(table)})"
        _require_width(first, shapes[first], rank, form, where)
        _agree(config, rank, rows, f"the files hold {form}")
        return dataclasses.replace(config, adaln_rank=rank, adaln_table_rows=rows)
    if MEAN_KEY in shapes or BASIS_KEY in shapes:
        return _basis_form(shapes, config, first, has_embedder, where)
    if width != config.time_embed_dim:
        raise CheckpointError(
            f"{_named(first, where)} is {list(shapes[first])}: {width} inputs wide, but the files hold neither "
            f"'{TABLE_KEY}' nor '{BASIS_KEY}' (a pruned form needs one) and the exact form reads "
            f"time_embed_dim {config.time_embed_dim}"
        )
    _agree(config, 0, 0, "the files hold the exact form (no adaln_t_table, no adaln_curve.basis)")
    return config


def _basis_form(
    shapes: Shapes, config: DiTConfig, first: str, has_embedder: bool, where: Callable[[str], str] | None
) -> DiTConfig:
    for key, partner in ((BASIS_KEY, MEAN_KEY), (MEAN_KEY, BASIS_KEY)):
        if key not in shapes:
            raise CheckpointError(
                f"{_named(key, where)} is missing beside '{partner}' (the basis form needs both)"
            )
    if not has_embedder:
        raise CheckpointError(
            f"{_named(TIME_EMBEDDER_KEY, where)} is missing: the basis form ('{BASIS_KEY}') keeps the time embedder"
        )
    basis, mean = shapes[BASIS_KEY], shapes[MEAN_KEY]
    width = config.time_embed_dim
    if len(basis) != 2 or basis[0] != width or not 1 <= basis[1] <= width:
        raise CheckpointError(
            f"{_named(BASIS_KEY, where)} is {list(basis)}, expected [{width}, rank <= {width}]"
        )
    if mean != (width,):
        raise CheckpointError(f"{_named(MEAN_KEY, where)} is {list(mean)}, expected [{width}]")
    rank = basis[1]
    form = f"the basis form ('{BASIS_KEY}' {list(basis)})"
    _require_width(first, shapes[first], rank, form, where)
    _agree(config, rank, 0, f"the files hold {form}")
    return dataclasses.replace(config, adaln_rank=rank, adaln_table_rows=0)


def holds_pruned_adaln(files: WeightFiles) -> bool:
    """Whether a DiT's files hold a pruned AdaLN form's table, mean or basis (by key alone)."""
    return any(key in files.infos for key in (TABLE_KEY, MEAN_KEY, BASIS_KEY))


def adaln_form_of_files(files: WeightFiles, config: DiTConfig, native: bool) -> DiTConfig:
    """`adaln_form_from_shapes` on a DiT's weight files (errors name the file holding the tensor). A diffusers-layout
    DiT must hold the exact form: no diffusers spelling of a pruned one exists (diffusers refuses such files)."""
    shapes = {key: info.shape for key, info in files.infos.items()}

    def where(key: str) -> str:
        return str(files.infos[key].file) if key in files.infos else files.description

    if native:
        return adaln_form_from_shapes(shapes, config, where=where)
    pruned = [key for key in (TABLE_KEY, MEAN_KEY, BASIS_KEY) if key in shapes]
    if pruned or config.adaln_rank:
        named = _named(pruned[0], where) if pruned else f"{files.description}: config.json's adaln_rank"
        raise CheckpointError(
            f"{named}: a pruned AdaLN form is read in the native layout only, not the diffusers one"
        )
    return config


def adaln_fields_from_json(raw: Mapping[str, Any], config: DiTConfig, source: str) -> DiTConfig:
    """`config` with the AdaLN form a transformer/config.json states (absent fields: the exact form)."""
    rows = [raw[name] for name in _ROW_FIELDS if name in raw and raw[name] is not None]
    if len({repr(value) for value in rows}) > 1:
        found = ", ".join(f"{name}={raw[name]!r}" for name in _ROW_FIELDS if name in raw)
        raise CheckpointError(f"{source}: DiT config fields disagree ({found}); they must be equal")
    values = {"adaln_table_rows": rows[0] if rows else 0, "adaln_rank": raw.get(_RANK_FIELD) or 0}
    if values["adaln_table_rows"] and not values["adaln_rank"] and "time_embed_dim" in raw:
        # ComfyUI's curve configs give the table's width as time_embed_dim (no time embedder in that form).
        values["adaln_rank"] = raw["time_embed_dim"]
    try:
        return dataclasses.replace(config, **values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: invalid DiT config: {error}") from None


def adaln_fields_to_json(config: DiTConfig) -> dict[str, int]:
    """The config.json fields of a pruned form (none for the exact form, so a released config.json stays as it is)."""
    if config.adaln_form == "exact":
        return {}
    fields = {_RANK_FIELD: config.adaln_rank}
    if config.adaln_table_rows:
        fields[_ROW_FIELDS[0]] = config.adaln_table_rows
    return fields
