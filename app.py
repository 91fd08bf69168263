"""The MiniMax H3 browser app: `python app.py [--checkpoint DIR] [--host H] [--port P] [--share] [--auth U:P]`.

Contract: command line and environment -> `AppConfig`; load the engine replicas; start the engine front; build the UI;
`queue()`; `launch()`. With `--world-size 1` (the default) each of `--devices` is a replica holding a whole `Engine`
in this process; with `--world-size N` every N consecutive devices (or N CPU ranks with `--devices cpu`) form a
resident worker group of N processes, laid out by `--dit-sp`, `--dit-tp`, `--encoder-tp` and `--vae-ranks`
(h3engine.runtime.workers; defaults: the profile of that size). `--memory-profile` picks where the models live on
each device (h3engine.placement; shown in the page header). With no checkpoint configured (no `--checkpoint`,
`H3_CHECKPOINT` unset or empty) it runs on a tiny random-weight checkpoint that it makes once in a cache folder and
says so in a banner.

GPU replicas make one short warm-up run before they take jobs (`--no-warm-up` skips it).

Safety defaults: binds 127.0.0.1 unless `--host` / `H3_HOST` says otherwise; `--share` and `--auth` are opt-in;
uploads are limited to `--max-file-size`; besides uploads, only the outputs folder is served.

Exit codes: 2 when the checkpoint or an option is unusable (one line on stderr naming it), 0 on a clean stop
(Ctrl-C or SIGTERM: running jobs are cancelled, the worker threads joined and every worker process ended).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3engine.engine import Engine
    from h3engine.runtime.workers import ProcessReplica

# Gradio would otherwise phone home at import and launch; the app must work with no network at all.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPOSITORY_ROOT = Path(__file__).resolve().parent
EXAMPLES_PATH = REPOSITORY_ROOT / "assets" / "examples.json"
DEFAULT_PORT = 7860
DEFAULT_MAX_FILE_SIZE = "200mb"
DEFAULT_QUEUE_SIZE = 32
# Light events (swap, history, examples) may run side by side; generation has its own limit (the replica count).
LIGHT_EVENT_CONCURRENCY = 8

logger = logging.getLogger("h3app")


class ConfigError(Exception):
    """An option or the checkpoint cannot be used; the message names it."""


@dataclass(frozen=True)
class AppConfig:
    checkpoint: Path | None
    outputs_dir: Path
    cache_dir: Path
    devices: tuple[str | None, ...]
    world_size: int
    # --dit-sp, --dit-tp, --encoder-tp, --vae-ranks; None: the profile's value.
    layout_flags: tuple[int | None, int | None, int | None, int | None]
    dtype: str | None
    memory_profile: str
    host: str
    port: int
    share: bool
    auth: tuple[str, str] | None
    max_file_size: str
    queue_size: int
    preview_every: int
    warm_up: bool = True  # GPU replicas run `WARM_UP_REQUEST` before taking jobs (h3engine.runtime.front)


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(environ.get("H3_CACHE_DIR") or Path(base) / "h3engine")


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python app.py", description="MiniMax H3 browser app")
    parser.add_argument(
        "--checkpoint",
        default=environ.get("H3_CHECKPOINT") or None,
        help="released checkpoint folder (native or diffusers layout); env H3_CHECKPOINT. "
        "Without one the app runs on a tiny random-weight checkpoint.",
    )
    parser.add_argument(
        "--outputs", default=environ.get("H3_OUTPUTS") or "outputs", help="results folder; env H3_OUTPUTS"
    )
    parser.add_argument(
        "--devices",
        default=environ.get("H3_DEVICES") or None,
        help="comma-separated devices, one engine replica each (e.g. cuda:0,cuda:1); default: cuda if present, "
        "else cpu; env H3_DEVICES",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(environ.get("H3_WORLD_SIZE") or 1),
        help="ranks per replica: N > 1 runs each replica as a resident group of N worker processes, one per GPU "
        "(CPU ranks over gloo with --devices cpu); env H3_WORLD_SIZE",
    )
    parser.add_argument("--dit-sp", type=int, default=None, help="worker group: DiT Ulysses degree")
    parser.add_argument("--dit-tp", type=int, default=None, help="worker group: DiT tensor-parallel degree")
    parser.add_argument(
        "--encoder-tp", type=int, default=None, help="worker group: text-encoder tensor degree"
    )
    parser.add_argument(
        "--vae-ranks", type=int, default=None, help="worker group: ranks sharing the video decode"
    )
    parser.add_argument("--dtype", default=None, help="bfloat16 (released precision, default) or float32")
    parser.add_argument(
        "--memory-profile",
        default=environ.get("H3_MEMORY_PROFILE") or "resident",
        metavar="{resident,low-memory}",
        help="resident (default): every model stays on the GPU; low-memory: models wait in host memory and each "
        "phase moves onto the GPU only the ones it runs (smaller GPUs; slower); env H3_MEMORY_PROFILE",
    )
    parser.add_argument(
        "--host", default=environ.get("H3_HOST") or "127.0.0.1", help="address to bind; env H3_HOST"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(environ.get("H3_PORT") or environ.get("GRADIO_SERVER_PORT") or DEFAULT_PORT),
        help="port; env H3_PORT",
    )
    parser.add_argument("--share", action="store_true", help="also open a public Gradio share link (opt-in)")
    parser.add_argument(
        "--auth",
        default=environ.get("H3_AUTH") or None,
        help="USER:PASSWORD required to open the app (opt-in); env H3_AUTH",
    )
    parser.add_argument(
        "--max-file-size", default=DEFAULT_MAX_FILE_SIZE, help="upload size limit, e.g. 200mb"
    )
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE, help="most requests waiting")
    parser.add_argument("--preview-every", type=int, default=5, help="live preview every N denoising steps")
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip the short warm-up run each GPU replica makes at start (its kernel compiles then fall on the "
        "first request instead)",
    )
    return parser


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> AppConfig:
    args = _parser(environ).parse_args(argv)
    auth = None
    if args.auth:
        user, separator, password = args.auth.partition(":")
        if not separator or not user or not password:
            raise ConfigError("--auth: expected USER:PASSWORD")
        auth = (user, password)
    devices = tuple(name.strip() for name in args.devices.split(",")) if args.devices else (None,)
    if args.queue_size < 1 or args.preview_every < 1:
        raise ConfigError("--queue-size and --preview-every must be at least 1")
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {args.world_size}")
    return AppConfig(
        checkpoint=Path(args.checkpoint).expanduser() if args.checkpoint else None,
        outputs_dir=Path(args.outputs).expanduser().resolve(),
        cache_dir=_default_cache_dir(environ),
        devices=devices,
        world_size=args.world_size,
        layout_flags=(args.dit_sp, args.dit_tp, args.encoder_tp, args.vae_ranks),
        dtype=args.dtype,
        memory_profile=args.memory_profile,
        host=args.host,
        port=args.port,
        share=args.share,
        auth=auth,
        max_file_size=args.max_file_size,
        queue_size=args.queue_size,
        preview_every=args.preview_every,
        warm_up=args.warm_up,
    )


def _load_engines(checkpoint: Path, config: AppConfig) -> list[Engine | ProcessReplica]:
    """One replica per device (in-process engines) or per group of `world_size` devices (worker groups)."""
    if config.world_size > 1 or any(flag is not None for flag in config.layout_flags):
        return _start_worker_groups(checkpoint, config)
    from h3engine.engine import Engine, resolve_device, resolve_dtype

    engines = []
    for name in config.devices:
        device = resolve_device(name)
        engines.append(
            Engine.from_checkpoint(
                checkpoint,
                device=device,
                dtype=resolve_dtype(config.dtype, device),
                memory_profile=config.memory_profile,
            )
        )
    return engines


def _start_worker_groups(checkpoint: Path, config: AppConfig) -> list[ProcessReplica]:
    from h3engine.errors import RequestError
    from h3engine.parallel.groups import RuntimeLayout
    from h3engine.runtime.workers import ProcessReplica, replica_device_groups

    try:
        layout = RuntimeLayout.choose(config.world_size, *config.layout_flags)
    except ValueError as error:
        raise RequestError(str(error)) from None
    replicas: list[ProcessReplica] = []
    try:
        for devices in replica_device_groups(config.devices, config.world_size):
            logger.info("starting a worker group on %s (%s)", ", ".join(devices), layout.describe())
            replicas.append(ProcessReplica(checkpoint, devices, layout, config.dtype, config.memory_profile))
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    return replicas


def _make_tiny_checkpoint_once(folder: Path) -> None:
    from h3engine.checkpoint.tiny import make_tiny_checkpoint

    if folder.is_dir():
        return
    logger.info("making the tiny random-weight checkpoint in %s", folder)
    try:
        make_tiny_checkpoint(folder, seed=0)
    except FileExistsError:
        pass  # another app instance made it first


def _tiny_engines(config: AppConfig) -> tuple[Path, list[Engine | ProcessReplica]]:
    """The embedded default: a tiny random-weight checkpoint, made once per engine version into the cache."""
    from h3engine import __version__
    from h3engine.errors import CheckpointError

    folder = config.cache_dir / f"tiny-checkpoint-{__version__}"
    _make_tiny_checkpoint_once(folder)
    try:
        return folder, _load_engines(folder, config)
    except CheckpointError:
        # Made by an older build of this version (the tiny layout changed): make it again, once.
        logger.warning("the cached tiny checkpoint %s does not load; making it again", folder)
        shutil.rmtree(folder)
    _make_tiny_checkpoint_once(folder)
    return folder, _load_engines(folder, config)


def _computes_on_cuda(replica: Engine | ProcessReplica) -> bool:
    """Whether the replica's models run on a GPU (only there does the first request pay compiles)."""
    devices = [str(replica.device)] if hasattr(replica, "device") else list(replica.spec.devices)
    return any(device.startswith("cuda") for device in devices)


def random_weights_banner(folder: Path) -> str:
    return (
        "**Random weights.** No checkpoint was configured, so this app runs on a tiny random-weight checkpoint "
        f"it made in `{folder}`. Every step runs for real, but the videos are noise. To use the released "
        "MiniMax H3 weights, start `python app.py --checkpoint DIR` or set `H3_CHECKPOINT=DIR`."
    )


def _stop_on_sigterm(signal_number: int, frame: object) -> None:
    # Gradio's blocking launch() closes the server on KeyboardInterrupt; SIGTERM (docker stop) takes that path too.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal request otherwise
    from h3engine.errors import H3Error

    try:
        config = parse_config(argv, os.environ)
        if config.checkpoint is None:
            checkpoint, engines = _tiny_engines(config)
            banner = random_weights_banner(checkpoint)
        else:
            checkpoint, engines, banner = config.checkpoint, _load_engines(config.checkpoint, config), None
    except (ConfigError, H3Error) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    import ui
    from h3engine.runtime.front import EngineFront

    front = EngineFront(
        engines,
        config.outputs_dir,
        preview_every=config.preview_every,
        warm_up=config.warm_up and any(_computes_on_cuda(replica) for replica in engines),
    )
    options = ui.UiOptions(
        outputs_dir=config.outputs_dir,
        examples_path=EXAMPLES_PATH,
        repository_root=REPOSITORY_ROOT,
        checkpoint_label=str(checkpoint),
        memory_profile=config.memory_profile,
        banner_markdown=banner,
    )
    demo = ui.build_ui(front, options)
    demo.queue(default_concurrency_limit=LIGHT_EVENT_CONCURRENCY, max_size=config.queue_size)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        demo.launch(
            server_name=config.host,
            server_port=config.port,
            share=config.share,
            auth=config.auth,
            max_file_size=config.max_file_size,
            allowed_paths=[str(config.outputs_dir)],
            theme=ui.THEME,
            css=ui.CSS,
            show_error=False,
            enable_monitoring=False,
            run_history=False,
            mcp_server=False,
            ssr_mode=False,
            footer_links=["api", "gradio", "settings"],
        )
    finally:
        front.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
