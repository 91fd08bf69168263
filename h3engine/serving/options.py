"""The serving flags of app.py: job store, API keys, limits, webhooks, retention (`add_serving_flags`).

`ServingOptions.from_args(args, environ)` reads them (ValueError naming the flag for a bad one); keys come from
`--api-key` (repeatable), `--api-key-file` (one a line, # comments) and H3_API_KEYS (comma-separated). No flag
given: the app serves /v1 on loopback without keys, with its store in the outputs folder.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_JOBS_PER_OWNER = 8
DEFAULT_MAX_INPUTS_SIZE = "4gb"


@dataclass(frozen=True)
class ServingOptions:
    state_dir: Path | None = None  # None: the outputs folder
    api_keys: tuple[str, ...] = ()
    max_queue: int | None = None  # None: the app's --queue-size
    max_jobs_per_owner: int = DEFAULT_MAX_JOBS_PER_OWNER
    max_body_size: str | None = None  # None: the app's --max-file-size
    webhook_url: str | None = None
    webhook_secret: str | None = None
    keep_days: float | None = None
    max_outputs_gb: float | None = None
    max_inputs_size: str = DEFAULT_MAX_INPUTS_SIZE  # an owner's uploaded files and job inputs together

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ServingOptions:
        keys = list(args.api_key or [])
        keys += [key.strip() for key in environ.get("H3_API_KEYS", "").split(",") if key.strip()]
        if args.api_key_file:
            try:
                lines = Path(args.api_key_file).expanduser().read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"--api-key-file: cannot read {args.api_key_file} ({error})") from None
            keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        for key in keys:
            if len(key) < 8 or any(character.isspace() for character in key):
                raise ValueError("--api-key: a key must be at least 8 characters, without spaces")
        for flag, value, minimum in (
            ("--max-queue", args.max_queue, 1),
            ("--max-jobs-per-owner", args.max_jobs_per_owner, 1),
            ("--keep-days", args.keep_days, 0),
            ("--max-outputs-gb", args.max_outputs_gb, 0),
        ):
            if value is not None and not value >= minimum:
                raise ValueError(f"{flag}: must be at least {minimum}, got {value}")
        if args.webhook_url and not args.webhook_url.startswith(("http://", "https://")):
            raise ValueError(f"--webhook-url: must be an http:// or https:// URL, got {args.webhook_url!r}")
        return cls(
            state_dir=Path(args.state_dir).expanduser().resolve() if args.state_dir else None,
            api_keys=tuple(dict.fromkeys(keys)),
            max_queue=args.max_queue,
            max_jobs_per_owner=args.max_jobs_per_owner,
            max_body_size=args.max_body_size,
            webhook_url=args.webhook_url or None,
            webhook_secret=args.webhook_secret or None,
            keep_days=args.keep_days,
            max_outputs_gb=args.max_outputs_gb,
            max_inputs_size=args.max_inputs_size,
        )


def add_serving_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    group = parser.add_argument_group("API and job store (see README: 'The /v1/videos API')")
    group.add_argument(
        "--state-dir",
        default=environ.get("H3_STATE_DIR") or None,
        help="folder of the job store (h3-jobs.sqlite3); default: the outputs folder; env H3_STATE_DIR",
    )
    group.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="a bearer key for /v1 (repeat for more; each key sees only its own jobs); env H3_API_KEYS "
        "(comma-separated). Without keys /v1 answers only when the app binds a loopback address",
    )
    group.add_argument(
        "--api-key-file",
        default=environ.get("H3_API_KEY_FILE") or None,
        metavar="FILE",
        help="a file of API keys, one a line (# starts a comment); env H3_API_KEY_FILE",
    )
    group.add_argument(
        "--max-queue",
        type=int,
        default=environ.get("H3_MAX_QUEUE") or None,
        metavar="N",
        help="API jobs refused with 429 and Retry-After while N jobs wait (default: --queue-size)",
    )
    group.add_argument(
        "--max-jobs-per-owner",
        type=int,
        default=environ.get("H3_MAX_JOBS_PER_OWNER") or str(DEFAULT_MAX_JOBS_PER_OWNER),
        metavar="N",
        help=f"an API key's jobs queued or running at once (default {DEFAULT_MAX_JOBS_PER_OWNER})",
    )
    group.add_argument(
        "--max-body-size",
        default=environ.get("H3_MAX_BODY_SIZE") or None,
        help="largest /v1 request body, e.g. 50mb (413 past it; default: --max-file-size)",
    )
    group.add_argument(
        "--max-inputs-size",
        default=environ.get("H3_MAX_INPUTS_SIZE") or DEFAULT_MAX_INPUTS_SIZE,
        metavar="SIZE",
        help="what an API key's uploaded files and job inputs may take together, e.g. 2gb (429 past it; "
        f"default {DEFAULT_MAX_INPUTS_SIZE}); env H3_MAX_INPUTS_SIZE",
    )
    group.add_argument(
        "--webhook-url",
        default=environ.get("H3_WEBHOOK_URL") or None,
        metavar="URL",
        help="POST every API job's ending here (a request's callback_url wins); env H3_WEBHOOK_URL",
    )
    group.add_argument(
        "--webhook-secret",
        default=environ.get("H3_WEBHOOK_SECRET") or None,
        metavar="SECRET",
        help="sign webhooks: webhook-signature v1=HMAC-SHA256(secret, timestamp.body); env H3_WEBHOOK_SECRET",
    )
    group.add_argument(
        "--keep-days",
        type=float,
        default=environ.get("H3_KEEP_DAYS") or None,
        metavar="DAYS",
        help="remove results older than DAYS (their records stay, marked expired); env H3_KEEP_DAYS",
    )
    group.add_argument(
        "--max-outputs-gb",
        type=float,
        default=environ.get("H3_MAX_OUTPUTS_GB") or None,
        metavar="GB",
        help="remove the oldest results while they take more than GB; env H3_MAX_OUTPUTS_GB",
    )
