"""The node API without I/O: for each call, the request it sends and how its answer is read.

A :class:`Call` is one request with the parser of its answer; a :class:`Page` is one page of a
listing with the call for the next one; a :class:`StreamCall` is a request answered with
Server-Sent Events; a :data:`Plan` is a generator of calls (and pauses, in seconds) for what
takes several requests. The sync and async clients send them (``_send``, ``_pages``,
``_events``, ``_run``); nothing here knows which of the two it runs under.
"""

from __future__ import annotations

import json as _json
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar, Union, cast

import httpx
from typing_extensions import Unpack

from . import _transport as t
from ._sse import SseEvent
from .errors import error_from_problem
from .types import (
    FINAL_STATES,
    Annotation,
    BatchCreateResult,
    BatchDeleteItem,
    Command,
    CreateOptions,
    ExecEvent,
    ExecOptions,
    ExecResult,
    FileEntry,
    ForkResult,
    HasId,
    PoolStats,
    ProcessStatus,
    SandboxQuery,
    SandboxState,
    SessionKind,
    Snapshot,
    Template,
    Tenant,
    TenantQuota,
    TrajectoryInfo,
    WriteOptions,
    check_keys,
    exec_body,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
S = TypeVar("S", bound=HasId)
#: a JSON object as the server answered it
Record = dict[str, Any]
Parse = Callable[[httpx.Response], T]


@dataclass(frozen=True)
class Call(Generic[T_co]):
    """One request and the parser of its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T_co]
    params: t.Params = None
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None
    idempotency_key: str | None = None
    #: the HTTP timeout is at least this (seconds), at least the client's ``timeout`` always
    min_timeout: float = 0.0

    def options(self, timeout: float) -> dict[str, Any]:
        """The keywords of ``Client.request`` for this call under a client ``timeout``."""
        return {
            "params": self.params,
            "json": self.json,
            "content": self.content,
            "headers": self.headers,
            "idempotency_key": self.idempotency_key,
            "timeout": max(timeout, self.min_timeout),
        }


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing and the call for the next page (``None`` after the last)."""

    items: list[T]
    next: Call[Page[T]] | None


def _never(_: Any) -> bool:
    return False


@dataclass(frozen=True)
class StreamCall(Generic[T]):
    """A request answered with Server-Sent Events: ``decode`` turns each into an item (``None``
    skips it); the stream ends after an item ``last`` is true of."""

    request: Call[None]
    decode: Callable[[SseEvent], T | None]
    last: Callable[[T], bool] = _never


#: what takes several requests: yields calls (answered with their parsed answers, or with the
#: :class:`DsecError` they raised thrown in) and pauses in seconds; returns the outcome
Plan = Generator[Union[Call[Any], float], Any, T]


class Run(Generic[T]):
    """A plan being stepped: :attr:`pending` is its next call or pause, ``None`` once it has
    returned (then :meth:`result` is what it returned)."""

    def __init__(self, plan: Plan[T]) -> None:
        self._plan = plan
        self._value: T | None = None
        self.pending: Call[Any] | float | None = None
        self._advance(lambda: next(plan))

    def _advance(self, step: Callable[[], Call[Any] | float]) -> None:
        try:
            self.pending = step()
        except StopIteration as done:
            self.pending = None
            self._value = done.value

    def answer(self, reply: Any) -> None:
        """Resume the plan with the answer to its pending call (``None`` after a pause)."""
        self._advance(lambda: self._plan.send(reply))

    def fail(self, error: BaseException) -> None:
        """Resume the plan with the error its pending call raised."""
        self._advance(lambda: self._plan.throw(error))

    def result(self) -> T:
        return cast(T, self._value)


# -- answers -------------------------------------------------------------------------------------


def json_body(resp: httpx.Response) -> Any:
    """The decoded JSON answer (``None`` for an empty one)."""
    return resp.json() if resp.content else None


def no_body(resp: httpx.Response) -> None:
    return None


def raw_body(resp: httpx.Response) -> bytes:
    return resp.content


def text_body(resp: httpx.Response) -> str:
    return resp.text


def one(make: Callable[[Any], T]) -> Parse[T]:
    """Read the answer as one object made by ``make``."""
    return lambda resp: make(json_body(resp))


def items(make: Callable[[Any], T], key: str = "items") -> Parse[list[T]]:
    """Read the answer as a list under ``key``, each made by ``make``."""
    return lambda resp: [make(x) for x in json_body(resp).get(key) or []]


def step_of(resp: httpx.Response) -> int | None:
    """The trajectory step of the answer (``Dsec-Step``), if it was one."""
    step = resp.headers.get("dsec-step")
    return int(step) if step and step.isdigit() else None


def sse_json(ev: SseEvent) -> Record | None:
    """An event's data as JSON; events whose data is not JSON are skipped."""
    try:
        out: Record = _json.loads(ev.data)
    except ValueError:
        return None
    return out


def readyz(resp: httpx.Response) -> Record:
    """The ``/readyz`` answer, with ``ready`` from the status when the body does not say."""
    try:
        body: Record = resp.json()
    except ValueError:
        body = {}
    body.setdefault("ready", resp.status_code == 200)
    return body


def deadline(timeout_ms: int | None, default_s: float) -> float:
    """The least HTTP timeout of a request the server itself bounds by ``timeout_ms``."""
    return default_s if timeout_ms is None else timeout_ms / 1000.0 + t.DEADLINE_SLACK


# -- sandboxes -----------------------------------------------------------------------------------


def sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    return f"/v1/sandboxes/{sandbox_id}{suffix}"


def create_sandbox(make: Callable[[Record], S], idempotency_key: str | None, spec: CreateOptions) -> Call[S]:
    return Call(
        "POST",
        "/v1/sandboxes",
        one(make),
        json=t.create_spec(**spec),
        idempotency_key=idempotency_key,
        min_timeout=120.0,
    )


def get_sandbox(make: Callable[[Record], S], sandbox_id: str) -> Call[S]:
    return Call("GET", sandbox_path(sandbox_id), one(make))


def delete_sandbox(sandbox_id: str, idempotency_key: str | None = None) -> Call[Any]:
    return Call("DELETE", sandbox_path(sandbox_id), json_body, idempotency_key=idempotency_key, min_timeout=60.0)


def list_sandboxes(make: Callable[[Record], S], query: SandboxQuery, cursor: str | None = None) -> Call[Page[S]]:
    check_keys(query, SandboxQuery)
    q = {"state": query.get("state"), "limit": query.get("page_size"), "cursor": cursor, "tenant": query.get("tenant")}
    params: list[Any] = [*t.clean(q).items(), *t.label_params(query.get("labels"))]

    def parse(resp: httpx.Response) -> Page[S]:
        body = json_body(resp)
        nxt = body.get("next_cursor")
        more = list_sandboxes(make, query, nxt) if nxt else None
        return Page([make(x) for x in body.get("items") or []], more)

    return Call("GET", "/v1/sandboxes", parse, params=params)


def create_sandboxes(
    make: Callable[[Record], S], count: int, idempotency_key: str | None, spec: CreateOptions
) -> Call[BatchCreateResult[S]]:
    def parse(resp: httpx.Response) -> BatchCreateResult[S]:
        out: BatchCreateResult[S] = BatchCreateResult()
        for it in json_body(resp).get("items") or []:
            if it.get("ok"):
                out.sandboxes.append(make(it["sandbox"]))
            else:
                out.errors.append(error_from_problem(it.get("error")))
        return out

    return Call(
        "POST",
        "/v1/sandboxes/batch",
        parse,
        json={"count": int(count), "spec": t.create_spec(**spec)},
        idempotency_key=idempotency_key,
        min_timeout=60.0 + count,
    )


def _batch_delete_item(it: Record) -> BatchDeleteItem:
    err = it.get("error")
    return BatchDeleteItem(id=str(it.get("id")), ok=bool(it.get("ok")), error=error_from_problem(err) if err else None)


def delete_sandboxes(
    ids: Sequence[str] | None, labels: Mapping[str, str] | None, idempotency_key: str | None
) -> Call[list[BatchDeleteItem]]:
    if (ids is None) == (labels is None):
        raise ValueError("give exactly one of ids= or labels=")
    body = {"ids": list(ids)} if ids is not None else {"labels": dict(labels or {})}
    return Call(
        "POST",
        "/v1/sandboxes/batch-delete",
        items(_batch_delete_item),
        json=body,
        idempotency_key=idempotency_key,
        min_timeout=120.0,
    )


def refresh(sandbox_id: str) -> Call[Record]:
    return Call("GET", sandbox_path(sandbox_id), json_body)


def _poll(sandbox_id: str, params: Mapping[str, Any], poll_ms: int) -> Call[Record]:
    return Call("GET", sandbox_path(sandbox_id), json_body, params=dict(params), min_timeout=deadline(poll_ms, 0))


def wait(sandbox_id: str, state: SandboxState, timeout_ms: int) -> Plan[Record]:
    """Long-polls until the sandbox is in ``state`` (or a final one) or the time is up."""
    end = time.monotonic() + timeout_ms / 1000.0
    while True:
        left = max(0, int((end - time.monotonic()) * 1000))
        poll = min(left, t.MAX_LONG_POLL_MS)
        data: Record = yield _poll(sandbox_id, {"wait": state, "timeout": poll}, poll)
        now = str(data.get("state"))
        if now == state or now in FINAL_STATES or left == 0:
            return data
        yield 0.05  # the server answered early: don't spin


def wait_for_change(sandbox_id: str, version: int, timeout_ms: int) -> Plan[Record]:
    """Long-polls until the sandbox's version exceeds ``version`` or the time is up."""
    end = time.monotonic() + timeout_ms / 1000.0
    while True:
        poll = min(max(0, int((end - time.monotonic()) * 1000)), t.MAX_LONG_POLL_MS)
        data: Record = yield _poll(sandbox_id, {"after_version": version, "timeout": poll}, poll)
        changed = int(data.get("version") or 0) > version
        if changed or str(data.get("state")) in FINAL_STATES or time.monotonic() >= end:
            return data
        yield 0.05  # the server answered early: don't spin


def heartbeat(sandbox_id: str, lease_ms: int | None) -> Call[Record]:
    return Call("POST", sandbox_path(sandbox_id, "/lease"), json_body, json=t.clean({"lease_ms": lease_ms}))


def set_network(sandbox_id: str, network: Mapping[str, Any]) -> Call[Record]:
    return Call("PUT", sandbox_path(sandbox_id, "/network"), json_body, json=dict(network))


def reset(sandbox_id: str) -> Call[Record]:
    return Call("POST", sandbox_path(sandbox_id, "/reset"), json_body, json={}, min_timeout=60.0)


# -- exec, processes, sessions -------------------------------------------------------------------


def exec(
    sandbox_id: str,
    cmd: Command,
    exec_timeout: float,
    *,
    trajectory: str | None = None,
    step: int | None = None,
    **options: Unpack[ExecOptions],
) -> Call[ExecResult]:
    body = exec_body(cmd, trajectory=trajectory, step=step, **options)
    return Call(
        "POST",
        sandbox_path(sandbox_id, "/exec"),
        ExecResult.from_response,
        json=body,
        min_timeout=deadline(options.get("timeout_ms"), exec_timeout),
    )


def _exec_event(ev: SseEvent) -> ExecEvent:
    return t.exec_event_from_sse(ev.event, ev.data)


def _exec_ended(ev: ExecEvent) -> bool:
    return ev.type in ("exit", "error")


def exec_stream(
    sandbox_id: str, cmd: Command, exec_timeout: float, **options: Unpack[ExecOptions]
) -> StreamCall[ExecEvent]:
    request = Call(
        "POST",
        sandbox_path(sandbox_id, "/exec"),
        no_body,
        params={"stream": "true"},
        json=exec_body(cmd, **options),
        headers={"Accept": "text/event-stream"},
        min_timeout=deadline(options.get("timeout_ms"), exec_timeout),
    )
    return StreamCall(request, _exec_event, _exec_ended)


def spawn(sandbox_id: str, cmd: Command, **options: Unpack[ExecOptions]) -> Call[Record]:
    return Call("POST", sandbox_path(sandbox_id, "/processes"), json_body, json=exec_body(cmd, **options))


def open_session(sandbox_id: str, kind: SessionKind, env: Mapping[str, str] | None, cwd: str | None) -> Call[Record]:
    body = t.clean({"kind": kind, "env": dict(env) if env else None, "cwd": cwd})
    return Call("POST", sandbox_path(sandbox_id, "/sessions"), json_body, json=body)


def process_path(sandbox_id: str, handle: int, suffix: str = "") -> str:
    return sandbox_path(sandbox_id, f"/processes/{handle}{suffix}")


def process_status(sandbox_id: str, handle: int) -> Call[ProcessStatus]:
    return Call("GET", process_path(sandbox_id, handle), one(ProcessStatus.from_json))


def write_stdin(sandbox_id: str, handle: int, data: str | bytes | None, eof: bool) -> Call[None]:
    body: Record = {"eof": bool(eof)}
    if isinstance(data, str):
        body["data"] = data
    elif data is not None:
        body["data_b64"] = t.b64(data)
    return Call("POST", process_path(sandbox_id, handle, "/stdin"), no_body, json=body)


def signal(sandbox_id: str, handle: int, sig: int) -> Call[None]:
    return Call("POST", process_path(sandbox_id, handle, "/signal"), no_body, json={"signal": int(sig)})


def _process_result(resp: httpx.Response) -> ExecResult | None:
    data = json_body(resp)
    if data is None or ("status" not in data and data.get("running")):
        return None
    return ExecResult.from_json(data)


def wait_process(sandbox_id: str, handle: int, timeout_ms: int) -> Call[ExecResult | None]:
    return Call(
        "POST",
        process_path(sandbox_id, handle, "/wait"),
        _process_result,
        json={"timeout_ms": int(timeout_ms)},
        min_timeout=deadline(timeout_ms, 0),
    )


def session_path(sandbox_id: str, session: int, suffix: str = "") -> str:
    return sandbox_path(sandbox_id, f"/sessions/{session}{suffix}")


def session_run(
    sandbox_id: str,
    session: int,
    input: str,
    exec_timeout: float,
    timeout_ms: int | None,
    trajectory: str | None,
    step: int | None,
) -> Call[ExecResult]:
    body = t.clean({"input": input, "timeout_ms": timeout_ms, "trajectory": trajectory, "step": step})
    return Call(
        "POST",
        session_path(sandbox_id, session, "/run"),
        ExecResult.from_response,
        json=body,
        min_timeout=deadline(timeout_ms, exec_timeout),
    )


def close_session(sandbox_id: str, session: int) -> Call[None]:
    return Call("DELETE", session_path(sandbox_id, session), no_body)


# -- files ---------------------------------------------------------------------------------------

OCTETS = {"Content-Type": "application/octet-stream"}
TAR = {"Content-Type": "application/x-tar"}


def read_file(sandbox_id: str, path: str, max_bytes: int | None) -> Call[bytes]:
    params = t.clean({"path": path, "max_bytes": max_bytes})
    return Call("GET", sandbox_path(sandbox_id, "/files"), raw_body, params=params)


def write_file(sandbox_id: str, path: str, data: str | bytes, options: WriteOptions) -> Call[int | None]:
    check_keys(options, WriteOptions)
    content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    query = {"path": path, "mode": options.get("mode"), "parents": t.flag(options.get("parents", True))}
    params = t.clean({**query, "trajectory": options.get("trajectory"), "step": options.get("step")})
    return Call(
        "PUT",
        sandbox_path(sandbox_id, "/files"),
        step_of,
        params=params,
        content=content,
        headers=OCTETS,
        min_timeout=120.0,
    )


def list_files(sandbox_id: str, path: str) -> Call[list[FileEntry]]:
    return Call(
        "GET", sandbox_path(sandbox_id, "/files/list"), items(FileEntry.from_json, "entries"), params={"path": path}
    )


def stat_file(sandbox_id: str, path: str) -> Call[FileEntry]:
    return Call("GET", sandbox_path(sandbox_id, "/files/stat"), one(FileEntry.from_json), params={"path": path})


def remove_file(sandbox_id: str, path: str, recursive: bool) -> Call[None]:
    params = {"path": path, "recursive": t.flag(recursive)}
    return Call("DELETE", sandbox_path(sandbox_id, "/files"), no_body, params=params)


def mkdir(sandbox_id: str, path: str, parents: bool, mode: int | None) -> Call[None]:
    body = t.clean({"path": path, "parents": parents, "mode": mode})
    return Call("POST", sandbox_path(sandbox_id, "/files/mkdir"), no_body, json=body)


def upload_tar(sandbox_id: str, path: str, tar: bytes) -> Call[None]:
    return Call(
        "PUT",
        sandbox_path(sandbox_id, "/tar"),
        no_body,
        params={"path": path},
        content=tar,
        headers=TAR,
        min_timeout=300.0,
    )


def download_tar(sandbox_id: str, path: str) -> Call[bytes]:
    return Call("GET", sandbox_path(sandbox_id, "/tar"), raw_body, params={"path": path}, min_timeout=300.0)


# -- templates and pools -------------------------------------------------------------------------


def list_templates() -> Call[list[Template]]:
    return Call("GET", "/v1/templates", items(Template.from_json))


def get_template(name: str) -> Call[Template]:
    return Call("GET", f"/v1/templates/{name}", one(Template.from_json))


def upload_template(name: str, tarball: bytes) -> Call[Template]:
    return Call(
        "POST",
        "/v1/templates",
        one(Template.from_json),
        params={"name": name},
        content=tarball,
        headers=TAR,
        min_timeout=300.0,
    )


def delete_template(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/templates/{name}", no_body)


def list_pools() -> Call[list[PoolStats]]:
    return Call("GET", "/v1/pools", items(PoolStats.from_json))


def get_pool(template: str) -> Call[PoolStats]:
    return Call("GET", f"/v1/pools/{template}", one(PoolStats.from_json))


def set_pool(template: str, min: int, max: int) -> Call[PoolStats]:
    return Call("PUT", f"/v1/pools/{template}", one(PoolStats.from_json), json={"min": min, "max": max})


# -- code runner ---------------------------------------------------------------------------------


def run_body(code: str, language: str, options: Mapping[str, Any]) -> Record:
    """The JSON body of a run request (``memory_limit_mb`` is accepted for ``memory_limit_MB``)."""
    body: Record = {"code": code, "language": language}
    for k, v in options.items():
        if v is not None:
            body["memory_limit_MB" if k == "memory_limit_mb" else k] = v
    return body


def _items_list(resp: httpx.Response) -> list[Record]:
    out: list[Record] = json_body(resp)["items"]
    return out


def run_code(code: str, language: str, options: Mapping[str, Any]) -> Call[Record]:
    return Call("POST", "/v1/run", json_body, json=run_body(code, language, options))


def run_codes(requests: Sequence[Mapping[str, Any]], concurrency: int) -> Call[list[Record]]:
    body = {"requests": [dict(r) for r in requests], "concurrency": concurrency}
    return Call("POST", "/v1/run/batch", _items_list, json=body)


def languages(template: str | None) -> Call[list[Record]]:
    params = {"template": template} if template else None
    return Call("GET", "/v1/languages", _items_list, params=params)


# -- trajectories --------------------------------------------------------------------------------


def trajectory_path(trajectory: str, suffix: str = "") -> str:
    return f"/v1/trajectories/{trajectory}{suffix}"


def list_trajectories() -> Call[list[TrajectoryInfo]]:
    return Call("GET", "/v1/trajectories", items(TrajectoryInfo.from_json))


def get_trajectory(trajectory: str) -> Call[TrajectoryInfo]:
    return Call("GET", trajectory_path(trajectory), one(TrajectoryInfo.from_json))


def trajectory_records(trajectory: str, from_step: int | None, page_size: int | None) -> Call[Page[Record]]:
    def parse(resp: httpx.Response) -> Page[Record]:
        body = json_body(resp)
        nxt = body.get("next_from_step")
        more = None if nxt is None or nxt == from_step else trajectory_records(trajectory, nxt, page_size)
        return Page(list(body.get("items") or []), more)

    params = t.clean({"from_step": from_step, "limit": page_size})
    return Call("GET", trajectory_path(trajectory, "/records"), parse, params=params)


def _lsn(resp: httpx.Response) -> int:
    return int(json_body(resp)["lsn"])


def annotate_trajectory(trajectory: str, annotation: Annotation, idempotency_key: str | None) -> Call[int]:
    check_keys(annotation, Annotation)
    labels, data = annotation.get("labels"), annotation.get("data")
    body = t.clean(
        {
            "step": annotation.get("step"),
            "reward": annotation.get("reward"),
            "labels": list(labels) if labels is not None else None,
            "data": dict(data) if data is not None else None,
        }
    )
    return Call("POST", trajectory_path(trajectory, "/annotations"), _lsn, json=body, idempotency_key=idempotency_key)


def _jsonl(resp: httpx.Response) -> list[Record]:
    return [_json.loads(line) for line in resp.text.splitlines() if line.strip()]


def export_trajectory(trajectory: str, label: str | None, min_reward: float | None) -> Call[list[Record]]:
    params = t.clean({"format": "jsonl", "label": label, "min_reward": min_reward})
    return Call("GET", trajectory_path(trajectory, "/export"), _jsonl, params=params, min_timeout=300.0)


def follow_trajectory(trajectory: str) -> StreamCall[Record]:
    return StreamCall(Call("GET", trajectory_path(trajectory, "/stream"), no_body), sse_json)


def finish_trajectory(trajectory: str) -> Call[Any]:
    return Call("POST", trajectory_path(trajectory, "/finish"), json_body)


# -- tenants and node ----------------------------------------------------------------------------


def create_tenant(name: str, quota: TenantQuota, idempotency_key: str | None) -> Call[Tenant]:
    check_keys(quota, TenantQuota)
    body = t.clean({"name": name, **quota})
    return Call("POST", "/v1/tenants", one(Tenant.from_json), json=body, idempotency_key=idempotency_key)


def list_tenants() -> Call[list[Tenant]]:
    return Call("GET", "/v1/tenants", items(Tenant.from_json))


def tenant() -> Call[Tenant]:
    return Call("GET", "/v1/tenant", one(Tenant.from_json))


def metrics() -> Call[str]:
    return Call("GET", "/metrics", text_body)


def events() -> StreamCall[Record]:
    return StreamCall(Call("GET", "/v1/events", no_body), sse_json)


# -- snapshots -------------------------------------------------------------------------------------


def _snapshot(resp: httpx.Response) -> Snapshot:
    return Snapshot.from_json(json_body(resp))


def _step_fields(trajectory: str | None, step: int | None) -> dict[str, Any]:
    return t.clean({"trajectory": trajectory, "step": step})


def take_snapshot(
    sandbox_id: str, labels: Mapping[str, str] | None, trajectory: str | None, step: int | None
) -> Call[Snapshot]:
    body = {"labels": dict(labels or {}), **_step_fields(trajectory, step)}
    return Call("POST", sandbox_path(sandbox_id, "/snapshots"), _snapshot, json=body, min_timeout=120.0)


def fork(
    make: Callable[[Record], S],
    sandbox_id: str,
    count: int,
    labels: Mapping[str, str] | None,
    trajectory: str | None,
    step: int | None,
) -> Call[ForkResult[S]]:
    def parse(resp: httpx.Response) -> ForkResult[S]:
        body = json_body(resp)
        return ForkResult(
            Snapshot.from_json(body["snapshot"]),
            [make(x) for x in body.get("sandboxes") or []],
            [error_from_problem(e) for e in body.get("errors") or []],
        )

    body = {"count": int(count), "labels": dict(labels or {}), **_step_fields(trajectory, step)}
    return Call("POST", sandbox_path(sandbox_id, "/fork"), parse, json=body, min_timeout=120.0 + count)


def restore(sandbox_id: str, snapshot_id: str, trajectory: str | None, step: int | None) -> Call[Record]:
    body = {"snapshot": snapshot_id, **_step_fields(trajectory, step)}
    return Call("POST", sandbox_path(sandbox_id, "/restore"), json_body, json=body, min_timeout=60.0)


def get_snapshot(snapshot_id: str) -> Call[Snapshot]:
    return Call("GET", f"/v1/snapshots/{snapshot_id}", _snapshot)


def list_snapshots(sandbox: str | None, root: str | None, labels: Mapping[str, str] | None) -> Call[list[Snapshot]]:
    label = ",".join(f"{k}={v}" for k, v in (labels or {}).items()) or None
    params = t.clean({"sandbox": sandbox, "root": root, "label": label})

    def parse(resp: httpx.Response) -> list[Snapshot]:
        return [Snapshot.from_json(x) for x in json_body(resp).get("items") or []]

    return Call("GET", "/v1/snapshots", parse, params=params)


def snapshot_tree(snapshot_id: str) -> Call[Record]:
    return Call("GET", f"/v1/snapshots/{snapshot_id}/tree", json_body)


def delete_snapshot(snapshot_id: str, recursive: bool) -> Call[list[str]]:
    def parse(resp: httpx.Response) -> list[str]:
        return [str(x) for x in json_body(resp).get("deleted") or []]

    params = {"recursive": "true"} if recursive else {}
    return Call("DELETE", f"/v1/snapshots/{snapshot_id}", parse, params=params)
