"""The life of a rank process, for worker ranks (h3engine.runtime.rank) and stage ranks (h3engine.runtime.stages).

`run_rank(rank, label, commands, messages, start)` is the body of both process targets: it leaves Ctrl-C to the front,
ends with its parent, logs under `label`, starts the rank (`start`, which joins the world with `join_world` and
builds the engine with `rank_engine`), says `RankReady` and serves commands in arrival order until `Stop` (or the
front closes its end). Messages go to the front through an `Outbox`, whose thread owns the pipe so that posting
never makes the denoising loop wait.

Failure: a rank that cannot start, or whose job raised past its own handling (h3engine.runtime.rank_jobs), reports
`RankFailed` and exits at once, without the process groups' teardown: partners may be stuck in a collective with it.
The front then restarts the group. A hung rank is the front's to detect, not the collectives' timeout.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import queue
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from h3engine.engine.engine import Engine
from h3engine.engine.model_store import ModelLoader
from h3engine.engine.options import engine_layout, resolve_dtype
from h3engine.errors import H3Error
from h3engine.memory.engine_plan import MemoryRequest
from h3engine.memory.sizes import RankShare
from h3engine.models.parallel.groups import initialize_process_group
from h3engine.runtime.channel_errors import ChannelClosed, ChannelPeerGone
from h3engine.runtime.front import EVENT_BUFFER_SIZE, release_memory, settle_heap
from h3engine.runtime.job_protocol import (
    JobCommand,
    RankFailed,
    RankOutOfMemory,
    RankReady,
    RankSpec,
    Stop,
    job_of,
)

logger = logging.getLogger(__name__)

# Long enough for the slowest collective partner at the released size (rank 0 stitching the decoded video while
# the others wait in the next job's broadcast).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
EXIT_JOB_FAILED = 1
EXIT_START_FAILED = 2
EXIT_PARENT_GONE = 3
OUTBOX_FLUSH_TIMEOUT_S = 5.0
# What a rank process runs, imported once by the fork server that every rank is forked from (`rank_context`).
RANK_MODULES = ["__main__", "h3engine.runtime.rank", "h3engine.runtime.stages"]
MAX_UNIX_SOCKET_PATH = 107  # bytes of sun_path before its NUL (Linux)
# The folder that holds the h3engine package, put on the fork server's import path (`_start_fork_server`).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_FORK_SERVER_START = threading.Lock()


def rank_context() -> Any:
    """The multiprocessing context that starts rank processes: a fork server that has imported the rank code.

    A spawned interpreter imports torch, transformers and the engine again at every start and every restart of a
    group (seconds of CPU each); a rank forked from the server has them already. Importing does not touch CUDA, so
    each rank still initializes its own GPU. Start the target through `in_front_environment`: a forked rank would
    otherwise run under the environment the server was started with, not the one its front has now.
    """
    # The server listens on a Unix socket in multiprocessing's folder under TMPDIR; a socket path past 107 bytes
    # cannot be bound, so under so deep a TMPDIR ranks are spawned instead (slower starts, the same ranks).
    socket_path = os.path.join(multiprocessing.util.get_temp_dir(), "listener-" + "x" * 8)
    if len(os.fsencode(socket_path)) > MAX_UNIX_SOCKET_PATH:
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_MODULES)
    _start_fork_server()
    return context


def _start_fork_server() -> None:
    """Start the fork server if it is not running, with the h3engine package's folder on its import path.

    The server is handed its parent's sys.path but does not use it (CPython 3.11 to 3.13 read it nowhere), and its
    preload skips a module it cannot import without a word. So under a front started from another folder (an app run
    as `python /path/to/app.py`, as the tests do) the preload imported nothing, and every rank imported torch,
    transformers and the engine anew: about 4 s of CPU per rank at every start and restart of a group. The variable
    is set only while the server starts; ranks run under their front's environment (`in_front_environment`).
    """
    with _FORK_SERVER_START:
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (PACKAGE_ROOT, saved) if path)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved


def in_front_environment(environment: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """Run `target(*args)` under `environment` (the front's `os.environ` when it started this rank), as spawn did."""
    os.environ.clear()
    os.environ.update(environment)
    tempfile.tempdir = None  # read again from TMPDIR and its kin
    target(*args)


class Outbox:
    """Messages to the front, sent by a background thread that owns the pipe, so that posting never blocks.

    `offer` drops the message when `EVENT_BUFFER_SIZE` are already waiting (progress and previews: the newest state
    wins later); `post` always queues (starts, outcomes, reports). `close` sends what is queued (up to a timeout)
    and stops the thread.
    """

    _CLOSE = object()

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._send_loop, name="h3-outbox", daemon=True)
        self._thread.start()

    def offer(self, message: Any) -> None:
        if self._queue.qsize() < EVENT_BUFFER_SIZE:
            self._queue.put(message)

    def post(self, message: Any) -> None:
        self._queue.put(message)

    def close(self, timeout: float = OUTBOX_FLUSH_TIMEOUT_S) -> None:
        self._queue.put(self._CLOSE)
        self._thread.join(timeout)

    def _send_loop(self) -> None:
        while (message := self._queue.get()) is not self._CLOSE:
            try:
                self._connection.send(message)
            except OSError:
                return  # the front is gone; the parent watch ends this process


class RankServer(Protocol):
    """What `start` returns: a loaded rank that serves commands (h3engine.runtime.rank_jobs.JobRank)."""

    @property
    def device(self) -> torch.device: ...

    def ready(self) -> RankReady:
        """The report that the rank has loaded."""
        ...

    def serve(self, command: Any) -> None:
        """Run one command; raises only on a failure that leaves the group out of step."""
        ...

    def close(self) -> None: ...


def _exit_with_parent() -> None:
    """End this process as soon as the one that spawned it is gone (killed or crashed without cleaning up)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="h3-parent-watch", daemon=True).start()


def _begin_rank_process(messages: Connection, label: str) -> Outbox:
    """What every rank process does first: leave Ctrl-C to the front (a terminal sends it to the whole process
    group; only the front decides when ranks stop), end with its parent, log under `label`; its outbox."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s")
    return Outbox(messages)


def _fail_and_exit(outbox: Outbox, report: RankFailed, exit_code: int) -> NoReturn:
    outbox.post(report)
    outbox.close()
    # No orderly teardown: partners may be stuck in a collective with this rank, and the process groups' shutdown
    # could wait for them. The operating system frees the memory (GPU memory included) with the process.
    os._exit(exit_code)


def join_world(rank: int, spec: RankSpec, cpu_threads: int | None) -> torch.device:
    """This rank's device, once it has joined its group's world (gloo on the CPU, NCCL on GPUs; a world of one joins
    nothing); `cpu_threads`: the threads it computes with (None: torch's default)."""
    device = torch.device(spec.devices[rank])
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if spec.world_size > 1:
        initialize_process_group(rank, spec.world_size, spec.init_method, device, timeout=COLLECTIVE_TIMEOUT)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def rank_engine(
    spec: RankSpec, device: torch.device, loader: ModelLoader, share: RankShare | None = None
) -> Engine:
    """The rank's engine under the spec's engine options (dtype, memory profile, budgets, weights), planning its
    memory for `share` of the models (None: every model whole)."""
    memory = MemoryRequest.from_options(spec.options)
    if share is not None:
        memory = replace(memory, share=share)
    dtype = resolve_dtype(spec.options.dtype, device)
    return Engine(engine_layout(spec.checkpoint, spec.options), device, dtype, memory, loader=loader)


def _next_command(commands: Connection) -> JobCommand | None:
    """The next job command; None at `Stop` or when the front closed its end (nothing more will come)."""
    try:
        command = commands.recv()
    except EOFError:
        return None
    return None if isinstance(command, Stop) else command


def run_rank(
    rank: int,
    label: str,
    commands: Connection,
    messages: Connection,
    start: Callable[[Outbox], RankServer],
) -> None:
    """The body of a rank process: start, report ready, serve commands until `Stop` (see the module docstring)."""
    # What the fork server imported is frozen first: the collections of the rank's start would otherwise walk all of
    # it, writing into each object's header (copying the shared pages), about half a rank's start-up CPU.
    gc.freeze()
    outbox = _begin_rank_process(messages, label)
    try:
        server = start(outbox)
    except H3Error as error:
        _fail_and_exit(outbox, RankFailed(rank, None, "checkpoint", str(error)), EXIT_START_FAILED)
    except Exception as error:
        logger.exception("%s could not start", label)
        _fail_and_exit(outbox, RankFailed(rank, None, "internal", type(error).__name__), EXIT_START_FAILED)
    settle_heap()
    outbox.post(server.ready())
    while (command := _next_command(commands)) is not None:
        try:
            server.serve(command)
        except Exception as error:
            job = job_of(command)
            logger.exception("%s failed during job %s", label, job.job_id)
            message = str(error) if isinstance(error, RankOutOfMemory) else type(error).__name__
            kind = "channel" if isinstance(error, (ChannelPeerGone, ChannelClosed)) else "internal"
            _fail_and_exit(outbox, RankFailed(rank, job.job_number, kind, message), EXIT_JOB_FAILED)
        finally:
            release_memory(server.device)
    server.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    outbox.close()
