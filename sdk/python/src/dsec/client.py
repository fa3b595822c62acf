"""HTTP clients of the dsec node API: :class:`Client` (sync) and :class:`AsyncClient` (async).

Both are transports: what each call sends and how its answer is read is built once in
:mod:`dsec._api`; a client sends it, with retries, and awaits or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    TypeVar,
    Union,
)

import httpx
from typing_extensions import Unpack

from . import _api as api
from . import _transport as t
from ._sse import SseEvent, aiter_sse, iter_sse
from .errors import DsecError
from .types import (
    Annotation,
    BatchCreateResult,
    BatchDeleteItem,
    CreateOptions,
    PoolStats,
    RequestOptions,
    SandboxQuery,
    Snapshot,
    Template,
    Tenant,
    TenantQuota,
    TrajectoryInfo,
    check_keys,
)

if TYPE_CHECKING:  # pragma: no cover
    from .sandbox import AsyncSandbox, Sandbox

__all__ = ["Client", "AsyncClient", "BatchCreateResult"]

T = TypeVar("T")
Tr = TypeVar("Tr", httpx.BaseTransport, httpx.AsyncBaseTransport)
Record = dict[str, Any]
run_body = api.run_body


class _ClientBase(Generic[Tr]):
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = t.DEFAULT_TIMEOUT,
        max_retries: int = t.DEFAULT_MAX_RETRIES,
        exec_timeout: float = 600.0,
        auto_idempotency_keys: bool = True,
        transport: Tr | None = None,
    ) -> None:
        self.base_url, self.api_key = t.resolve_config(base_url, api_key)
        self.auto_idempotency_keys = auto_idempotency_keys
        self.timeout = timeout
        self.max_retries = max_retries
        self.exec_timeout = exec_timeout
        self._open(transport)

    def _open(self, transport: Tr | None) -> None:
        raise NotImplementedError

    def _http_options(self) -> dict[str, Any]:
        """The keywords of the ``httpx`` client."""
        return {
            "base_url": self.base_url,
            "headers": t.auth_headers(self.api_key),
            "timeout": t.make_timeout(self.timeout),
        }

    def _prepare(self, method: str, options: RequestOptions) -> tuple[dict[str, Any], t.Attempts]:
        """The ``httpx`` keywords of a request and the retry policy of its attempts."""
        check_keys(options, RequestOptions)
        hdrs = dict(options.get("headers") or {})
        key = options.get("idempotency_key")
        if key:
            hdrs["Idempotency-Key"] = key
        elif method.upper() in t.MUTATING_METHODS and self.auto_idempotency_keys:
            hdrs.setdefault("Idempotency-Key", t.new_idempotency_key())
        timeout = options.get("timeout")
        kw = {
            "params": options.get("params"),
            "json": options.get("json"),
            "content": options.get("content"),
            "headers": hdrs,
            "timeout": t.make_timeout(timeout if timeout is not None else self.timeout),
        }
        return kw, t.Attempts(method, hdrs, self.max_retries)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"


class Client(_ClientBase[httpx.BaseTransport]):
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
        transport: an ``httpx`` transport (tests use ``httpx.MockTransport``).
    """

    _http: httpx.Client

    def _open(self, transport: httpx.BaseTransport | None) -> None:
        self._http = httpx.Client(transport=transport, **self._http_options())

    # -- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **options: Unpack[RequestOptions]) -> httpx.Response:
        """Send one request with retries; raise the typed :class:`DsecError` on an error answer."""
        kw, attempts = self._prepare(method, options)
        while True:
            try:
                resp = self._http.request(method, path, **kw)
            except t.ATTEMPT_EXCEPTIONS as e:
                time.sleep(attempts.after_failure(e))
                continue
            if resp.status_code < 400:
                return resp
            time.sleep(attempts.after_error(resp))

    def request_json(self, method: str, path: str, **options: Unpack[RequestOptions]) -> Any:
        """:meth:`request` and decode the JSON answer (``None`` for an empty one)."""
        return api.json_body(self.request(method, path, **options))

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **options: Unpack[RequestOptions]) -> Iterator[httpx.Response]:
        """Open a streamed answer; connection failures before any answer are retried."""
        kw, attempts = self._prepare(method, options)
        while True:
            try:
                resp = self._http.send(self._http.build_request(method, path, **kw), stream=True)
            except t.ATTEMPT_EXCEPTIONS as e:
                time.sleep(attempts.after_failure(e))
                continue
            try:
                if resp.status_code >= 400:
                    time.sleep(attempts.after_error(resp, resp.read()))
                    continue
                yield resp
                return
            finally:
                resp.close()

    def iter_sse(self, resp: httpx.Response) -> Iterator[SseEvent]:
        """Parse a streamed answer as Server-Sent Events."""
        try:
            yield from iter_sse(resp.iter_lines())
        except httpx.TransportError as e:
            raise t.transport_error(e) from e

    def _send(self, call: api.Call[T]) -> T:
        return call.parse(self.request(call.method, call.path, **call.options(self.timeout)))

    def _pages(self, call: api.Call[api.Page[T]] | None) -> Iterator[T]:
        while call is not None:
            page = self._send(call)
            yield from page.items
            call = page.next

    def _events(self, call: api.StreamCall[T]) -> Iterator[T]:
        req = call.request
        with self.stream(req.method, req.path, **req.options(self.timeout)) as resp:
            for ev in self.iter_sse(resp):
                item = call.decode(ev)
                if item is not None:
                    yield item
                    if call.last(item):
                        return

    def _run(self, plan: api.Plan[T]) -> T:
        run = api.Run(plan)
        while run.pending is not None:
            try:
                reply = self._step(run.pending)
            except DsecError as e:
                run.fail(e)
            else:
                run.answer(reply)
        return run.result()

    def _step(self, step: api.Call[Any] | float) -> Any:
        """Send a call, or pause."""
        if isinstance(step, api.Call):
            return self._send(step)
        time.sleep(step)
        return None

    def _sandbox(self, data: Record) -> Sandbox:
        from .sandbox import Sandbox

        return Sandbox(self, data)

    # -- sandboxes -----------------------------------------------------------------------------

    def create_sandbox(self, *, idempotency_key: str | None = None, **spec: Unpack[CreateOptions]) -> Sandbox:
        """Create a sandbox (state ``running``). See :meth:`dsec.Sandbox.create`."""
        return self._send(api.create_sandbox(self._sandbox, idempotency_key, spec))

    def get_sandbox(self, sandbox_id: str) -> Sandbox:
        """The sandbox with this id (``SandboxNotFound`` if this tenant has none)."""
        return self._send(api.get_sandbox(self._sandbox, sandbox_id))

    def delete_sandbox(self, sandbox_id: str, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Destroy a sandbox; returns its final record (state ``stopped``)."""
        out: dict[str, Any] = self._send(api.delete_sandbox(sandbox_id, idempotency_key))
        return out

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        """The snapshot with this id (``SnapshotNotFound`` if this tenant has none)."""
        return self._send(api.get_snapshot(snapshot_id))

    def snapshots(
        self, *, sandbox: str | None = None, root: str | None = None, labels: Mapping[str, str] | None = None
    ) -> list[Snapshot]:
        """This tenant's snapshots, oldest first: of one ``sandbox``, in the tree under
        ``root``, carrying every one of ``labels``."""
        return self._send(api.list_snapshots(sandbox, root, labels))

    def snapshot_tree(self, snapshot_id: str) -> dict[str, Any]:
        """The tree under a snapshot: its record with ``children``, recursively."""
        out: dict[str, Any] = self._send(api.snapshot_tree(snapshot_id))
        return out

    def delete_snapshot(self, snapshot_id: str, *, recursive: bool = False) -> list[str]:
        """Delete a snapshot (with the tree under it when ``recursive``); the ids deleted.
        Refused (``InvalidTransition``) while snapshots or live sandboxes stand on it."""
        return self._send(api.delete_snapshot(snapshot_id, recursive))

    def list_sandboxes(self, **query: Unpack[SandboxQuery]) -> Iterator[Sandbox]:
        """Iterate over this tenant's sandboxes, following ``next_cursor`` page by page.

        Without ``state``, ``stopped`` sandboxes are left out. The admin tenant may pass
        ``tenant=<tenant id>`` to list another tenant's.
        """
        return self._pages(api.list_sandboxes(self._sandbox, query))

    def create_sandboxes(
        self, count: int, *, idempotency_key: str | None = None, **spec: Unpack[CreateOptions]
    ) -> BatchCreateResult[Sandbox]:
        """Create ``count`` sandboxes from one spec (the keywords of :meth:`create_sandbox`)."""
        return self._send(api.create_sandboxes(self._sandbox, count, idempotency_key, spec))

    def delete_sandboxes(
        self,
        ids: Sequence[str] | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> list[BatchDeleteItem]:
        """Destroy sandboxes by ids or by labels (all of them must match)."""
        return self._send(api.delete_sandboxes(ids, labels, idempotency_key))

    # -- templates and pools -------------------------------------------------------------------

    def list_templates(self) -> list[Template]:
        return self._send(api.list_templates())

    def get_template(self, name: str) -> Template:
        return self._send(api.get_template(name))

    def upload_template(self, name: str, tarball: bytes) -> Template:
        """Import a rootfs tarball, OCI layout tar or ``docker save`` tar (admin)."""
        return self._send(api.upload_template(name, tarball))

    def delete_template(self, name: str) -> None:
        self._send(api.delete_template(name))

    def list_pools(self) -> list[PoolStats]:
        return self._send(api.list_pools())

    def get_pool(self, template: str) -> PoolStats:
        return self._send(api.get_pool(template))

    def set_pool(self, template: str, *, min: int, max: int) -> PoolStats:
        """Configure the warm pool of a template (admin)."""
        return self._send(api.set_pool(template, min, max))

    # -- code runner ---------------------------------------------------------------------------

    def run_code(self, code: str, language: str = "python", **options: Any) -> dict[str, Any]:
        """Run a snippet (``POST /v1/run``): python on the function substrate, other languages
        compile and run in a container. ``options``: ``stdin``, ``files`` (path → base64),
        ``fetch_files``, ``run_timeout``, ``compile_timeout`` (seconds), ``memory_limit_MB``,
        ``output_limit``, ``substrate``, ``template``. Answers ``{"status", "compile_result",
        "run_result": {"status", "exit_code", "stdout", "stderr", "execution_time",
        "memory_kb"}, "files", "substrate", "server_us", "clamped"}``: ``clamped`` names the
        options outside the node's range with the value applied (timeouts above 300 s run 300 s;
        0 or less times out at once)."""
        return self._send(api.run_code(code, language, options))

    def run_codes(self, requests: Sequence[Mapping[str, Any]], *, concurrency: int = 16) -> list[dict[str, Any]]:
        """Run many snippets in one call (``POST /v1/run/batch``), at most ``concurrency`` at
        once on the node. Each request is a mapping like :meth:`run_code`'s arguments; each
        item answers ``{"ok": True, "result": …}`` or ``{"ok": False, "error": {problem}}``,
        in order."""
        return self._send(api.run_codes(requests, concurrency))

    def languages(self, template: str | None = None) -> list[dict[str, Any]]:
        """The languages whose toolchains are on ``template`` (default: ``host``)."""
        return self._send(api.languages(template))

    # -- trajectories --------------------------------------------------------------------------

    def list_trajectories(self) -> list[TrajectoryInfo]:
        """This tenant's trajectories with their counters."""
        return self._send(api.list_trajectories())

    def get_trajectory(self, trajectory: str) -> TrajectoryInfo:
        return self._send(api.get_trajectory(trajectory))

    def trajectory_records(
        self, trajectory: str, *, from_step: int | None = None, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """The log records of a trajectory (``intent``/``result``/``annotation``), page by page."""
        return self._pages(api.trajectory_records(trajectory, from_step, page_size))

    def annotate_trajectory(
        self, trajectory: str, *, idempotency_key: str | None = None, **annotation: Unpack[Annotation]
    ) -> int:
        """Add a durable annotation (reward, labels, data) to a trajectory or one step; its lsn."""
        return self._send(api.annotate_trajectory(trajectory, annotation, idempotency_key))

    def export_trajectory(
        self, trajectory: str, *, label: str | None = None, min_reward: float | None = None
    ) -> list[dict[str, Any]]:
        """Training rows of a trajectory (the JSONL export, parsed)."""
        return self._send(api.export_trajectory(trajectory, label, min_reward))

    def follow_trajectory(self, trajectory: str) -> Iterator[dict[str, Any]]:
        """New log records of a trajectory as they are written (SSE ``record`` events)."""
        return self._events(api.follow_trajectory(trajectory))

    # -- tenants and node ----------------------------------------------------------------------

    def create_tenant(self, name: str, *, idempotency_key: str | None = None, **quota: Unpack[TenantQuota]) -> Tenant:
        """Create a tenant (admin). The answer carries its API key, shown only this once."""
        return self._send(api.create_tenant(name, quota, idempotency_key))

    def list_tenants(self) -> list[Tenant]:
        return self._send(api.list_tenants())

    def tenant(self) -> Tenant:
        """The caller's own tenant with its usage."""
        return self._send(api.tenant())

    def livez(self) -> bool:
        try:
            return self._http.get("/livez", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def readyz(self) -> dict[str, Any]:
        return api.readyz(self._http.get("/readyz"))

    def metrics(self) -> str:
        return self._send(api.metrics())

    def events(self) -> Iterator[dict[str, Any]]:
        """Follow the lifecycle event stream (``{"sandbox","tenant","state","version","at"}``)."""
        return self._events(api.events())


class AsyncClient(_ClientBase[httpx.AsyncBaseTransport]):
    """Asynchronous client; same arguments and methods as :class:`Client`, awaited."""

    _http: httpx.AsyncClient

    def _open(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(transport=transport, **self._http_options())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(self, method: str, path: str, **options: Unpack[RequestOptions]) -> httpx.Response:
        kw, attempts = self._prepare(method, options)
        while True:
            try:
                resp = await self._http.request(method, path, **kw)
            except t.ATTEMPT_EXCEPTIONS as e:
                await asyncio.sleep(attempts.after_failure(e))
                continue
            if resp.status_code < 400:
                return resp
            await asyncio.sleep(attempts.after_error(resp))

    async def request_json(self, method: str, path: str, **options: Unpack[RequestOptions]) -> Any:
        return api.json_body(await self.request(method, path, **options))

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, **options: Unpack[RequestOptions]) -> AsyncIterator[httpx.Response]:
        kw, attempts = self._prepare(method, options)
        while True:
            try:
                resp = await self._http.send(self._http.build_request(method, path, **kw), stream=True)
            except t.ATTEMPT_EXCEPTIONS as e:
                await asyncio.sleep(attempts.after_failure(e))
                continue
            try:
                if resp.status_code >= 400:
                    await asyncio.sleep(attempts.after_error(resp, await resp.aread()))
                    continue
                yield resp
                return
            finally:
                await resp.aclose()

    async def iter_sse(self, resp: httpx.Response) -> AsyncIterator[SseEvent]:
        try:
            async for ev in aiter_sse(resp.aiter_lines()):
                yield ev
        except httpx.TransportError as e:
            raise t.transport_error(e) from e

    async def _send(self, call: api.Call[T]) -> T:
        return call.parse(await self.request(call.method, call.path, **call.options(self.timeout)))

    async def _pages(self, call: api.Call[api.Page[T]] | None) -> AsyncIterator[T]:
        while call is not None:
            page = await self._send(call)
            for item in page.items:
                yield item
            call = page.next

    async def _events(self, call: api.StreamCall[T]) -> AsyncIterator[T]:
        req = call.request
        async with self.stream(req.method, req.path, **req.options(self.timeout)) as resp:
            async for ev in self.iter_sse(resp):
                item = call.decode(ev)
                if item is not None:
                    yield item
                    if call.last(item):
                        return

    async def _run(self, plan: api.Plan[T]) -> T:
        run = api.Run(plan)
        while run.pending is not None:
            try:
                reply = await self._step(run.pending)
            except DsecError as e:
                run.fail(e)
            else:
                run.answer(reply)
        return run.result()

    async def _step(self, step: api.Call[Any] | float) -> Any:
        if isinstance(step, api.Call):
            return await self._send(step)
        await asyncio.sleep(step)
        return None

    def _sandbox(self, data: Record) -> AsyncSandbox:
        from .sandbox import AsyncSandbox

        return AsyncSandbox(self, data)

    async def create_sandbox(
        self, *, idempotency_key: str | None = None, **spec: Unpack[CreateOptions]
    ) -> AsyncSandbox:
        return await self._send(api.create_sandbox(self._sandbox, idempotency_key, spec))

    async def get_sandbox(self, sandbox_id: str) -> AsyncSandbox:
        return await self._send(api.get_sandbox(self._sandbox, sandbox_id))

    async def delete_sandbox(self, sandbox_id: str, *, idempotency_key: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = await self._send(api.delete_sandbox(sandbox_id, idempotency_key))
        return out

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return await self._send(api.get_snapshot(snapshot_id))

    async def snapshots(
        self, *, sandbox: str | None = None, root: str | None = None, labels: Mapping[str, str] | None = None
    ) -> list[Snapshot]:
        return await self._send(api.list_snapshots(sandbox, root, labels))

    async def snapshot_tree(self, snapshot_id: str) -> dict[str, Any]:
        out: dict[str, Any] = await self._send(api.snapshot_tree(snapshot_id))
        return out

    async def delete_snapshot(self, snapshot_id: str, *, recursive: bool = False) -> list[str]:
        return await self._send(api.delete_snapshot(snapshot_id, recursive))

    def list_sandboxes(self, **query: Unpack[SandboxQuery]) -> AsyncIterator[AsyncSandbox]:
        return self._pages(api.list_sandboxes(self._sandbox, query))

    async def create_sandboxes(
        self, count: int, *, idempotency_key: str | None = None, **spec: Unpack[CreateOptions]
    ) -> BatchCreateResult[AsyncSandbox]:
        return await self._send(api.create_sandboxes(self._sandbox, count, idempotency_key, spec))

    async def delete_sandboxes(
        self,
        ids: Sequence[str] | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> list[BatchDeleteItem]:
        return await self._send(api.delete_sandboxes(ids, labels, idempotency_key))

    async def list_templates(self) -> list[Template]:
        return await self._send(api.list_templates())

    async def get_template(self, name: str) -> Template:
        return await self._send(api.get_template(name))

    async def upload_template(self, name: str, tarball: bytes) -> Template:
        return await self._send(api.upload_template(name, tarball))

    async def delete_template(self, name: str) -> None:
        await self._send(api.delete_template(name))

    async def list_pools(self) -> list[PoolStats]:
        return await self._send(api.list_pools())

    async def get_pool(self, template: str) -> PoolStats:
        return await self._send(api.get_pool(template))

    async def set_pool(self, template: str, *, min: int, max: int) -> PoolStats:
        return await self._send(api.set_pool(template, min, max))

    async def run_code(self, code: str, language: str = "python", **options: Any) -> dict[str, Any]:
        """:meth:`Client.run_code`, awaited."""
        return await self._send(api.run_code(code, language, options))

    async def run_codes(self, requests: Sequence[Mapping[str, Any]], *, concurrency: int = 16) -> list[dict[str, Any]]:
        """:meth:`Client.run_codes`, awaited."""
        return await self._send(api.run_codes(requests, concurrency))

    async def languages(self, template: str | None = None) -> list[dict[str, Any]]:
        """:meth:`Client.languages`, awaited."""
        return await self._send(api.languages(template))

    async def list_trajectories(self) -> list[TrajectoryInfo]:
        return await self._send(api.list_trajectories())

    async def get_trajectory(self, trajectory: str) -> TrajectoryInfo:
        return await self._send(api.get_trajectory(trajectory))

    def trajectory_records(
        self, trajectory: str, *, from_step: int | None = None, page_size: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        return self._pages(api.trajectory_records(trajectory, from_step, page_size))

    async def annotate_trajectory(
        self, trajectory: str, *, idempotency_key: str | None = None, **annotation: Unpack[Annotation]
    ) -> int:
        return await self._send(api.annotate_trajectory(trajectory, annotation, idempotency_key))

    async def export_trajectory(
        self, trajectory: str, *, label: str | None = None, min_reward: float | None = None
    ) -> list[dict[str, Any]]:
        return await self._send(api.export_trajectory(trajectory, label, min_reward))

    def follow_trajectory(self, trajectory: str) -> AsyncIterator[dict[str, Any]]:
        return self._events(api.follow_trajectory(trajectory))

    async def create_tenant(
        self, name: str, *, idempotency_key: str | None = None, **quota: Unpack[TenantQuota]
    ) -> Tenant:
        return await self._send(api.create_tenant(name, quota, idempotency_key))

    async def list_tenants(self) -> list[Tenant]:
        return await self._send(api.list_tenants())

    async def tenant(self) -> Tenant:
        return await self._send(api.tenant())

    async def livez(self) -> bool:
        try:
            return (await self._http.get("/livez", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def readyz(self) -> dict[str, Any]:
        return api.readyz(await self._http.get("/readyz"))

    async def metrics(self) -> str:
        return await self._send(api.metrics())

    def events(self) -> AsyncIterator[dict[str, Any]]:
        return self._events(api.events())


ClientLike = Union[Client, AsyncClient]
