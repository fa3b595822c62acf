"""HTTP clients of the dsec node API: :class:`Client` (sync) and :class:`AsyncClient` (async)."""

from __future__ import annotations

import asyncio
import contextlib
import json as _json
import time
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Dict,
    Generic,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    TypeVar,
    Union,
)

import httpx

from . import _transport as t
from ._sse import aiter_sse, iter_sse
from .errors import DsecConnectionError, DsecError, DsecTimeoutError, error_from_problem
from .types import BatchDeleteItem, PoolStats, Template, Tenant, TrajectoryInfo

if TYPE_CHECKING:  # pragma: no cover
    from .sandbox import AsyncSandbox, Sandbox

__all__ = ["Client", "AsyncClient", "BatchCreateResult"]

S = TypeVar("S")


@dataclass
class BatchCreateResult(Generic[S]):
    """The outcome of a batch create: the sandboxes made and the errors of the others.

    Iterating it yields the sandboxes; ``len()`` counts them.
    """

    sandboxes: List[S] = field(default_factory=list)
    errors: List[DsecError] = field(default_factory=list)

    def __iter__(self) -> Iterator[S]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    @property
    def ids(self) -> List[str]:
        return [s.id for s in self.sandboxes]  # type: ignore[attr-defined]


def _batch_delete_items(body: Mapping[str, Any]) -> List[BatchDeleteItem]:
    items = []
    for it in body.get("items") or []:
        err = it.get("error")
        items.append(
            BatchDeleteItem(
                id=str(it.get("id")),
                ok=bool(it.get("ok")),
                error=error_from_problem(err) if err else None,
            )
        )
    return items


def _batch_delete_body(
    ids: Optional[Sequence[str]], labels: Optional[Mapping[str, str]]
) -> Dict[str, Any]:
    if (ids is None) == (labels is None):
        raise ValueError("give exactly one of ids= or labels=")
    return {"ids": list(ids)} if ids is not None else {"labels": dict(labels or {})}


def run_body(code: str, language: str, options: Mapping[str, Any]) -> Dict[str, Any]:
    """The JSON body of a run request (``memory_limit_mb`` is accepted for ``memory_limit_MB``)."""
    body: Dict[str, Any] = {"code": code, "language": language}
    for k, v in options.items():
        if v is not None:
            body["memory_limit_MB" if k == "memory_limit_mb" else k] = v
    return body


class _ClientBase:
    def __init__(
        self,
        base_url: Optional[str],
        api_key: Optional[str],
        timeout: float,
        max_retries: int,
        exec_timeout: float,
        auto_idempotency_keys: bool = True,
    ) -> None:
        self.base_url, self.api_key = t.resolve_config(base_url, api_key)
        self.auto_idempotency_keys = auto_idempotency_keys
        self.timeout = timeout
        self.max_retries = max_retries
        self.exec_timeout = exec_timeout

    def _prepare_headers(
        self, method: str, headers: Optional[Mapping[str, str]], idempotency_key: Optional[str]
    ) -> Dict[str, str]:
        hdrs = dict(headers or {})
        if idempotency_key:
            hdrs["Idempotency-Key"] = idempotency_key
        elif method.upper() in t.MUTATING_METHODS and self.auto_idempotency_keys:
            hdrs.setdefault("Idempotency-Key", t.new_idempotency_key())
        return hdrs

    def _may_retry(self, method: str, hdrs: Mapping[str, str], exc: Optional[BaseException]) -> bool:
        """A mutation without a key is retried only when it never reached the server."""
        if method.upper() not in t.MUTATING_METHODS or "Idempotency-Key" in hdrs:
            return True
        return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"


class Client(_ClientBase):
    """Synchronous client.

    Args:
        base_url: the node's URL; defaults to ``$DSEC_URL`` or ``http://127.0.0.1:7700``.
        api_key: the tenant's API key; defaults to ``$DSEC_API_KEY``.
        timeout: seconds for ordinary requests.
        max_retries: retries of a call on connection errors and 502/503/504 answers. Every
            mutation carries an ``Idempotency-Key`` (generated when not given), reused by each
            retry of that call, so a retry never doubles an effect.
        exec_timeout: HTTP timeout in seconds for execs given no ``timeout_ms``.
        auto_idempotency_keys: set False to send keys only where you pass one (the server then
            records no outcome per call, ~0.3 ms less per exec); a mutation without a key is
            then retried only when the connection was never made.
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = t.DEFAULT_TIMEOUT,
        max_retries: int = t.DEFAULT_MAX_RETRIES,
        exec_timeout: float = 600.0,
        auto_idempotency_keys: bool = True,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, exec_timeout, auto_idempotency_keys)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=t.auth_headers(self.api_key),
            timeout=t.make_timeout(timeout),
            transport=transport,
        )

    # -- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: t.Params = None,
        json: Any = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> httpx.Response:
        """Send one request with retries; raise the typed :class:`DsecError` on an error answer."""
        hdrs = self._prepare_headers(method, headers, idempotency_key)
        to = t.make_timeout(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                resp = self._http.request(
                    method, path, params=params, json=json, content=content, headers=hdrs, timeout=to
                )
            except t.RETRY_EXCEPTIONS as e:
                if attempt >= self.max_retries or not self._may_retry(method, hdrs, e):
                    raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e
                time.sleep(t.backoff_delay(attempt, None))
                attempt += 1
                continue
            except httpx.TimeoutException as e:
                raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
            if resp.status_code < 400:
                return resp
            err = t.error_from_response(resp)
            if (
                        t.is_retryable_response(resp, err)
                        and attempt < self.max_retries
                        and self._may_retry(method, hdrs, None)
                    ):
                time.sleep(t.backoff_delay(attempt, err.retry_after))
                attempt += 1
                continue
            raise err

    def request_json(self, method: str, path: str, **kw: Any) -> Any:
        """:meth:`request` and decode the JSON answer (``None`` for an empty one)."""
        resp = self.request(method, path, **kw)
        if not resp.content:
            return None
        return resp.json()

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        params: t.Params = None,
        json: Any = None,
        headers: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Iterator[httpx.Response]:
        """Open a streamed answer; connection failures before any answer are retried."""
        hdrs = self._prepare_headers(method, headers, idempotency_key)
        to = t.make_timeout(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                req = self._http.build_request(
                    method, path, params=params, json=json, headers=hdrs, timeout=to
                )
                resp = self._http.send(req, stream=True)
            except t.RETRY_EXCEPTIONS as e:
                if attempt >= self.max_retries or not self._may_retry(method, hdrs, e):
                    raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e
                time.sleep(t.backoff_delay(attempt, None))
                attempt += 1
                continue
            except httpx.TimeoutException as e:
                raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
            try:
                if resp.status_code >= 400:
                    body = resp.read()
                    err = t.error_from_response(resp, body)
                    if (
                        t.is_retryable_response(resp, err)
                        and attempt < self.max_retries
                        and self._may_retry(method, hdrs, None)
                    ):
                        time.sleep(t.backoff_delay(attempt, err.retry_after))
                        attempt += 1
                        continue
                    raise err
                yield resp
                return
            finally:
                resp.close()

    def iter_sse(self, resp: httpx.Response) -> Iterator[Any]:
        """Parse a streamed answer as Server-Sent Events."""
        try:
            yield from iter_sse(resp.iter_lines())
        except httpx.TimeoutException as e:
            raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
        except httpx.TransportError as e:
            raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e

    # -- sandboxes -----------------------------------------------------------------------------

    def create_sandbox(
        self,
        *,
        template: Optional[str] = None,
        limits: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl_ms: Optional[int] = None,
        lease_ms: Optional[int] = None,
        substrate: Optional[str] = "container",
        writable_root: Optional[bool] = None,
        userns: Optional[bool] = None,
        idempotency_key: Optional[str] = None,
        **extra: Any,
    ) -> "Sandbox":
        """Create a sandbox (state ``running``). See :meth:`dsec.Sandbox.create`."""
        from .sandbox import Sandbox

        spec = t.create_spec(
            template=template,
            substrate=substrate,
            limits=limits,
            env=env,
            labels=labels,
            ttl_ms=ttl_ms,
            lease_ms=lease_ms,
            writable_root=writable_root,
            userns=userns,
            **extra,
        )
        data = self.request_json(
            "POST", "/v1/sandboxes", json=spec, idempotency_key=idempotency_key, timeout=max(self.timeout, 120.0)
        )
        return Sandbox(self, data)

    def get_sandbox(self, sandbox_id: str) -> "Sandbox":
        """The sandbox with this id (``SandboxNotFound`` if this tenant has none)."""
        from .sandbox import Sandbox

        return Sandbox(self, self.request_json("GET", f"/v1/sandboxes/{sandbox_id}"))

    def delete_sandbox(self, sandbox_id: str, *, idempotency_key: Optional[str] = None) -> Dict[str, Any]:
        """Destroy a sandbox; returns its final record (state ``stopped``)."""
        return self.request_json(
            "DELETE", f"/v1/sandboxes/{sandbox_id}", idempotency_key=idempotency_key, timeout=max(self.timeout, 60.0)
        )

    def list_sandboxes(
        self,
        *,
        state: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        page_size: Optional[int] = None,
        tenant: Optional[str] = None,
    ) -> Iterator["Sandbox"]:
        """Iterate over this tenant's sandboxes, following ``next_cursor`` page by page.

        Without ``state``, ``stopped`` sandboxes are left out. The admin tenant may pass
        ``tenant=<tenant id>`` to list another tenant's.
        """
        from .sandbox import Sandbox

        cursor: Optional[str] = None
        while True:
            params: List[Any] = list(t.clean({"state": state, "limit": page_size, "cursor": cursor, "tenant": tenant}).items())
            params += t.label_params(labels)
            body = self.request_json("GET", "/v1/sandboxes", params=params)
            for item in body.get("items") or []:
                yield Sandbox(self, item)
            cursor = body.get("next_cursor")
            if not cursor:
                return

    def create_sandboxes(
        self, count: int, *, idempotency_key: Optional[str] = None, **spec: Any
    ) -> BatchCreateResult["Sandbox"]:
        """Create ``count`` sandboxes from one spec (the keywords of :meth:`create_sandbox`)."""
        from .sandbox import Sandbox

        spec.setdefault("substrate", "container")
        body = self.request_json(
            "POST",
            "/v1/sandboxes/batch",
            json={"count": int(count), "spec": t.create_spec(**spec)},
            idempotency_key=idempotency_key,
            timeout=max(self.timeout, 60.0 + count),
        )
        out: BatchCreateResult[Sandbox] = BatchCreateResult()
        for it in body.get("items") or []:
            if it.get("ok"):
                out.sandboxes.append(Sandbox(self, it["sandbox"]))
            else:
                out.errors.append(error_from_problem(it.get("error")))
        return out

    def delete_sandboxes(
        self,
        ids: Optional[Sequence[str]] = None,
        *,
        labels: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
    ) -> List[BatchDeleteItem]:
        """Destroy sandboxes by ids or by labels (all of them must match)."""
        body = self.request_json(
            "POST",
            "/v1/sandboxes/batch-delete",
            json=_batch_delete_body(ids, labels),
            idempotency_key=idempotency_key,
            timeout=max(self.timeout, 120.0),
        )
        return _batch_delete_items(body)

    # -- templates and pools -------------------------------------------------------------------

    def list_templates(self) -> List[Template]:
        return [Template.from_json(x) for x in self.request_json("GET", "/v1/templates").get("items") or []]

    def get_template(self, name: str) -> Template:
        return Template.from_json(self.request_json("GET", f"/v1/templates/{name}"))

    def upload_template(self, name: str, tarball: bytes) -> Template:
        """Import a rootfs tarball, OCI layout tar or ``docker save`` tar (admin)."""
        return Template.from_json(
            self.request_json(
                "POST",
                "/v1/templates",
                params={"name": name},
                content=tarball,
                headers={"Content-Type": "application/x-tar"},
                timeout=max(self.timeout, 300.0),
            )
        )

    def delete_template(self, name: str) -> None:
        self.request("DELETE", f"/v1/templates/{name}")

    def list_pools(self) -> List[PoolStats]:
        return [PoolStats.from_json(x) for x in self.request_json("GET", "/v1/pools").get("items") or []]

    def get_pool(self, template: str) -> PoolStats:
        return PoolStats.from_json(self.request_json("GET", f"/v1/pools/{template}"))

    def set_pool(self, template: str, *, min: int, max: int) -> PoolStats:
        """Configure the warm pool of a template (admin)."""
        return PoolStats.from_json(self.request_json("PUT", f"/v1/pools/{template}", json={"min": min, "max": max}))

    # -- code runner ---------------------------------------------------------------------------

    def run_code(
        self,
        code: str,
        language: str = "python",
        **options: Any,
    ) -> Dict[str, Any]:
        """Run a snippet (``POST /v1/run``): python on the function substrate, other languages
        compile and run in a container. ``options``: ``stdin``, ``files`` (path → base64),
        ``fetch_files``, ``run_timeout``, ``compile_timeout`` (seconds), ``memory_limit_MB``,
        ``output_limit``, ``substrate``, ``template``. Answers ``{"status", "compile_result",
        "run_result": {"status", "exit_code", "stdout", "stderr", "execution_time",
        "memory_kb"}, "files", "substrate", "server_us", "clamped"}``: ``clamped`` names the
        options outside the node's range with the value applied (timeouts above 300 s run 300 s;
        0 or less times out at once)."""
        return self.request_json("POST", "/v1/run", json=run_body(code, language, options))

    def run_codes(
        self,
        requests: Sequence[Mapping[str, Any]],
        *,
        concurrency: int = 16,
    ) -> List[Dict[str, Any]]:
        """Run many snippets in one call (``POST /v1/run/batch``), at most ``concurrency`` at
        once on the node. Each request is a mapping like :meth:`run_code`'s arguments; each
        item answers ``{"ok": True, "result": …}`` or ``{"ok": False, "error": {problem}}``,
        in order."""
        body = {"requests": [dict(r) for r in requests], "concurrency": concurrency}
        return self.request_json("POST", "/v1/run/batch", json=body)["items"]

    def languages(self, template: Optional[str] = None) -> List[Dict[str, Any]]:
        """The languages whose toolchains are on ``template`` (default: ``host``)."""
        params = {"template": template} if template else None
        return self.request_json("GET", "/v1/languages", params=params)["items"]

    # -- trajectories --------------------------------------------------------------------------

    def list_trajectories(self) -> List[TrajectoryInfo]:
        """This tenant's trajectories with their counters."""
        body = self.request_json("GET", "/v1/trajectories")
        return [TrajectoryInfo.from_json(x) for x in body.get("items") or []]

    def get_trajectory(self, trajectory: str) -> TrajectoryInfo:
        return TrajectoryInfo.from_json(self.request_json("GET", f"/v1/trajectories/{trajectory}"))

    def trajectory_records(
        self, trajectory: str, *, from_step: Optional[int] = None, page_size: Optional[int] = None
    ) -> Iterator[Dict[str, Any]]:
        """The log records of a trajectory (``intent``/``result``/``annotation``), page by page."""
        while True:
            body = self.request_json(
                "GET",
                f"/v1/trajectories/{trajectory}/records",
                params=t.clean({"from_step": from_step, "limit": page_size}),
            )
            yield from body.get("items") or []
            nxt = body.get("next_from_step")
            if nxt is None or nxt == from_step:
                return
            from_step = nxt

    def annotate_trajectory(
        self,
        trajectory: str,
        *,
        step: Optional[int] = None,
        reward: Optional[float] = None,
        labels: Optional[Sequence[str]] = None,
        data: Optional[Mapping[str, Any]] = None,
        idempotency_key: Optional[str] = None,
    ) -> int:
        """Add a durable annotation (reward, labels, data) to a trajectory or one step; its lsn."""
        body = t.clean(
            {"step": step, "reward": reward, "labels": list(labels) if labels is not None else None,
             "data": dict(data) if data is not None else None}
        )
        out = self.request_json(
            "POST", f"/v1/trajectories/{trajectory}/annotations", json=body, idempotency_key=idempotency_key
        )
        return int(out["lsn"])

    def export_trajectory(
        self, trajectory: str, *, label: Optional[str] = None, min_reward: Optional[float] = None
    ) -> List[Dict[str, Any]]:
        """Training rows of a trajectory (the JSONL export, parsed)."""
        resp = self.request(
            "GET",
            f"/v1/trajectories/{trajectory}/export",
            params=t.clean({"format": "jsonl", "label": label, "min_reward": min_reward}),
            timeout=max(self.timeout, 300.0),
        )
        return [_json.loads(line) for line in resp.text.splitlines() if line.strip()]

    def follow_trajectory(self, trajectory: str) -> Iterator[Dict[str, Any]]:
        """New log records of a trajectory as they are written (SSE ``record`` events)."""
        with self.stream("GET", f"/v1/trajectories/{trajectory}/stream", timeout=None) as resp:
            for ev in self.iter_sse(resp):
                try:
                    yield _json.loads(ev.data)
                except ValueError:
                    continue

    # -- tenants and node ----------------------------------------------------------------------

    def create_tenant(
        self,
        name: str,
        *,
        max_sandboxes: Optional[int] = None,
        max_memory_bytes: Optional[int] = None,
        idempotency_key: Optional[str] = None,
    ) -> Tenant:
        """Create a tenant (admin). The answer carries its API key, shown only this once."""
        body = t.clean({"name": name, "max_sandboxes": max_sandboxes, "max_memory_bytes": max_memory_bytes})
        return Tenant.from_json(self.request_json("POST", "/v1/tenants", json=body, idempotency_key=idempotency_key))

    def list_tenants(self) -> List[Tenant]:
        return [Tenant.from_json(x) for x in self.request_json("GET", "/v1/tenants").get("items") or []]

    def tenant(self) -> Tenant:
        """The caller's own tenant with its usage."""
        return Tenant.from_json(self.request_json("GET", "/v1/tenant"))

    def livez(self) -> bool:
        try:
            return self._http.get("/livez", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def readyz(self) -> Dict[str, Any]:
        resp = self._http.get("/readyz")
        try:
            body = resp.json()
        except ValueError:
            body = {}
        body.setdefault("ready", resp.status_code == 200)
        return body

    def metrics(self) -> str:
        return self.request("GET", "/metrics").text

    def events(self) -> Iterator[Dict[str, Any]]:
        """Follow the lifecycle event stream (``{"sandbox","tenant","state","version","at"}``)."""
        with self.stream("GET", "/v1/events", timeout=None) as resp:
            for ev in self.iter_sse(resp):
                try:
                    yield _json.loads(ev.data)
                except ValueError:
                    continue


class AsyncClient(_ClientBase):
    """Asynchronous client; same arguments and methods as :class:`Client`, awaited."""

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = t.DEFAULT_TIMEOUT,
        max_retries: int = t.DEFAULT_MAX_RETRIES,
        exec_timeout: float = 600.0,
        auto_idempotency_keys: bool = True,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, exec_timeout, auto_idempotency_keys)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=t.auth_headers(self.api_key),
            timeout=t.make_timeout(timeout),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: t.Params = None,
        json: Any = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> httpx.Response:
        hdrs = self._prepare_headers(method, headers, idempotency_key)
        to = t.make_timeout(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                resp = await self._http.request(
                    method, path, params=params, json=json, content=content, headers=hdrs, timeout=to
                )
            except t.RETRY_EXCEPTIONS as e:
                if attempt >= self.max_retries or not self._may_retry(method, hdrs, e):
                    raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e
                await asyncio.sleep(t.backoff_delay(attempt, None))
                attempt += 1
                continue
            except httpx.TimeoutException as e:
                raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
            if resp.status_code < 400:
                return resp
            err = t.error_from_response(resp)
            if (
                        t.is_retryable_response(resp, err)
                        and attempt < self.max_retries
                        and self._may_retry(method, hdrs, None)
                    ):
                await asyncio.sleep(t.backoff_delay(attempt, err.retry_after))
                attempt += 1
                continue
            raise err

    async def request_json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self.request(method, path, **kw)
        if not resp.content:
            return None
        return resp.json()

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: t.Params = None,
        json: Any = None,
        headers: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> AsyncIterator[httpx.Response]:
        hdrs = self._prepare_headers(method, headers, idempotency_key)
        to = t.make_timeout(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                req = self._http.build_request(
                    method, path, params=params, json=json, headers=hdrs, timeout=to
                )
                resp = await self._http.send(req, stream=True)
            except t.RETRY_EXCEPTIONS as e:
                if attempt >= self.max_retries or not self._may_retry(method, hdrs, e):
                    raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e
                await asyncio.sleep(t.backoff_delay(attempt, None))
                attempt += 1
                continue
            except httpx.TimeoutException as e:
                raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
            try:
                if resp.status_code >= 400:
                    body = await resp.aread()
                    err = t.error_from_response(resp, body)
                    if (
                        t.is_retryable_response(resp, err)
                        and attempt < self.max_retries
                        and self._may_retry(method, hdrs, None)
                    ):
                        await asyncio.sleep(t.backoff_delay(attempt, err.retry_after))
                        attempt += 1
                        continue
                    raise err
                yield resp
                return
            finally:
                await resp.aclose()

    async def iter_sse(self, resp: httpx.Response) -> AsyncIterator[Any]:
        try:
            async for ev in aiter_sse(resp.aiter_lines()):
                yield ev
        except httpx.TimeoutException as e:
            raise DsecTimeoutError(detail=f"{type(e).__name__}: {e}") from e
        except httpx.TransportError as e:
            raise DsecConnectionError(detail=f"{type(e).__name__}: {e}") from e

    async def create_sandbox(
        self,
        *,
        template: Optional[str] = None,
        limits: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl_ms: Optional[int] = None,
        lease_ms: Optional[int] = None,
        substrate: Optional[str] = "container",
        writable_root: Optional[bool] = None,
        userns: Optional[bool] = None,
        idempotency_key: Optional[str] = None,
        **extra: Any,
    ) -> "AsyncSandbox":
        from .sandbox import AsyncSandbox

        spec = t.create_spec(
            template=template,
            substrate=substrate,
            limits=limits,
            env=env,
            labels=labels,
            ttl_ms=ttl_ms,
            lease_ms=lease_ms,
            writable_root=writable_root,
            userns=userns,
            **extra,
        )
        data = await self.request_json(
            "POST", "/v1/sandboxes", json=spec, idempotency_key=idempotency_key, timeout=max(self.timeout, 120.0)
        )
        return AsyncSandbox(self, data)

    async def get_sandbox(self, sandbox_id: str) -> "AsyncSandbox":
        from .sandbox import AsyncSandbox

        return AsyncSandbox(self, await self.request_json("GET", f"/v1/sandboxes/{sandbox_id}"))

    async def delete_sandbox(self, sandbox_id: str, *, idempotency_key: Optional[str] = None) -> Dict[str, Any]:
        return await self.request_json(
            "DELETE", f"/v1/sandboxes/{sandbox_id}", idempotency_key=idempotency_key, timeout=max(self.timeout, 60.0)
        )

    async def list_sandboxes(
        self,
        *,
        state: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        page_size: Optional[int] = None,
        tenant: Optional[str] = None,
    ) -> AsyncIterator["AsyncSandbox"]:
        from .sandbox import AsyncSandbox

        cursor: Optional[str] = None
        while True:
            params: List[Any] = list(t.clean({"state": state, "limit": page_size, "cursor": cursor, "tenant": tenant}).items())
            params += t.label_params(labels)
            body = await self.request_json("GET", "/v1/sandboxes", params=params)
            for item in body.get("items") or []:
                yield AsyncSandbox(self, item)
            cursor = body.get("next_cursor")
            if not cursor:
                return

    async def create_sandboxes(
        self, count: int, *, idempotency_key: Optional[str] = None, **spec: Any
    ) -> BatchCreateResult["AsyncSandbox"]:
        from .sandbox import AsyncSandbox

        spec.setdefault("substrate", "container")
        body = await self.request_json(
            "POST",
            "/v1/sandboxes/batch",
            json={"count": int(count), "spec": t.create_spec(**spec)},
            idempotency_key=idempotency_key,
            timeout=max(self.timeout, 60.0 + count),
        )
        out: BatchCreateResult[AsyncSandbox] = BatchCreateResult()
        for it in body.get("items") or []:
            if it.get("ok"):
                out.sandboxes.append(AsyncSandbox(self, it["sandbox"]))
            else:
                out.errors.append(error_from_problem(it.get("error")))
        return out

    async def delete_sandboxes(
        self,
        ids: Optional[Sequence[str]] = None,
        *,
        labels: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
    ) -> List[BatchDeleteItem]:
        body = await self.request_json(
            "POST",
            "/v1/sandboxes/batch-delete",
            json=_batch_delete_body(ids, labels),
            idempotency_key=idempotency_key,
            timeout=max(self.timeout, 120.0),
        )
        return _batch_delete_items(body)

    async def list_templates(self) -> List[Template]:
        body = await self.request_json("GET", "/v1/templates")
        return [Template.from_json(x) for x in body.get("items") or []]

    async def get_template(self, name: str) -> Template:
        return Template.from_json(await self.request_json("GET", f"/v1/templates/{name}"))

    async def upload_template(self, name: str, tarball: bytes) -> Template:
        return Template.from_json(
            await self.request_json(
                "POST",
                "/v1/templates",
                params={"name": name},
                content=tarball,
                headers={"Content-Type": "application/x-tar"},
                timeout=max(self.timeout, 300.0),
            )
        )

    async def delete_template(self, name: str) -> None:
        await self.request("DELETE", f"/v1/templates/{name}")

    async def list_pools(self) -> List[PoolStats]:
        body = await self.request_json("GET", "/v1/pools")
        return [PoolStats.from_json(x) for x in body.get("items") or []]

    async def get_pool(self, template: str) -> PoolStats:
        return PoolStats.from_json(await self.request_json("GET", f"/v1/pools/{template}"))

    async def set_pool(self, template: str, *, min: int, max: int) -> PoolStats:
        return PoolStats.from_json(
            await self.request_json("PUT", f"/v1/pools/{template}", json={"min": min, "max": max})
        )

    async def list_trajectories(self) -> List[TrajectoryInfo]:
        body = await self.request_json("GET", "/v1/trajectories")
        return [TrajectoryInfo.from_json(x) for x in body.get("items") or []]

    async def get_trajectory(self, trajectory: str) -> TrajectoryInfo:
        return TrajectoryInfo.from_json(await self.request_json("GET", f"/v1/trajectories/{trajectory}"))

    async def trajectory_records(
        self, trajectory: str, *, from_step: Optional[int] = None, page_size: Optional[int] = None
    ) -> AsyncIterator[Dict[str, Any]]:
        while True:
            body = await self.request_json(
                "GET",
                f"/v1/trajectories/{trajectory}/records",
                params=t.clean({"from_step": from_step, "limit": page_size}),
            )
            for item in body.get("items") or []:
                yield item
            nxt = body.get("next_from_step")
            if nxt is None or nxt == from_step:
                return
            from_step = nxt

    async def annotate_trajectory(
        self,
        trajectory: str,
        *,
        step: Optional[int] = None,
        reward: Optional[float] = None,
        labels: Optional[Sequence[str]] = None,
        data: Optional[Mapping[str, Any]] = None,
        idempotency_key: Optional[str] = None,
    ) -> int:
        body = t.clean(
            {"step": step, "reward": reward, "labels": list(labels) if labels is not None else None,
             "data": dict(data) if data is not None else None}
        )
        out = await self.request_json(
            "POST", f"/v1/trajectories/{trajectory}/annotations", json=body, idempotency_key=idempotency_key
        )
        return int(out["lsn"])

    async def export_trajectory(
        self, trajectory: str, *, label: Optional[str] = None, min_reward: Optional[float] = None
    ) -> List[Dict[str, Any]]:
        resp = await self.request(
            "GET",
            f"/v1/trajectories/{trajectory}/export",
            params=t.clean({"format": "jsonl", "label": label, "min_reward": min_reward}),
            timeout=max(self.timeout, 300.0),
        )
        return [_json.loads(line) for line in resp.text.splitlines() if line.strip()]

    async def follow_trajectory(self, trajectory: str) -> AsyncIterator[Dict[str, Any]]:
        async with self.stream("GET", f"/v1/trajectories/{trajectory}/stream", timeout=None) as resp:
            async for ev in self.iter_sse(resp):
                try:
                    yield _json.loads(ev.data)
                except ValueError:
                    continue

    async def run_code(self, code: str, language: str = "python", **options: Any) -> Dict[str, Any]:
        """:meth:`Client.run_code`, awaited."""
        return await self.request_json("POST", "/v1/run", json=run_body(code, language, options))

    async def run_codes(
        self, requests: Sequence[Mapping[str, Any]], *, concurrency: int = 16
    ) -> List[Dict[str, Any]]:
        """:meth:`Client.run_codes`, awaited."""
        body = {"requests": [dict(r) for r in requests], "concurrency": concurrency}
        return (await self.request_json("POST", "/v1/run/batch", json=body))["items"]

    async def create_tenant(
        self,
        name: str,
        *,
        max_sandboxes: Optional[int] = None,
        max_memory_bytes: Optional[int] = None,
        idempotency_key: Optional[str] = None,
    ) -> Tenant:
        body = t.clean({"name": name, "max_sandboxes": max_sandboxes, "max_memory_bytes": max_memory_bytes})
        return Tenant.from_json(
            await self.request_json("POST", "/v1/tenants", json=body, idempotency_key=idempotency_key)
        )

    async def list_tenants(self) -> List[Tenant]:
        body = await self.request_json("GET", "/v1/tenants")
        return [Tenant.from_json(x) for x in body.get("items") or []]

    async def tenant(self) -> Tenant:
        return Tenant.from_json(await self.request_json("GET", "/v1/tenant"))

    async def livez(self) -> bool:
        try:
            return (await self._http.get("/livez", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def readyz(self) -> Dict[str, Any]:
        resp = await self._http.get("/readyz")
        try:
            body = resp.json()
        except ValueError:
            body = {}
        body.setdefault("ready", resp.status_code == 200)
        return body

    async def metrics(self) -> str:
        return (await self.request("GET", "/metrics")).text

    async def events(self) -> AsyncIterator[Dict[str, Any]]:
        async with self.stream("GET", "/v1/events", timeout=None) as resp:
            async for ev in self.iter_sse(resp):
                try:
                    yield _json.loads(ev.data)
                except ValueError:
                    continue


ClientLike = Union[Client, AsyncClient]
