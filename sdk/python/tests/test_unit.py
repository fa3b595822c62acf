"""Offline tests of the SDK's own logic (no server): SSE parsing, decoding, errors, retries."""

from __future__ import annotations

import base64
import inspect
import json

import httpx
import pytest

import dsec
from dsec._sse import iter_sse
from dsec._transport import exec_event_from_sse
from dsec.types import decode_data, exec_body


def test_sse_parser() -> None:
    lines = [
        ": comment",
        "event: stdout",
        'data: {"data_b64":"aGk="}',
        "",
        "event: exit",
        "data: {\"status\":\"ok\",",
        "data:  \"exit_code\":0}",
        "id: 7",
        "",
        "data: unnamed",
        "",
    ]
    evs = list(iter_sse(lines))
    assert [e.event for e in evs] == ["stdout", "exit", "message"]
    assert json.loads(evs[1].data) == {"status": "ok", "exit_code": 0}
    assert evs[1].id == "7"
    assert evs[2].data == "unnamed"


def test_exec_events() -> None:
    ev = exec_event_from_sse("stdout", json.dumps({"data_b64": base64.b64encode(b"\xff").decode()}))
    assert ev.type == "stdout" and ev.data == b"\xff"
    ev = exec_event_from_sse("exit", json.dumps({"status": "timeout", "exit_code": None, "signal": 9}))
    assert ev.result is not None and ev.result.status == "timeout" and ev.result.signal == 9
    ev = exec_event_from_sse("error", json.dumps({"code": "agent_unavailable", "status": 502}))
    assert isinstance(ev.error, dsec.AgentUnavailable)


def test_decode_data_and_result() -> None:
    assert decode_data("hé") == "hé".encode()
    assert decode_data([0, 255, 10]) == b"\x00\xff\n"
    assert decode_data(None) == b""
    r = dsec.ExecResult.from_json(
        {
            "status": "nonzero_exit",
            "exit_code": 2,
            "stdout": {"data": [104, 255], "total": 2, "truncated": False},
            "stderr": {"data": "e", "total": 9, "truncated": True},
        }
    )
    assert r.stdout == b"h\xff" and r.text == "h\ufffd" and r.stderr_truncated and r.truncated
    assert not r.ok


def test_exec_body() -> None:
    assert exec_body("echo hi") == {"shell": "echo hi"}
    b = exec_body(["a", "b"], env={"K": "V"}, cwd="/tmp", timeout_ms=5, stdin=b"\x00")
    assert b == {"argv": ["a", "b"], "env": {"K": "V"}, "cwd": "/tmp", "timeout_ms": 5, "stdin_b64": "AA=="}
    assert exec_body(["cat"], stdin="x")["stdin"] == "x"
    with pytest.raises(TypeError):
        exec_body([])


def test_every_documented_code_has_a_class() -> None:
    codes = (
        "invalid_request unauthorized forbidden sandbox_not_found template_not_found not_found "
        "handle_not_found invalid_transition idempotency_conflict too_large quota_exceeded "
        "resource_exhausted draining exec_timeout agent_unavailable path_escape permission_denied "
        "no_space wrong_file_type spawn_failed internal unknown_outcome trajectory_diverged "
        "trajectory_not_found method_not_allowed unavailable node_lost"
    ).split()
    for code in codes:
        e = dsec.errors.error_from_problem({"code": code, "status": 400, "detail": "d", "request_id": "r"})
        assert type(e) is dsec.ERROR_CLASSES[code] and e.code == code and e.request_id == "r"
    e = dsec.errors.error_from_problem({"code": "brand_new", "status": 418})
    assert type(e) is dsec.DsecError and e.code == "brand_new"
    e = dsec.errors.error_from_problem({"code": "brand_new_missing", "status": 404})
    assert isinstance(e, dsec.NotFound) and e.code == "brand_new_missing"


def _mock_client(handler, **kw) -> dsec.Client:
    return dsec.Client("http://dsec.test", api_key="k", transport=httpx.MockTransport(handler), **kw)


def test_retry_on_503_reuses_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec._transport.backoff_delay", lambda attempt, ra: 0)
    keys = []

    def handler(req: httpx.Request) -> httpx.Response:
        keys.append(req.headers.get("idempotency-key"))
        assert req.headers["authorization"] == "Bearer k"
        if len(keys) < 3:
            return httpx.Response(503, json={"code": "draining", "status": 503}, headers={"Retry-After": "0"})
        return httpx.Response(201, json={"id": "sb-1", "state": "running"})

    with _mock_client(handler) as c:
        sb = c.create_sandbox()
    assert sb.id == "sb-1"
    assert len(keys) == 3 and len(set(keys)) == 1 and keys[0]


def test_retry_on_connect_error_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec._transport.backoff_delay", lambda attempt, ra: 0)
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.headers.get("idempotency-key"))
        raise httpx.ConnectError("refused", request=req)

    with _mock_client(handler, max_retries=2) as c:
        with pytest.raises(dsec.DsecConnectionError):
            c.create_sandbox()
    assert len(calls) == 3 and len(set(calls)) == 1


def test_no_retry_on_4xx_and_exec_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec._transport.backoff_delay", lambda attempt, ra: 0)
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(1)
        if req.url.path.endswith("/exec"):
            return httpx.Response(504, json={"code": "exec_timeout", "status": 504})
        return httpx.Response(429, json={"code": "quota_exceeded", "status": 429, "detail": "max 1"})

    with _mock_client(handler) as c:
        with pytest.raises(dsec.QuotaExceeded) as ei:
            c.create_sandbox()
        assert ei.value.detail == "max 1"
        assert len(calls) == 1
        with pytest.raises(dsec.ExecTimeout):
            dsec.Sandbox(c, {"id": "sb-1"}).exec("true")
        assert len(calls) == 2


def test_list_follows_cursor() -> None:
    pages = {
        None: {"items": [{"id": "sb-1"}, {"id": "sb-2"}], "next_cursor": "c1"},
        "c1": {"items": [{"id": "sb-3"}], "next_cursor": None},
    }
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(dict(req.url.params.multi_items()))
        assert req.url.params.get_list("label") == ["a=1", "b=2"]
        return httpx.Response(200, json=pages[req.url.params.get("cursor")])

    with _mock_client(handler) as c:
        ids = [s.id for s in c.list_sandboxes(labels={"a": "1", "b": "2"}, page_size=2)]
    assert ids == ["sb-1", "sb-2", "sb-3"]
    assert seen[0]["limit"] == "2" and seen[1]["cursor"] == "c1"


def test_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", "http://example.invalid:1234/")
    monkeypatch.setenv("DSEC_API_KEY", "envkey")
    with dsec.Client() as c:
        assert c.base_url == "http://example.invalid:1234" and c.api_key == "envkey"
    with dsec.Client("http://x:1", api_key="explicit") as c:
        assert c.api_key == "explicit"


def test_without_auto_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec._transport.backoff_delay", lambda attempt, ra: 0)
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers.get("idempotency-key"))
        if len(seen) == 1:
            raise httpx.ConnectError("refused", request=req)  # never reached the server: retried
        return httpx.Response(502, json={"code": "agent_unavailable", "status": 502})

    with _mock_client(handler, auto_idempotency_keys=False) as c:
        with pytest.raises(dsec.AgentUnavailable):
            dsec.Sandbox(c, {"id": "sb-1"}).exec("true")
        assert seen == [None, None]  # the 502 may have run the command: not retried
        seen.clear()
        with pytest.raises(dsec.AgentUnavailable):
            c.create_sandbox(idempotency_key="mine")
        assert seen[0] == "mine" and len(seen) == 4 and set(seen) == {"mine"}


@pytest.mark.asyncio
async def test_async_retry_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dsec._transport.backoff_delay", lambda attempt, ra: 0)
    keys = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.params.get("stream") == "true":
            body = (
                b'event: stdout\ndata: {"data_b64":"aGk="}\n\n'
                b'event: exit\ndata: {"status":"ok","exit_code":0}\n\n'
            )
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        keys.append(req.headers.get("idempotency-key"))
        if len(keys) == 1:
            raise httpx.ReadError("reset", request=req)
        return httpx.Response(201, json={"id": "sb-9", "state": "running"})

    async with dsec.AsyncClient("http://dsec.test", api_key="k", transport=httpx.MockTransport(handler)) as c:
        sb = await c.create_sandbox()
        assert sb.id == "sb-9" and len(keys) == 2 and keys[0] == keys[1]
        evs = [e async for e in sb.exec_stream("echo hi")]
    assert [e.type for e in evs] == ["stdout", "exit"] and evs[0].data == b"hi"


def _trajectory_node(unknown_at: int):
    """A mock node's exec answers: steps below 3 replayed, ``unknown_at`` an unknown outcome."""
    sent = []

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        sent.append((req.url.path, body))
        step = body["step"]
        if step == unknown_at:
            return httpx.Response(409, json={"code": "unknown_outcome", "status": 409})
        headers = {"dsec-step": str(step), "dsec-replayed": "true" if step < 3 else "false"}
        return httpx.Response(200, json={"status": "ok", "exit_code": 0}, headers=headers)

    return handler, sent


def test_trajectory_resume_stops_at_unknown_outcome() -> None:
    handler, sent = _trajectory_node(unknown_at=4)
    with _mock_client(handler) as c:
        traj = dsec.Trajectory(dsec.Sandbox(c, {"id": "sb-1"}), "t1")
        report = traj.resume(["a", ("b", {"cwd": "/w"}), "c", "d", "e"])
    assert report.replayed == [1, 2] and report.live == [3] and report.unknown == [4]
    assert len(report.results) == 3 and traj.next_step == 4
    assert [b["step"] for _, b in sent] == [1, 2, 3, 4] and sent[1][1]["cwd"] == "/w"
    assert {p for p, _ in sent} == {"/v1/sandboxes/sb-1/exec"}


@pytest.mark.asyncio
async def test_async_trajectory_resume_mirrors_the_sync_one() -> None:
    handler, sent = _trajectory_node(unknown_at=4)
    async with dsec.AsyncClient("http://dsec.test", transport=httpx.MockTransport(handler)) as c:
        traj = dsec.AsyncTrajectory(dsec.AsyncSandbox(c, {"id": "sb-1"}), "t1")
        report = await traj.resume(["a", ("b", {"cwd": "/w"}), "c", "d", "e"])
        assert report.replayed == [1, 2] and report.live == [3] and report.unknown == [4]
        assert traj.next_step == 4
        r = await traj.exec("x", step=7)
        assert r.step == 7 and traj.next_step == 8
        with pytest.raises(TypeError):
            await traj.exec("x", timeout=5)  # type: ignore[call-arg]
    assert [b["step"] for _, b in sent] == [1, 2, 3, 4, 7]


@pytest.mark.asyncio
async def test_async_wait_polls_until_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    states = iter(["creating", "creating", "running"])
    polls = []

    def handler(req: httpx.Request) -> httpx.Response:
        polls.append(dict(req.url.params))
        return httpx.Response(200, json={"id": "sb-1", "state": next(states), "version": len(polls)})

    async with dsec.AsyncClient("http://dsec.test", transport=httpx.MockTransport(handler)) as c:
        sb = await dsec.AsyncSandbox(c, {"id": "sb-1", "state": "creating"}).wait("running", 5_000)
        assert sb.state == "running" and sb.version == 3
    assert len(polls) == 3 and all(p["wait"] == "running" for p in polls)


def _any_answer(req: httpx.Request) -> httpx.Response:
    """A mock node that answers every call with something its parser accepts."""
    p = req.url.path
    if req.url.params.get("stream") == "true" or p.endswith("/stream") or p == "/v1/events":
        sse = b'event: stdout\ndata: {"data":"hi"}\n\nevent: exit\ndata: {"status":"ok"}\n\n'
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
    if p.endswith("/export") or p == "/metrics" or (req.method == "GET" and p.endswith(("/files", "/tar"))):
        return httpx.Response(200, content=b'{"step": 1}\n', headers={"dsec-step": "3"})
    body = {"id": "sb-1", "name": "n", "template": "host", "state": "running", "version": 1, "items": [],
            "entries": [], "handle": 1, "session": 1, "lsn": 1, "status": "ok", "kind": "file"}
    return httpx.Response(200, json=body, headers={"dsec-step": "2"})


# (target, method, args, kwargs): the same calls through the sync and the async classes
_PARITY_CALLS = [
    ("client", "create_sandbox", (), {"template": "t", "labels": {"a": "b"}, "substrate": "vm", "secret_env": {"S": "v"}}),
    ("client", "get_sandbox", ("sb-1",), {}),
    ("client", "list_sandboxes", (), {"state": "ready", "labels": {"a": "1"}, "page_size": 2}),
    ("client", "create_sandboxes", (2,), {"labels": {"j": "1"}, "idempotency_key": "k"}),
    ("client", "delete_sandboxes", (["sb-1"],), {}),
    ("client", "delete_sandbox", ("sb-1",), {}),
    ("client", "upload_template", ("t", b"tar"), {}),
    ("client", "delete_template", ("t",), {}),
    ("client", "set_pool", ("host",), {"min": 1, "max": 2}),
    ("client", "run_code", ("print(1)",), {"memory_limit_mb": 5}),
    ("client", "run_codes", ([{"code": "x"}],), {"concurrency": 3}),
    ("client", "languages", ("host",), {}),
    ("client", "trajectory_records", ("t1",), {"from_step": 2}),
    ("client", "annotate_trajectory", ("t1",), {"step": 1, "reward": 0.5, "labels": ["x"], "data": {"d": 1}}),
    ("client", "export_trajectory", ("t1",), {"label": "l", "min_reward": 0.1}),
    ("client", "follow_trajectory", ("t1",), {}),
    ("client", "create_tenant", ("a",), {"max_sandboxes": 3}),
    ("client", "tenant", (), {}),
    ("client", "metrics", (), {}),
    ("client", "events", (), {}),
    ("sandbox", "refresh", (), {}),
    ("sandbox", "wait", ("running",), {"timeout_ms": 1000}),
    ("sandbox", "heartbeat", (500,), {}),
    ("sandbox", "reset", (), {}),
    ("sandbox", "exec", (["a", "b"],), {"env": {"E": "1"}, "timeout_ms": 100, "stdin": b"\x01", "trajectory": "t"}),
    ("sandbox", "exec_stream", ("echo",), {"cwd": "/", "output_limit": 9}),
    ("sandbox", "spawn", ("cat",), {"cpu_limit_ms": 3}),
    ("sandbox", "session", ("python",), {"env": {"A": "b"}}),
    ("files", "read", ("/a",), {"max_bytes": 4}),
    ("files", "write", ("/a", "txt"), {"mode": 0o644, "parents": False, "trajectory": "t", "step": 3}),
    ("files", "list", ("/x",), {}),
    ("files", "stat", ("/a",), {}),
    ("files", "exists", ("/a",), {}),
    ("files", "remove", ("/a",), {"recursive": True}),
    ("files", "mkdir", ("/d",), {"parents": True}),
    ("files", "upload_tar", ("/d", b"tarbytes"), {}),
    ("files", "download_tar", ("/d",), {}),
    ("sandbox", "destroy", (), {}),
]


async def _call(obj: object, name: str, args: tuple, kwargs: dict) -> str:
    out = getattr(obj, name)(*args, **kwargs)
    if inspect.isawaitable(out):
        out = await out
    if hasattr(out, "__aiter__"):
        out = [x async for x in out]
    elif inspect.isgenerator(out):
        out = list(out)
    return repr(out).replace("Async", "")


@pytest.mark.asyncio
async def test_sync_and_async_classes_send_the_same_requests() -> None:
    sent: dict = {"sync": [], "async": []}
    side = ["sync"]

    def handler(req: httpx.Request) -> httpx.Response:
        key = req.headers.get("idempotency-key")
        sent[side[0]].append((req.method, str(req.url), req.content, req.headers.get("content-type"),
                              req.headers.get("accept"), key if key == "k" else key is not None,
                              req.extensions.get("timeout")))
        return _any_answer(req)

    c = dsec.Client("http://dsec.test", transport=httpx.MockTransport(handler))
    ac = dsec.AsyncClient("http://dsec.test", transport=httpx.MockTransport(handler))
    sb, asb = dsec.Sandbox(c, {"id": "sb-1"}), dsec.AsyncSandbox(ac, {"id": "sb-1"})
    targets = {"sync": {"client": c, "sandbox": sb, "files": sb.files},
               "async": {"client": ac, "sandbox": asb, "files": asb.files}}
    for target, name, args, kwargs in _PARITY_CALLS:
        side[0] = "sync"
        want = await _call(targets["sync"][target], name, args, kwargs)
        side[0] = "async"
        got = await _call(targets["async"][target], name, args, kwargs)
        assert got == want, name
        assert sent["async"] == sent["sync"] and sent["sync"], name
        sent["sync"].clear()
        sent["async"].clear()
    c.close()
    await ac.aclose()


def test_a_sandbox_shows_what_its_node_fetched() -> None:
    with dsec.Client("http://127.0.0.1:9", api_key="k") as c:
        got = {"layers": 1, "bytes": 10240, "from": ["node:n1"], "ms": 3}
        sb = dsec.Sandbox(c, {"id": "sb-1", "state": "running", "phase": None, "fetched": got})
        assert sb.fetched == got and sb.phase is None
        assert dsec.Sandbox(c, {"id": "sb-2", "state": "lost"}).fetched is None
        assert "lost" in dsec.FINAL_STATES
