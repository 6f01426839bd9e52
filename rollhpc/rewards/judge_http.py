"""A judge model behind an OpenAI-compatible server (vLLM's ``api_server``, SGLang, a hosted API).

Stdlib only (urllib): the reward role must not depend on a client library's version. One request per
prompt, ``concurrency`` at a time (the server batches concurrent requests itself), greedy, each bounded:

- every attempt has ``timeout_s`` on connect and on each read;
- a refused connection, a timeout, HTTP 429 or 5xx is retried up to ``retries`` times after
  ``backoff_s``, 2 x ``backoff_s``, ...; other HTTP errors (400: prompt too long, no chat template) are
  not retried;
- a prompt still without an answer returns None: the caller scores it 0 and counts the failure.

So one prompt never takes longer than about (retries + 1) x timeout_s + the backoffs, and a batch about
ceil(len / concurrency) times that: a dead judge slows a step down, it never hangs it. (A server that
trickles one byte per ``timeout_s`` could stretch a read; urllib has no whole-request deadline.)

``model=None`` asks the server (``GET /v1/models``) and uses the first model it serves.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["HttpJudge"]

log = logging.getLogger(__name__)
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class HttpJudge:
    """``complete(prompts, max_tokens) -> list[str | None]`` over HTTP (None: no answer, see module doc)."""

    def __init__(
        self,
        endpoint: str,
        model: str | None = None,
        *,
        api: Literal["completions", "chat"] = "completions",
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        concurrency: int = 8,
    ) -> None:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"judge endpoint must be an http(s):// URL, got {endpoint!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or concurrency < 1:
            raise ValueError("need timeout_s > 0, retries >= 0, backoff_s >= 0, concurrency >= 1")
        base = endpoint.rstrip("/")
        # accept http://host:port and .../v1
        self.base = base[:-3] if base.endswith("/v1") else base
        self.model = model
        self.api = api
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="rollhpc-judge-http")

    def complete(self, prompts: list[str], max_tokens: int) -> list[str | None]:
        if not prompts:
            return []
        if self.model is None:
            self.model = self._served_model()
            if self.model is None:
                return [None] * len(prompts)
        return list(self._pool.map(lambda p: self._complete_one(p, max_tokens), prompts))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _complete_one(self, prompt: str, max_tokens: int) -> str | None:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            reply = self._request("/v1/chat/completions", body)
            return None if reply is None else _choice(reply, lambda c: c["message"]["content"])
        body["prompt"] = prompt
        reply = self._request("/v1/completions", body)
        return None if reply is None else _choice(reply, lambda c: c["text"])

    def _served_model(self) -> str | None:
        reply = self._request("/v1/models", None)
        try:
            return str(reply["data"][0]["id"]) if reply is not None else None
        except (KeyError, IndexError, TypeError):
            log.warning("judge endpoint %s: /v1/models lists no model", self.base)
            return None

    def _request(self, path: str, body: dict[str, Any] | None) -> object:
        """The JSON reply (any JSON value: the callers index it under try), or None once the
        attempts are spent (logged then; each attempt at debug level)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"}
        )
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {_detail(e)}"
                if e.code not in _RETRY_STATUS:
                    break
            except (
                OSError,
                http.client.HTTPException,
                ValueError,
            ) as e:  # refused, timeout, cut off, not JSON
                error = f"{type(e).__name__}: {e}"
            log.debug("judge %s%s, attempt %d: %s", self.base, path, attempt + 1, error)
        log.warning(
            "judge %s%s failed after %d attempt(s): %s", self.base, path, attempt + 1, error
        )
        return None


def _detail(e: urllib.error.HTTPError) -> str:
    try:
        return e.read()[:300].decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return ""


def _choice(reply: object, text: Callable[[dict[str, Any]], object]) -> str | None:
    """What ``text`` reads off the reply's first choice; None when that is not a string."""
    try:
        value = text(reply["choices"][0])
    except (KeyError, IndexError, TypeError):
        return None
    return value if isinstance(value, str) else None
