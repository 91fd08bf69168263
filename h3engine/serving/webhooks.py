"""Webhooks: a job's ending POSTed to its `callback_url` (and/or `--webhook-url`), signed, retried, off the queue.

Contract: `Webhooks.send(url, payload)` returns at once; a sender thread POSTs the JSON body with the headers
`webhook-id`, `webhook-timestamp` (Unix seconds) and, with a secret, `webhook-signature: v1=<hex>` where hex is
HMAC-SHA256(secret, f"{timestamp}.{body}") (`signature`). A delivery that fails (no answer in `timeout_s`, or a
status other than 2xx) is tried again after 1, 2, 4, ... s (`backoff_s` doubling), `attempts` times in all, then
dropped with a log line. Deliveries wait in a heap by due time, so a failing receiver never holds up the queue or
another delivery for longer than one attempt's timeout.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_ATTEMPTS = 5
DEFAULT_BACKOFF_S = 1.0
DEFAULT_TIMEOUT_S = 5.0


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode("utf-8"), timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


class Webhooks:
    def __init__(
        self,
        secret: str | None = None,
        attempts: int = DEFAULT_ATTEMPTS,
        backoff_s: float = DEFAULT_BACKOFF_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        senders: int = 2,
    ) -> None:
        self.secret, self.attempts, self.backoff_s, self.timeout_s = secret, attempts, backoff_s, timeout_s
        self._heap: list[tuple[float, int, str, bytes, str, int]] = []
        self._order = itertools.count()
        self._condition = threading.Condition()
        self._stopped = False
        self.delivered = 0
        self.dropped = 0
        self._threads = [
            threading.Thread(target=self._loop, name=f"h3-webhooks-{index}", daemon=True)
            for index in range(senders)
        ]
        for thread in self._threads:
            thread.start()

    def send(self, url: str, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
        delivery_id = "wh_" + secrets.token_hex(12)
        with self._condition:
            heapq.heappush(self._heap, (time.monotonic(), next(self._order), url, body, delivery_id, 1))
            self._condition.notify()

    def close(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        for thread in self._threads:
            thread.join(1.0)

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic())
                    self._condition.wait(wait)
                if self._stopped:
                    return
                _due, _order, url, body, delivery_id, attempt = heapq.heappop(self._heap)
            if self._deliver(url, body, delivery_id):
                self.delivered += 1
                continue
            if attempt >= self.attempts:
                self.dropped += 1
                logger.warning(
                    "webhook %s to %s: no success in %d attempts; dropped", delivery_id, url, attempt
                )
                continue
            due = time.monotonic() + self.backoff_s * 2 ** (attempt - 1)
            with self._condition:
                heapq.heappush(self._heap, (due, next(self._order), url, body, delivery_id, attempt + 1))
                self._condition.notify()

    def _deliver(self, url: str, body: bytes, delivery_id: str) -> bool:
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "webhook-id": delivery_id,
            "webhook-timestamp": timestamp,
        }
        if self.secret:
            headers["webhook-signature"] = signature(self.secret, timestamp, body)
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return 200 <= response.status < 300
        except (urllib.error.URLError, OSError, ValueError) as error:
            logger.info("webhook %s to %s failed: %s", delivery_id, url, error)
            return False
