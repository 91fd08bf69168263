"""Error types a user can act on.

Every error that reaches the CLI or the app as a readable message is one of these; anything else is an
internal error (exit code 1 on the CLI).
"""


class H3Error(Exception):
    """Base class of the errors whose message is shown to the user as it is."""


class CheckpointError(H3Error):
    """The checkpoint folder is missing, incomplete or inconsistent; the message names the file and key."""


class RequestError(H3Error):
    """The request or one of its input files is invalid; the message names the field or file."""


class GenerationCancelled(H3Error):
    """The request was cancelled before it finished."""
