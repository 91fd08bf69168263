"""The MiniMax H3 browser app: `python app.py [--checkpoint DIR] [--host H] [--port P] [--share] [--auth U:P]...`.

Command line and environment -> `AppConfig`; load the engine replicas; start the engine front; build the UI;
launch. Each of `--devices` is a replica holding a whole `Engine` in this process, or with `--world-size N`
every N devices form a resident worker group (h3engine.runtime.workers); the engine flags (layout, `--dtype`,
`--memory-profile`, `--gpu-memory`, `--host-memory`, `--weights`, `--fp8-linear`) are the CLI's
(h3engine.engine.options). `--ray ADDRESS` serves from
`--ray-replicas` engine replicas of `--world-size` GPUs (or CPU ranks with `--devices cpu`) on a Ray Serve
cluster instead (h3engine.runtime.ray_serve). Without a checkpoint (`--checkpoint` / `H3_CHECKPOINT`) it runs
on a tiny random-weight checkpoint made once in a cache folder, and says so in a banner. GPU replicas make one
warm-up run before they take jobs (`--no-warm-up` skips it).

Safety: binds 127.0.0.1 unless told otherwise (a Space sets GRADIO_SERVER_NAME); `--share` and `--auth` (repeat it
for more users, or list them in `--auth-file`) are opt-in; uploads are limited. Users are kept apart (ui.access):
own History and results, served only as unguessable copies (`--shared-history`: one user). Our files leave Gradio's cache by age and at exit; at start what a killed
predecessor left is removed (`remove_leftovers`); unwritable default folders move to the temp folder.

Serving (h3engine.serving): an OpenAI-style `/v1/videos` API, `/metrics`, `/healthz` and `/readyz` on the same server
and engine front; every job, the page's too, in a SQLite job store (outputs folder or `--state-dir`) that a restart
recovers; `--api-key`, limits, webhooks and retention are its flags.

Exit codes: 2 when the checkpoint or an option is unusable (one line naming it; options, port, outputs folder and
devices are checked before any model loads), 0 on a clean stop (Ctrl-C or SIGTERM: every job and worker ends).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from h3engine.engine.options import EngineOptions, add_engine_flags, cannot_write, default_cache_folder
from h3engine.memory.disk import keep_compile_caches_in
from h3engine.serving.options import ServingOptions, add_serving_flags

if TYPE_CHECKING:
    import gradio as gr

    from h3engine.engine.engine import Engine
    from h3engine.engine.model_store import LoadEvent
    from h3engine.models.parallel.groups import RuntimeLayout
    from h3engine.runtime.front import EngineFront
    from h3engine.runtime.ray_serve import RaySlot
    from h3engine.runtime.workers import ProcessReplica
    from ui.access import AccessPolicy

# Gradio would otherwise phone home at import and launch; the app must work with no network at all.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPOSITORY_ROOT = Path(__file__).resolve().parent
EXAMPLES_PATH = REPOSITORY_ROOT / "assets" / "examples.json"
DEFAULT_PORT = 7860
DEFAULT_OUTPUTS = "outputs"
# Where a read-only install's outputs and cache go (`settle_folders`): a folder of this process in the temp folder.
FALLBACK_FOLDER_PREFIX = "h3-app-"
DEFAULT_MAX_FILE_SIZE = "200mb"
DEFAULT_QUEUE_SIZE = 32
# Gradio's delete_cache: every CACHE_SWEEP_S, our files in its cache older than CACHE_MAX_AGE_S go; all at exit.
CACHE_SWEEP_S = 3600
CACHE_MAX_AGE_S = 24 * 3600
FILE_SIZE_UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3, "tb": 1024**4}
# Light events (swap, history, examples) may run side by side; generation has its own limit (the replica count).
LIGHT_EVENT_CONCURRENCY = 8

logger = logging.getLogger("h3app")


class ConfigError(Exception):
    """An option or the checkpoint cannot be used; the message names it."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad option raises ConfigError (one line naming it) instead of printing the usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message.removeprefix("argument "))


@dataclass(frozen=True)
class AppConfig:
    checkpoint: Path | None
    outputs_dir: Path
    cache_dir: Path
    devices: tuple[str | None, ...]
    world_size: int
    engine: EngineOptions
    host: str
    port: int
    share: bool
    auth: tuple[tuple[str, str], ...]  # (user, password) of each user who may log in; empty: no login
    max_file_size: int  # bytes
    queue_size: int
    preview_every: int
    warm_up: bool = True  # GPU replicas run `WARM_UP_REQUEST` before taking jobs (h3engine.runtime.front)
    shared_history: bool = False  # one History and outputs folder for everyone (ui.access)
    lora_dir: Path | None = None  # the LoRA adapters the app offers (h3engine.engine.lora.library)
    ray: str | None = None  # a Ray cluster's address ("auto": this node's): the replicas run there
    ray_replicas: int = 1
    stall_timeout: float | None = (
        None  # --stall-timeout: seconds a worker group may be silent (None: derived)
    )
    # Whether the outputs / cache folder was named (--outputs or H3_OUTPUTS / H3_CACHE_DIR): a named folder that
    # cannot be written is refused; a default one is replaced by a temp folder (`settle_folders`).
    outputs_named: bool = True
    cache_named: bool = True
    # The /v1/videos API, the job store and their limits (h3engine.serving.options).
    serving: ServingOptions = ServingOptions()


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    # Defaults from the environment stay strings: argparse converts them like the options, with the same errors.
    parser = _OneLineParser(prog="python app.py", description="MiniMax H3 browser app")
    parser.add_argument(
        "--checkpoint",
        default=environ.get("H3_CHECKPOINT") or None,
        help="released checkpoint folder (native or diffusers layout); env H3_CHECKPOINT. "
        "Without one the app runs on a tiny random-weight checkpoint.",
    )
    parser.add_argument(
        "--outputs",
        default=environ.get("H3_OUTPUTS") or None,
        help=f"results folder (default: {DEFAULT_OUTPUTS}, or a temp folder where that cannot be written); "
        "env H3_OUTPUTS",
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
        default=environ.get("H3_WORLD_SIZE") or "1",
        help="ranks per replica: N > 1 runs each replica as a resident group of N worker processes, one per GPU "
        "(CPU ranks over gloo with --devices cpu); env H3_WORLD_SIZE",
    )
    add_engine_flags(parser, environ)
    # GRADIO_SERVER_NAME / GRADIO_SERVER_PORT: what a Hugging Face Space sets (0.0.0.0 and its port).
    parser.add_argument(
        "--host",
        default=environ.get("H3_HOST") or environ.get("GRADIO_SERVER_NAME") or "127.0.0.1",
        help="address to bind (default 127.0.0.1); env H3_HOST or GRADIO_SERVER_NAME",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=environ.get("H3_PORT") or environ.get("GRADIO_SERVER_PORT") or str(DEFAULT_PORT),
        help=f"port (default {DEFAULT_PORT}); env H3_PORT or GRADIO_SERVER_PORT",
    )
    parser.add_argument("--share", action="store_true", help="also open a public Gradio share link (opt-in)")
    parser.add_argument(
        "--auth",
        action="append",
        metavar="USER:PASSWORD",
        help="USER:PASSWORD of a user who may open the app (opt-in); repeat it for more users, each with a "
        "History of their own; env H3_AUTH (one pair)",
    )
    parser.add_argument(
        "--auth-file",
        metavar="FILE",
        default=environ.get("H3_AUTH_FILE") or None,
        help="a file of users who may open the app, one USER:PASSWORD a line (# starts a comment line); "
        "with --auth too; env H3_AUTH_FILE",
    )
    parser.add_argument(
        "--max-file-size", default=DEFAULT_MAX_FILE_SIZE, help="upload size limit, e.g. 200mb"
    )
    parser.add_argument(
        "--shared-history",
        action="store_true",
        help="one History and outputs folder for everyone, the outputs folder served (a personal machine); "
        "default: each user (--auth) or browser session sees only its own results",
    )
    parser.add_argument(
        "--lora-dir",
        default=environ.get("H3_LORA_DIR") or None,
        help="folder of LoRA adapters (.safetensors, subfolders too) offered in each tab's LoRA panel and by name "
        "in the API's loras parameter; env H3_LORA_DIR",
    )
    parser.add_argument(
        "--ray",
        default=environ.get("H3_RAY") or None,
        help="run the engine replicas on the Ray cluster at this address (auto: the cluster this node joined) "
        "as a Ray Serve deployment; each replica has --world-size GPUs, or CPU ranks with --devices cpu; "
        "needs `make ray`; env H3_RAY",
    )
    parser.add_argument(
        "--ray-replicas",
        type=int,
        default=environ.get("H3_RAY_REPLICAS") or "1",
        help="with --ray: how many engine replicas to deploy (jobs that run at once); env H3_RAY_REPLICAS",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=environ.get("H3_STALL_TIMEOUT") or None,
        metavar="SECONDS",
        help="worker groups (--world-size > 1, split stages, Ray replicas of several ranks): a job whose ranks "
        "report nothing for this long fails and its group restarts (default: derived from the step time, at "
        "least 5 minutes; see README); env H3_STALL_TIMEOUT",
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
    add_serving_flags(parser, environ)
    return parser


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> AppConfig:
    args = _parser(environ).parse_args(argv)
    auth = parse_users(args.auth or ([environ["H3_AUTH"]] if environ.get("H3_AUTH") else []), args.auth_file)
    devices = tuple(name.strip() for name in args.devices.split(",")) if args.devices else (None,)
    if args.queue_size < 1 or args.preview_every < 1:
        raise ConfigError("--queue-size and --preview-every must be at least 1")
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {args.world_size}")
    if args.ray_replicas < 1:
        raise ConfigError(f"--ray-replicas must be at least 1, got {args.ray_replicas}")
    if args.ray and args.devices and devices != ("cpu",):
        raise ConfigError(
            "--devices: with --ray give cpu (CPU replicas) or leave it out (Ray places the GPUs)"
        )
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port: must be within 1-65535, got {args.port}")
    try:
        serving = ServingOptions.from_args(args, environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for flag, size in (
        ("--max-body-size", serving.max_body_size),
        ("--max-inputs-size", serving.max_inputs_size),
    ):
        try:
            if size is not None:
                parse_file_size(size)
        except ConfigError as error:
            raise ConfigError(str(error).replace("--max-file-size", flag)) from None
    return AppConfig(
        checkpoint=Path(args.checkpoint).expanduser() if args.checkpoint else None,
        outputs_dir=Path(args.outputs or DEFAULT_OUTPUTS).expanduser().resolve(),
        cache_dir=default_cache_folder(environ),
        devices=devices,
        world_size=args.world_size,
        engine=EngineOptions.from_args(args),
        host=args.host,
        port=args.port,
        share=args.share,
        auth=auth,
        max_file_size=parse_file_size(args.max_file_size),
        queue_size=args.queue_size,
        preview_every=args.preview_every,
        warm_up=args.warm_up,
        shared_history=args.shared_history,
        lora_dir=Path(args.lora_dir).expanduser().resolve() if args.lora_dir else None,
        ray=args.ray,
        ray_replicas=args.ray_replicas,
        stall_timeout=args.stall_timeout,
        outputs_named=bool(args.outputs),
        cache_named=bool(environ.get("H3_CACHE_DIR")),
        serving=serving,
    )


def parse_users(pairs: Sequence[str], auth_file: str | None) -> tuple[tuple[str, str], ...]:
    """The users of `--auth USER:PASSWORD` (each flag one user) and of `--auth-file` (one USER:PASSWORD a line;
    blank lines and lines starting with # skipped). A pair without a colon, with an empty user or password, a user
    named twice, or a comma in an --auth value (a list there would otherwise read as one password) is a ConfigError
    naming the flag (and the file's line) but never the password."""
    users: dict[str, str] = {}

    def add(pair: str, where: str) -> None:
        user, separator, password = pair.partition(":")
        if not separator or not user.strip() or not password:
            raise ConfigError(f"{where}: expected USER:PASSWORD with neither empty")
        if user in users:
            raise ConfigError(f"{where}: user {user!r} is named twice")
        users[user] = password

    for pair in pairs:
        if "," in pair:
            raise ConfigError(
                "--auth: one USER:PASSWORD per --auth, and no comma in it: repeat --auth for more users, or put "
                "them in an --auth-file (one a line; a password may hold a comma there)"
            )
        add(pair, "--auth")
    if auth_file is not None:
        try:
            lines = Path(auth_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or error
            raise ConfigError(f"--auth-file: cannot read {auth_file} ({why})") from None
        before = len(users)
        for number, line in enumerate(lines, start=1):
            if line.strip() and not line.strip().startswith("#"):
                add(line.strip(), f"--auth-file: line {number} of {auth_file}")
        if len(users) == before:
            raise ConfigError(f"--auth-file: {auth_file} names no user (one USER:PASSWORD a line)")
    return tuple(users.items())


def settle_folders(config: AppConfig) -> AppConfig:
    """A default outputs or cache folder that cannot be written (a read-only install, e.g. a Space, or an unwritable
    HOME) is replaced by one in a folder of this process in the temp folder, with a log line; the next start removes
    it. A named folder stays, for `check_before_loading` to refuse."""
    from h3engine.media.leftovers import owned_temp_folder

    replaced: dict[str, Path] = {}
    fallback = None
    for field, named in (("outputs_dir", config.outputs_named), ("cache_dir", config.cache_named)):
        problem = None if named else cannot_write(getattr(config, field))
        if problem is not None:
            fallback = fallback or owned_temp_folder(FALLBACK_FOLDER_PREFIX)
            replaced[field] = fallback / field.removesuffix("_dir")
            logger.warning(
                "cannot write to %s (%s); using %s instead, which the next start removes",
                getattr(config, field),
                problem,
                replaced[field],
            )
    return replace(config, **replaced)


def with_adaln_cache(config: AppConfig) -> AppConfig:
    """The engines keep their AdaLN tables in the app's cache folder (wherever it settled), unless `--adaln-cache`
    says otherwise; without a cache folder that can be written they keep none. Called when models load (a refused
    option must leave no folder behind)."""
    if config.engine.adaln_cache is not None or cannot_write(config.cache_dir) is not None:
        return config
    from h3engine.engine.sampling.adaln_tables import ADALN_FOLDER_NAME  # torch: only once models load

    folder = str(config.cache_dir / ADALN_FOLDER_NAME)
    return replace(config, engine=replace(config.engine, adaln_cache=folder))


def parse_file_size(text: str) -> int:
    """'200mb' -> bytes: a whole number and a unit (b, kb, mb, gb, tb; powers of 1024, as Gradio counts)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-z]+)\s*", text.lower())
    if match is None or match.group(2) not in FILE_SIZE_UNITS or int(match.group(1)) < 1:
        raise ConfigError(
            f"--max-file-size: expected a whole number and a unit ({', '.join(FILE_SIZE_UNITS)}), e.g. 200mb, "
            f"got {text!r}"
        )
    return int(match.group(1)) * FILE_SIZE_UNITS[match.group(2)]


def memory_label(options: EngineOptions) -> str:
    """The memory flags in a few words for the page's header, e.g. "auto, 24 GiB per GPU, FP8 weights"."""
    parts = [options.memory_profile]
    if options.gpu_memory is not None:
        parts.append(f"{options.gpu_memory} GiB per GPU")
    if options.weights == "fp8":
        parts.append("FP8 weights (not the released precision)")
    return ", ".join(parts)


def check_before_loading(config: AppConfig) -> None:
    """What can fail without a model, checked before any is loaded (ConfigError naming the option): first what needs
    no torch (the address to listen on, the folders, the dtype and memory flags: told at once), then the layout and
    the devices, the stall timeout and the groups' devices, last the cache folder (its check makes it)."""
    _check_can_listen(config.host, config.port)
    if config.lora_dir is not None and not config.lora_dir.is_dir():
        raise ConfigError(f"--lora-dir: no such folder: {config.lora_dir}")
    problem = cannot_write(config.outputs_dir)
    if problem is not None:
        raise ConfigError(f"--outputs: cannot write to {config.outputs_dir} ({problem})")

    from h3engine.engine.options import check_engine_options, check_fp8_device, resolve_device
    from h3engine.errors import RequestError

    try:
        # The dtype and memory flags first: they need no torch.
        layout = check_engine_options(config.engine, config.world_size)
        if config.ray is not None:
            if layout.split:
                raise ConfigError(
                    "--stage-layout: split is not available with --ray yet (each Ray replica is one colocated group)"
                )
            from h3engine.runtime.ray_serve import require_ray

            require_ray()  # the devices are the cluster's, not this host's
        for name in config.devices if config.ray is None else ():
            device = resolve_device(name, "--devices")
            if config.engine.fp8_linear:
                check_fp8_device(device)
        # Last, what needs the engine's runtime imported (seconds).
        from h3engine.runtime.supervision import checked_stall_timeout
        from h3engine.runtime.workers import replica_device_groups, stage_devices

        checked_stall_timeout(config.stall_timeout)
        if (config.world_size > 1 or layout.split) and config.ray is None:
            for devices in replica_device_groups(config.devices, config.world_size):
                if layout.split:
                    stage_devices(layout, devices, config.engine.encoder_devices, config.engine.vae_devices)
    except RequestError as error:
        raise ConfigError(str(error)) from None
    # The cache holds the tiny demo checkpoint, made when no checkpoint is given.
    problem = None if config.checkpoint is not None else cannot_write(config.cache_dir)
    if problem is not None:
        raise ConfigError(f"H3_CACHE_DIR: cannot write to {config.cache_dir} ({problem})")


def _check_can_listen(host: str, port: int) -> None:
    try:
        family, kind, protocol, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as error:
        raise ConfigError(f"--host: cannot resolve {host!r} ({error})") from None
    with socket.socket(family, kind, protocol) as probe:
        # As the server does: a port in TIME_WAIT is no clash.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise ConfigError(f"--port: cannot listen on {host}:{port} ({error.strerror or error})") from None


def _load_engines(checkpoint: Path, config: AppConfig) -> list[Engine | ProcessReplica | RaySlot]:
    """One replica per device (in-process engines) or per group of `world_size` devices (worker groups), or the
    slots of the replicas on a Ray cluster."""
    from h3engine.engine.options import check_engine_options, load_engine, resolve_device

    config = with_adaln_cache(config)
    if config.ray is not None:
        return _start_ray_replicas(checkpoint, config)
    layout = check_engine_options(config.engine, config.world_size)
    if layout.world_size > 1 or layout.split:
        return _start_worker_groups(checkpoint, config, layout)
    engines = []
    for name in config.devices:
        device = resolve_device(name, "--devices")
        engine = load_engine(checkpoint, device, config.engine, on_load=_load_logger(str(device)))
        # A server switches partitions: the other one loads now, in the background, where the host budget holds it.
        engine.store.preload_other_partitions()
        engines.append(engine)
    return engines


def _load_logger(device: str) -> Callable[[LoadEvent], None]:
    """The engine's `on_load` at start-up (and at a partition's first use): one log line per component loaded."""
    from h3engine.cli.progress import load_line

    def log(event: LoadEvent) -> None:
        if event.seconds is not None:
            logger.info("%s: %s", device, load_line(event))

    return log


def _start_worker_groups(checkpoint: Path, config: AppConfig, layout: RuntimeLayout) -> list[ProcessReplica]:
    from h3engine.runtime.split import start_replica
    from h3engine.runtime.supervision import StallPolicy
    from h3engine.runtime.workers import replica_device_groups

    options = config.engine
    stall = StallPolicy(config.stall_timeout)
    replicas: list[ProcessReplica] = []
    try:
        for devices in replica_device_groups(config.devices, config.world_size):
            logger.info("starting a worker group on %s (%s)", ", ".join(devices), layout.describe())
            started = time.perf_counter()
            replicas.append(start_replica(checkpoint, devices, layout, options, stall))
            # Its ranks load in their own processes: the group is reported as a whole.
            logger.info(
                "loaded the worker group on %s in %.2f s", ", ".join(devices), time.perf_counter() - started
            )
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    return replicas


def _start_ray_replicas(checkpoint: Path, config: AppConfig) -> list[RaySlot]:
    from h3engine.runtime.ray_serve import RayReplicaSpec, start_ray_replicas

    spec = RayReplicaSpec(
        checkpoint=str(checkpoint.resolve()),
        world_size=config.world_size,
        gpus=config.devices != ("cpu",),
        engine=config.engine,
        warm_up=config.warm_up,
        python_path=str(REPOSITORY_ROOT),
        stall_timeout_s=config.stall_timeout,
    )
    started = time.perf_counter()
    engine = start_ray_replicas(config.ray or "auto", spec, config.ray_replicas)
    logger.info("%d Ray replicas ready in %.2f s", config.ray_replicas, time.perf_counter() - started)
    return engine.slots()


def _make_tiny_checkpoint_once(folder: Path) -> None:
    from h3engine.checkpoint.tiny import make_tiny_checkpoint

    if folder.is_dir():
        return
    logger.info("making the tiny random-weight checkpoint in %s", folder)
    try:
        make_tiny_checkpoint(folder, seed=0)
    except FileExistsError:
        pass  # another app instance made it first


def _tiny_engines(config: AppConfig) -> tuple[Path, list[Engine | ProcessReplica | RaySlot]]:
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


def random_weights_banner(folder: Path | None) -> str:
    """`folder`: the tiny checkpoint's folder, shown only where the page may carry server paths."""
    where = f" in `{folder}`" if folder is not None else " in its cache folder"
    return (
        "**Random weights.** No checkpoint was configured, so this app runs on a tiny random-weight checkpoint "
        f"it made{where}. Every step runs for real, but the pictures and the sound are noise (loud: the players "
        "start muted). To use the released "
        "MiniMax H3 weights, start `python app.py --checkpoint DIR` or set `H3_CHECKPOINT=DIR`."
    )


def placeholder_banner(name: str) -> str:
    return (
        f"**Placeholder weights.** The checkpoint `{name}` is a placeholder (`make-placeholder-checkpoint`): its "
        "weights are drawn when it loads, to measure the engine at the released size. Every step runs for real, "
        "but the pictures and the sound are noise (the players start muted)."
    )


def _stop_on_sigterm(
    front: EngineFront, before: Callable[[], None] = lambda: None
) -> Callable[[int, object], None]:
    """The SIGTERM handler: the front's shutdown (its ranks end within seconds, whatever they do) starts at once,
    while Gradio's blocking launch() closes the server on KeyboardInterrupt (up to 5 s while a job's stream is still
    open); `main` waits for both, so the app ends within 10 s."""

    def stop(signal_number: int, frame: object) -> None:
        before()
        threading.Thread(target=front.shutdown, name="h3-shutdown", daemon=True).start()
        raise KeyboardInterrupt

    return stop


def _end_heartbeats(demo: gr.Blocks) -> None:
    """End the heartbeat streams that every open page and API client holds, now.

    Gradio ends them when its app's stop event is set, but it sets that asyncio event from the main thread, and the
    server's event loop, which owns it, does not notice until something else wakes it: an open browser tab or a
    gradio_client held every stop for the whole 5 s that Gradio waits for its server. The event is set from its
    loop instead (the loop is known once a stream has waited on the event; before that there is nothing to end).
    """
    event = getattr(getattr(demo, "app", None), "stop_event", None)  # made by launch()
    loop = getattr(event, "_loop", None)  # asyncio's loop-bound primitives keep it there
    if event is not None and loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(event.set)


def remove_leftovers(outputs_dir: Path) -> None:
    """What a killed predecessor left: staging files and unpaired stamped MP4s under the outputs folder, the warm-up
    and worker folders in the temp folder (only those of dead processes; each removal is logged)."""
    from h3engine.media.leftovers import (
        GRADIO_FOLDER_PREFIX,
        WARM_UP_FOLDER_PREFIX,
        WORKER_FOLDER_PREFIX,
        remove_dead_temp_folders,
        remove_output_leftovers,
    )

    remove_output_leftovers(outputs_dir)
    for prefix in (WARM_UP_FOLDER_PREFIX, WORKER_FOLDER_PREFIX, GRADIO_FOLDER_PREFIX, FALLBACK_FOLDER_PREFIX):
        remove_dead_temp_folders(prefix)


def own_gradio_cache() -> Path | None:
    """Without GRADIO_TEMP_DIR, a Gradio cache of this process's own (`h3-gradio-PID-*` in the temp folder; set
    before gradio is imported, some of whose modules read it then): everything Gradio writes there (uploads, served
    copies, live preview images) is ours, swept by age and removed at exit. With GRADIO_TEMP_DIR set (e.g. Docker's
    /data/gradio, perhaps shared) only the files we know of are removed."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return None
    from h3engine.media.leftovers import GRADIO_FOLDER_PREFIX, owned_temp_folder

    folder = owned_temp_folder(GRADIO_FOLDER_PREFIX)
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    # Start-up (imports, models, the page) makes millions of long-lived objects and next to no garbage, which the
    # cyclic collector would walk again and again: ~0.6 s of CPU of a ~6.5 s start. It runs again once they are
    # frozen (settle_heap), or when start-up ends early.
    gc.disable()
    keep_compile_caches_in(default_cache_folder())
    try:
        return _start_and_serve(argv)
    finally:
        gc.enable()


def _start_and_serve(argv: Sequence[str] | None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per internal request otherwise
    from h3engine.errors import H3Error
    from h3engine.serving.store import JobStore, StoreError

    try:
        config = settle_folders(parse_config(argv, os.environ))
        check_before_loading(config)
        remove_leftovers(config.outputs_dir)
        # The job store: a corrupt or unwritable one is a one-line start-up error, before any model loads.
        state_dir = config.serving.state_dir
        store = JobStore.open(state_dir or config.outputs_dir, "--state-dir" if state_dir else "--outputs")
        if config.checkpoint is None:
            checkpoint, engines = _tiny_engines(config)
            banner = random_weights_banner(checkpoint if config.shared_history else None)
        else:
            from h3engine.checkpoint.placeholder import is_placeholder  # after the options' checks: torch

            checkpoint, engines = config.checkpoint, _load_engines(config.checkpoint, config)
            banner = placeholder_banner(checkpoint.name) if is_placeholder(checkpoint) else None
    except (ConfigError, H3Error, StoreError) as error:
        if "store" in locals():
            store.close()
        print(f"error: {error}", file=sys.stderr)
        return 2

    gradio_cache = own_gradio_cache()
    import ui
    from h3engine.runtime.front import EngineFront, settle_heap

    front = EngineFront(
        engines,
        config.outputs_dir,
        preview_every=config.preview_every,
        # Ray replicas warm up in their own start (h3engine.runtime.ray_serve).
        warm_up=config.warm_up and config.ray is None and any(_computes_on_cuda(r) for r in engines),
    )
    options = ui.UiOptions(
        outputs_dir=config.outputs_dir,
        examples_path=EXAMPLES_PATH,
        repository_root=REPOSITORY_ROOT,
        # The page config is the same for everyone: only a single-user app shows the server path.
        checkpoint_label=str(checkpoint) if config.shared_history else checkpoint.name,
        memory_profile=memory_label(config.engine),
        banner_markdown=banner,
        max_jobs=config.queue_size,
        lora_dir=config.lora_dir,
    )
    access = ui.AccessPolicy(
        config.outputs_dir,
        config.shared_history,
        max_age_s=CACHE_MAX_AGE_S,
        sweep_every_s=CACHE_SWEEP_S,
        owned_cache=gradio_cache,
    )
    from h3engine.engine.lora.library import LoraLibrary
    from h3engine.serving.server import start_serving

    serving = start_serving(
        front,
        store,
        config.outputs_dir,
        config.serving,
        host=config.host,
        share=config.share,
        max_body_bytes=parse_file_size(config.serving.max_body_size or str(config.max_file_size) + "b"),
        max_inputs_bytes=parse_file_size(config.serving.max_inputs_size),
        queue_size=config.queue_size,
        library=LoraLibrary(config.lora_dir),
        shared_history=config.shared_history,
    )
    demo = ui.build_ui(
        front, options, access, delete_cache=(CACHE_SWEEP_S, CACHE_MAX_AGE_S), jobs=serving.jobs
    )
    demo.queue(default_concurrency_limit=LIGHT_EVENT_CONCURRENCY, max_size=config.queue_size)
    settle_heap()
    gc.enable()

    def before_stopping() -> None:
        serving.stop_taking()  # the job store keeps the jobs the shutdown cancels queued
        _end_heartbeats(demo)

    signal.signal(signal.SIGTERM, _stop_on_sigterm(front, before_stopping))
    try:
        demo.launch(
            server_name=config.host,
            server_port=config.port,
            share=config.share,
            auth=list(config.auth) or None,
            max_file_size=config.max_file_size,
            allowed_paths=[str(config.outputs_dir)] if config.shared_history else [],
            theme=ui.THEME,
            css=ui.CSS,
            head=ui.HEAD,
            js=ui.page_js(muted_media=banner is not None),
            show_error=False,
            enable_monitoring=False,
            run_history=False,
            mcp_server=False,
            ssr_mode=False,
            footer_links=["api", "gradio", "settings"],
            # /v1/videos, /metrics, /healthz, /readyz beside Gradio's own routes (h3engine.serving.api); the page
            # load gives a browser its History's cookie, and with --auth results go to their user only (ui.access).
            app_kwargs={"routes": serving.routes(), "middleware": _page_middleware(config, access)},
        )
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM before launch() reached its own blocking loop (which handles them itself): the server
        # may already be up in its thread.
        demo.close()
    finally:
        serving.stop_taking()  # jobs the shutdown cancels stay queued in the store, for the next start
        front.shutdown()
        serving.close()
        _delete_cached_files(demo, access)
        if gradio_cache is not None:
            shutil.rmtree(gradio_cache, ignore_errors=True)
    return 0


def _page_middleware(config: AppConfig, access: AccessPolicy) -> list[object]:
    """The page's cookie for a browser's History (not with --shared-history), and with --auth each user's results
    served to that user only (ui.access)."""
    from starlette.middleware import Middleware

    from ui.access import BrowserCookie, OwnerOnlyFiles

    middleware = [] if config.shared_history else [Middleware(BrowserCookie)]
    if config.auth:
        middleware.append(Middleware(OwnerOnlyFiles, access=access))
    return middleware


def _delete_cached_files(demo: gr.Blocks, access: AccessPolicy) -> None:
    """At exit: our served copies (ui.access), and the uploads Gradio's delete_cache tracks. Gradio deletes those
    in the server's shutdown, which a still-connected browser can hold past the 5 s Gradio waits: run it again."""
    from gradio.route_utils import delete_files_created_by_app

    access.sweep(None)
    delete_files_created_by_app(demo, age=None)


if __name__ == "__main__":
    sys.exit(main())
