"""Who is attached to a tensor channel (h3engine.runtime.channel), alive or closed: one shared array holds each
role's pid, start time and closed flag, and the channel's closing flag.

Liveness comes from /proc (pid plus the kernel's start time, so a zombie or a reused pid counts as gone): Linux
only. `remove_shared_memory_of` cleans what a process that died outright left in /dev/shm.
"""

from __future__ import annotations

import enum
import os
from multiprocessing.context import BaseContext
from pathlib import Path

from h3engine.runtime.channel_errors import ChannelClosed, ChannelError


class Role(enum.IntEnum):
    PRODUCER = 0
    CONSUMER = 1


class Peer(enum.Enum):
    UNCLAIMED = "unclaimed"
    ALIVE = "alive"
    CLOSED = "closed"
    GONE = "gone"


def remove_shared_memory_of(dead_pid: int) -> None:
    """Unlink the /dev/shm files torch made in a process that died without its exit handlers.

    torch names them `torch_<pid>_...` (for instance the reference counts it keeps for CUDA tensors shared over
    IPC); a process killed outright never removes them. Only called once `dead_pid` is known to be gone.
    """
    for path in Path("/dev/shm").glob(f"torch_{dead_pid}_*"):
        try:
            path.unlink()
        except OSError:
            pass


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of a running process (clock ticks after boot); None once it has exited.

    A dead child stays a zombie until its parent joins it, and `os.kill(pid, 0)` still succeeds on a zombie, so
    the state letter is what tells; the start time tells a reused pid apart.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or parentheses.
    fields_after_name = stat[stat.rindex(b")") + 2 :].split()
    if fields_after_name[0] in (b"Z", b"X"):
        return None
    return int(fields_after_name[19])


class SharedState:
    """Per role: pid, start ticks, closed flag; plus the channel's closing flag. One shared int64 array."""

    _FIELDS_PER_ROLE = 3
    _CLOSING = 2 * _FIELDS_PER_ROLE

    def __init__(self, context: BaseContext) -> None:
        self._values = context.Array("q", self._CLOSING + 1)

    def claim(self, role: Role, describe: str) -> None:
        base = role * self._FIELDS_PER_ROLE
        pid = os.getpid()
        with self._values.get_lock():
            if self._values[self._CLOSING]:
                raise ChannelClosed(f"{describe} is closing; no {role.name.lower()} can attach")
            if self._values[base]:
                raise ChannelError(
                    f"{describe} already has a {role.name.lower()} (pid {self._values[base]}); each side is "
                    f"claimed once per channel"
                )
            self._values[base] = pid
            self._values[base + 1] = start_ticks(pid)

    def pid(self, role: Role) -> int:
        return self._values[role * self._FIELDS_PER_ROLE]

    def status(self, role: Role) -> Peer:
        base = role * self._FIELDS_PER_ROLE
        with self._values.get_lock():
            pid, started, closed = self._values[base : base + self._FIELDS_PER_ROLE]
        if pid == 0:
            return Peer.UNCLAIMED
        if closed:
            return Peer.CLOSED
        return Peer.ALIVE if start_ticks(pid) == started else Peer.GONE

    def mark_closed(self, role: Role) -> None:
        self._values[role * self._FIELDS_PER_ROLE + 2] = 1

    def set_closing(self) -> None:
        with self._values.get_lock():
            self._values[self._CLOSING] = 1

    def closing(self) -> bool:
        return bool(self._values[self._CLOSING])
