"""What a tensor channel (h3engine.runtime.channel) raises: `ChannelError` and its kinds, which tell a caller whether
the other side timed out, died or closed.
"""

from __future__ import annotations


class ChannelError(RuntimeError):
    """The tensor channel cannot carry on; the message names the channel and what went wrong."""


class ChannelTimeout(ChannelError):
    """A send found no free slot, or a receive found no message, within its timeout; the other side is alive."""


class ChannelPeerGone(ChannelError):
    """The process at the other end exited without closing its endpoint."""


class ChannelClosed(ChannelError):
    """This endpoint, the other one or the whole channel was closed; no more tensors travel."""
