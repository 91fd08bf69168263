"""`check-checkpoint DIR [--deep]`: is this folder the released MiniMax H3, every file, key, shape and dtype?

`probe_checkpoint(folder or layout, deep)` checks each partition (FL2VA, Ref2VA) in either layout: the configs, the DiT (every
key and shape, the fp32 islands stored fp32), the video and audio VAEs, the text encoder (the tensors H3 reads), the
tokenizer (H3's tokens, matching the encoder's ids) and the processor. Headers only by default: seconds at the
released size. `deep` reads every tensor once (none NaN or infinite) and digests each weight file: SHA-256 over its
tensors' names, dtypes, shapes and bytes in name order, which two machines can compare. A component shared by the
partitions is checked once. `format_report` renders one table and the verdict line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3engine.checkpoint.layout import (
    CheckpointLayout,
    PartitionPaths,
    detect_layout,
)
from h3engine.checkpoint.loader import (
    ComponentSource,
    audio_vae_source,
    dit_source,
    text_encoder_skeleton,
    video_vae_source,
)
from h3engine.checkpoint.safetensors_io import WeightFiles
from h3engine.checkpoint.text_encoder_files import (
    check_text_encoder_files,
    load_tokenizer,
)
from h3engine.engine.conditioning.presentation import load_processor
from h3engine.errors import CheckpointError
from h3engine.models.text_encoder import H3TextEncoder


@dataclass
class ComponentReport:
    partition: str
    component: str
    path: str
    tensors: int = 0
    bytes: int = 0
    fp32: str = ""
    problem: str | None = None
    note: str = ""
    stored: str = ""  # a community DiT file's forms ('Q4_K 213, floats 268')
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None


def _nbytes(files: WeightFiles) -> int:
    return sum(
        torch.Size(info.shape).numel() * torch.empty((), dtype=info.dtype).element_size()
        for info in files.infos.values()
    )


def _check_keys(files: WeightFiles, expected: dict[str, torch.Tensor]) -> None:
    """Every expected key at its shape, nothing unknown (the loader's own check: CheckpointError naming the file and
    key), and a float tensor wherever the module holds one."""
    files.check({key: tuple(tensor.shape) for key, tensor in expected.items()})
    for key, tensor in expected.items():
        info = files.infos[key]
        if tensor.is_floating_point() and not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.file}: tensor '{key}' is stored as {info.dtype}, not a float dtype")


def _dit_dtypes(files: WeightFiles, expected: dict[str, torch.Tensor]) -> str:
    """The fp32 islands (fp32 in our module built at bf16) must be stored fp32; returns "found/expected"."""
    islands = [key for key, tensor in expected.items() if tensor.dtype == torch.float32]
    for key in islands:
        info = files.infos[key]
        if info.dtype != torch.float32:
            raise CheckpointError(f"{info.file}: tensor '{key}' is an fp32 island stored as {info.dtype}")
    return f"{len(islands)}/{len(islands)}"


def _component(source: ComponentSource) -> tuple[WeightFiles, str]:
    expected = source.to_file_names(source.expected_state())
    _check_keys(source.files, expected)
    return source.files, ""


def _dit(layout: CheckpointLayout, paths: PartitionPaths) -> tuple[WeightFiles, str]:
    source = dit_source(layout, paths, torch.bfloat16)
    expected = source.to_file_names(source.expected_state())
    _check_keys(source.files, expected)
    if paths.dit_weights is not None:
        # A community file keeps the islands in whatever it stores them (the loader casts): no check, nothing found.
        return source.files, "-"
    return source.files, _dit_dtypes(source.files, expected)


def _formats(files: WeightFiles) -> str:
    """How many tensors a community DiT file stores in each form ('Q4_K 213, F32 268')."""
    forms = getattr(files, "stored_forms", None)
    if forms is None:
        return ""
    counts: dict[str, int] = {}
    for form in forms.values():
        counts[form.name] = counts.get(form.name, 0) + 1
    plain = len(files.infos) - sum(1 for key in files.infos if key.endswith((".quantized", ".scale")))
    return ", ".join([*(f"{name} {count}" for name, count in sorted(counts.items())), f"floats {plain}"])


def _text_encoder(paths: PartitionPaths, built: dict[str, H3TextEncoder]) -> tuple[WeightFiles, str]:
    """The tensors H3 reads of a stock Qwen3-VL folder (or of the file replacing its weights); the encoder (on meta)
    is kept in `built`, by folder, for the tokenizer."""
    files, build = text_encoder_skeleton(paths.text_encoder, paths.text_encoder_weights)
    with torch.device("meta"):
        encoder = build()
    check_text_encoder_files(encoder, files)
    built[str(paths.text_encoder)] = encoder
    return files, ""


def _tokenizer(paths: PartitionPaths, built: dict[str, H3TextEncoder]) -> tuple[None, str]:
    """H3's tokens present, and the vision token ids the encoder's config names."""
    tokenizer = load_tokenizer(paths.tokenizer)
    encoder = built.get(str(paths.text_encoder))
    if encoder is not None:
        encoder.verify_tokenizer(tokenizer)
    return None, ""


def _processor(paths: PartitionPaths) -> tuple[None, str]:
    load_processor(paths.processor)
    return None, ""


def _digest(files: WeightFiles) -> tuple[dict[str, str], str | None]:
    """Each file's digest, reading every tensor once; a problem names the first non-finite tensor."""
    by_file: dict[Path, list[str]] = {}
    for key, info in files.infos.items():
        by_file.setdefault(info.file, []).append(key)
    digests = {}
    for file, keys in sorted(by_file.items()):
        digest = hashlib.sha256()
        for key in sorted(keys):
            tensor = files.tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return digests, f"{file}: tensor '{key}' holds NaN or infinity"
            digest.update(f"{key}|{tensor.dtype}|{list(tensor.shape)}|".encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[str(file)] = digest.hexdigest()
    files.close()
    return digests, None


def probe_checkpoint(
    checkpoint: str | Path | CheckpointLayout, deep: bool = False
) -> tuple[str, list[ComponentReport]]:
    """(the layout's kind, one report per component) of a checkpoint: a folder, or its layout with the community
    files that replace some of its weights (h3engine.engine.options.engine_layout); a folder that is no checkpoint at
    all raises CheckpointError."""
    layout = checkpoint if isinstance(checkpoint, CheckpointLayout) else detect_layout(checkpoint)
    reports: list[ComponentReport] = []
    seen: set[str] = set()
    built: dict[str, H3TextEncoder] = {}
    for name, paths in layout.partitions.items():
        checks: list[tuple[str, Path, Callable[[], tuple[WeightFiles | None, str]]]] = [
            ("dit", paths.dit_home, lambda paths=paths: _dit(layout, paths)),
            (
                "video_vae",
                paths.video_vae_home,
                lambda paths=paths: _component(video_vae_source(layout, paths)),
            ),
            (
                "audio_vae",
                paths.audio_vae_home,
                lambda paths=paths: _component(audio_vae_source(layout, paths)),
            ),
            ("text_encoder", paths.text_encoder_home, lambda paths=paths: _text_encoder(paths, built)),
            ("tokenizer", paths.tokenizer, lambda paths=paths: _tokenizer(paths, built)),
            ("processor", paths.processor, lambda paths=paths: _processor(paths)),
        ]
        for component, path, check in checks:
            if f"{component}:{path}" in seen:
                continue
            seen.add(f"{component}:{path}")
            report = ComponentReport(name, component, str(path))
            reports.append(report)
            try:
                files, report.fp32 = check()
            except (CheckpointError, OSError, ValueError, KeyError) as error:
                report.problem = str(error) if isinstance(error, CheckpointError) else f"{path}: {error}"
                continue
            if files is None:
                continue
            report.tensors, report.bytes = len(files.infos), _nbytes(files)
            report.stored = _formats(files)
            if deep:
                if files.placeholder:
                    report.note = "placeholder: values drawn at load, nothing to read"
                    continue
                try:
                    report.digests, report.problem = _digest(files)
                except Exception as error:  # safetensors' own errors for a damaged file: reported, not raised
                    report.problem = f"{path}: unreadable tensor data ({error})"
    return layout.kind, reports


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.2f} MB"


def format_report(folder: str | Path, kind: str, reports: list[ComponentReport], deep: bool) -> str:
    """The table (one row per component, then each file's digest with `deep`) and the verdict line."""
    lines = [f"checkpoint {folder} ({kind} layout, {'deep: every tensor read' if deep else 'headers only'})"]
    lines.append(f"{'partition':<9} {'component':<13} {'tensors':>8} {'bytes':>10} {'fp32':>6}  status")
    for report in reports:
        notes = "; ".join(note for note in (report.stored, report.note) if note)
        status = (f"ok ({notes})" if notes else "ok") if report.ok else f"FAIL: {report.problem}"
        tensors = str(report.tensors) if report.tensors else "-"
        size = _size(report.bytes) if report.bytes else "-"
        lines.append(
            f"{report.partition:<9} {report.component:<13} {tensors:>8} {size:>10} {report.fp32 or '-':>6}  {status}"
        )
        for file, digest in report.digests.items():
            lines.append(
                f"    sha256 {digest}  {Path(file).relative_to(Path(folder)) if Path(file).is_relative_to(Path(folder)) else file}"
            )
    failed = [report for report in reports if not report.ok]
    total = sum(report.bytes for report in reports)
    if failed:
        first = failed[0]
        lines.append(
            f"verdict: BROKEN - {len(failed)} component(s) failed; first: {first.partition} {first.component}: {first.problem}"
        )
    else:
        read = "every tensor read and finite" if deep else "headers checked"
        if deep and any(report.note for report in reports):
            read = "headers checked; a placeholder checkpoint's values are drawn, so --deep read none of them"
        lines.append(f"verdict: OK - {len(reports)} components, {_size(total)} of weights, {read}")
    return "\n".join(lines)
