"""Pieces shared by the sync and async clients: configuration, retry policy, error decoding."""

from __future__ import annotations

import base64
import json
import os
import random
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
from typing_extensions import Unpack

from .errors import DsecConnectionError, DsecError, DsecTimeoutError, error_from_problem
from .types import CreateOptions, ExecEvent, ExecResult

DEFAULT_URL = "http://127.0.0.1:7700"
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_RETRIES = 3
#: extra seconds the HTTP read timeout allows beyond a server-side deadline
DEADLINE_SLACK = 30.0
#: the server's longest long-poll (``?timeout=``), in milliseconds
MAX_LONG_POLL_MS = 120_000
MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
RETRY_STATUSES = frozenset({502, 503, 504})
#: answers with these codes are final even when their status is 502/503/504
NON_TRANSIENT_CODES = frozenset({"exec_timeout"})
#: transport failures after which the request may be retried (the server may or may not have
#: seen it; the idempotency key makes the retry safe)
RETRY_EXCEPTIONS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.PoolTimeout,
)
#: transport failures an attempt ends with: retried ones, and timeouts (raised as such)
ATTEMPT_EXCEPTIONS: tuple[type[Exception], ...] = (*RETRY_EXCEPTIONS, httpx.TimeoutException)

#: query parameters as httpx takes them (a mapping, or pairs for repeated keys)
Params = Any


def resolve_config(base_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """Apply the environment defaults ``DSEC_URL`` and ``DSEC_API_KEY``."""
    url = base_url or os.environ.get("DSEC_URL") or DEFAULT_URL
    key = api_key if api_key is not None else os.environ.get("DSEC_API_KEY")
    return url.rstrip("/"), key


def auth_headers(api_key: str | None) -> dict[str, str]:
    h = {"Accept": "application/json", "User-Agent": "dsec-python/0.1"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def new_idempotency_key() -> str:
    return f"py-{uuid.uuid4().hex}"


def make_timeout(seconds: float | None) -> httpx.Timeout:
    if seconds is None:
        return httpx.Timeout(None, connect=10.0)
    return httpx.Timeout(seconds, connect=min(10.0, seconds))


def backoff_delay(attempt: int, retry_after: float | None, base: float = 0.2) -> float:
    """Exponential back-off with jitter; honours ``Retry-After`` (capped at 10 s)."""
    if retry_after is not None:
        return max(0.0, min(retry_after, 10.0))
    return min(base * (2.0**attempt), 5.0) * (0.5 + random.random() / 2)


def parse_retry_after(resp: httpx.Response) -> float | None:
    v = resp.headers.get("retry-after")
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        return None


def error_from_response(resp: httpx.Response, body: bytes | None = None) -> DsecError:
    """Decode a problem+json answer (or anything else with an error status)."""
    raw = body if body is not None else resp.content
    problem: dict[str, Any] = {}
    try:
        parsed = json.loads(raw) if raw else {}
        if isinstance(parsed, dict):
            problem = parsed
    except ValueError:
        problem = {}
    if not problem and raw:
        problem = {"detail": raw[:500].decode("utf-8", errors="replace")}
    return error_from_problem(
        problem,
        resp.status_code,
        request_id=resp.headers.get("x-request-id"),
        retry_after=parse_retry_after(resp),
    )


def is_retryable_response(resp: httpx.Response, err: DsecError) -> bool:
    return resp.status_code in RETRY_STATUSES and err.code not in NON_TRANSIENT_CODES


class Attempts:
    """The retry policy of one request: how long to pause before the next attempt, or the
    error to raise when there is none. Each attempt is sent with the same headers (the same
    ``Idempotency-Key``)."""

    def __init__(self, method: str, headers: Mapping[str, str], max_retries: int) -> None:
        self.method = method.upper()
        self.keyed = "Idempotency-Key" in headers
        self.max_retries = max_retries
        self.attempt = 0

    def _may_retry(self, exc: BaseException | None) -> bool:
        """A mutation without a key is retried only when it never reached the server."""
        if self.method not in MUTATING_METHODS or self.keyed:
            return True
        return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))

    def _next(self, retry_after: float | None) -> float:
        delay = backoff_delay(self.attempt, retry_after)
        self.attempt += 1
        return delay

    def after_failure(self, exc: Exception) -> float:
        """The pause after a transport failure (one of ``ATTEMPT_EXCEPTIONS``), or raise."""
        if isinstance(exc, RETRY_EXCEPTIONS):
            if self.attempt >= self.max_retries or not self._may_retry(exc):
                raise DsecConnectionError(detail=f"{type(exc).__name__}: {exc}") from exc
            return self._next(None)
        raise DsecTimeoutError(detail=f"{type(exc).__name__}: {exc}") from exc

    def after_error(self, resp: httpx.Response, body: bytes | None = None) -> float:
        """The pause after an error answer, or raise its typed error."""
        err = error_from_response(resp, body)
        if is_retryable_response(resp, err) and self.attempt < self.max_retries and self._may_retry(None):
            return self._next(err.retry_after)
        raise err


def transport_error(exc: httpx.TransportError) -> DsecError:
    """The SDK's error for a failure while reading a streamed answer."""
    if isinstance(exc, httpx.TimeoutException):
        return DsecTimeoutError(detail=f"{type(exc).__name__}: {exc}")
    return DsecConnectionError(detail=f"{type(exc).__name__}: {exc}")


def exec_event_from_sse(event: str, data: str) -> ExecEvent:
    """Turn one SSE event of a streamed exec into an :class:`ExecEvent`."""
    try:
        payload: Any = json.loads(data) if data else {}
    except ValueError:
        payload = data
    if event in ("stdout", "stderr"):
        chunk = b""
        if isinstance(payload, dict):
            if "data_b64" in payload:
                chunk = base64.b64decode(payload["data_b64"])
            elif "data" in payload:
                d = payload["data"]
                chunk = d.encode("utf-8") if isinstance(d, str) else bytes(d)
        elif isinstance(payload, str):
            chunk = payload.encode("utf-8")
        return ExecEvent(type=event, data=chunk, raw=payload)
    if event == "exit":
        return ExecEvent(type="exit", result=ExecResult.from_json(payload or {}), raw=payload)
    if event == "error":
        problem = payload if isinstance(payload, dict) else {"detail": str(payload)}
        return ExecEvent(type="error", error=error_from_problem(problem), raw=payload)
    return ExecEvent(type=event, raw=payload)


def label_params(labels: Mapping[str, str] | None) -> list[tuple[str, str]]:
    return [("label", f"{k}={v}") for k, v in (labels or {}).items()]


def clean(d: Mapping[str, Any]) -> dict[str, Any]:
    """Drop ``None`` values from a body or a query."""
    return {k: v for k, v in d.items() if v is not None}


def flag(value: bool) -> str:
    """A boolean as a query parameter."""
    return "true" if value else "false"


def b64(data: bytes | bytearray) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def create_spec(**spec: Unpack[CreateOptions]) -> dict[str, Any]:
    """Build a sandbox create spec; ``None`` fields are left to the server's defaults (the
    substrate is ``container`` unless given)."""
    out: dict[str, Any] = {"substrate": "container"}
    for k, v in spec.items():
        out[k] = dict(v) if isinstance(v, Mapping) else v
    return clean(out)
