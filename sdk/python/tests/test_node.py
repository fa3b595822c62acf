"""Pools, long-poll on versions and the lifecycle event stream."""

from __future__ import annotations

import threading
import time
from typing import Any, List

import dsec


def test_wait_for_change_long_polls(sandbox: dsec.Sandbox) -> None:
    v0 = sandbox.version
    timer = threading.Timer(0.5, lambda: dsec.Sandbox(sandbox.client, {"id": sandbox.id}).reset())
    t0 = time.monotonic()
    timer.start()
    try:
        sb = dsec.Sandbox(sandbox.client, dict(sandbox.data)).wait_for_change(v0, timeout_ms=15_000)
    finally:
        timer.join()
    assert sb.version > v0
    assert time.monotonic() - t0 >= 0.4, "answered before anything changed"
    # nothing changes: the long-poll answers the sandbox as it is when the timeout passes
    t0 = time.monotonic()
    same = sandbox.refresh().wait_for_change(timeout_ms=500)
    assert 0.4 <= time.monotonic() - t0 < 10
    assert same.version == sandbox.version


def test_warm_pool_serves_creates(client: dsec.Client) -> None:
    st = client.set_pool("host", min=1, max=2)
    try:
        assert st.template == "host" and st.min == 1 and st.max == 2
        deadline = time.monotonic() + 60
        while client.get_pool("host").ready < 1:
            assert time.monotonic() < deadline, "the pool never filled"
            time.sleep(0.2)
        hits = client.get_pool("host").hits
        with dsec.Sandbox.create(client) as sb:
            assert sb.pooled
            assert sb.exec("echo warm").text == "warm\n"
        assert client.get_pool("host").hits == hits + 1
        assert "host" in [p.template for p in client.list_pools()]
    finally:
        client.set_pool("host", min=0, max=0)


def _events_of_one_sandbox(server) -> List[Any]:
    """Follow /v1/events while a sandbox is created and destroyed; its events."""
    got: List[Any] = []
    subscribed = threading.Event()
    done = threading.Event()
    c = dsec.Client(server.url, server.admin_key)
    sb_id: List[str] = []

    def follow() -> None:
        try:
            with c.stream("GET", "/v1/events", timeout=None) as resp:
                subscribed.set()
                import json

                for ev in c.iter_sse(resp):
                    try:
                        got.append(json.loads(ev.data))
                    except ValueError:
                        continue
                    if sb_id and any(e.get("sandbox") == sb_id[0] and e.get("state") == "stopped" for e in got):
                        done.set()
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            got.append(e)
            done.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    assert subscribed.wait(10)
    time.sleep(0.2)
    sb = server.client().create_sandbox()
    sb_id.append(sb.id)
    sb.destroy()
    assert done.wait(15), f"no stopped event for {sb.id}: {got[-5:]}"
    c.close()
    return [e for e in got if isinstance(e, dict) and e.get("sandbox") == sb.id]


def test_lifecycle_events(server) -> None:
    mine = _events_of_one_sandbox(server)
    assert [e["state"] for e in mine][-1] == "stopped"
    assert "running" in [e["state"] for e in mine]
    versions = [e["version"] for e in mine]
    assert versions == sorted(versions)
    for e in mine:
        assert {"sandbox", "tenant", "state", "version"} <= set(e), e


def test_lifecycle_event_fields(server) -> None:
    for e in _events_of_one_sandbox(server):
        assert {"sandbox", "tenant", "state", "version", "at_ms"} <= set(e), e


def test_openapi_lists_every_endpoint_the_sdk_uses(server) -> None:
    import httpx

    doc = httpx.get(f"{server.url}/openapi.json").json()
    paths = {p: {m.lower() for m in v} for p, v in doc["paths"].items()}
    used = {
        "/v1/tenants": {"get", "post"},
        "/v1/tenant": {"get"},
        "/v1/sandboxes": {"get", "post"},
        "/v1/sandboxes/{id}": {"get", "delete"},
        "/v1/sandboxes/batch": {"post"},
        "/v1/sandboxes/batch-delete": {"post"},
        "/v1/sandboxes/{id}/lease": {"post"},
        "/v1/sandboxes/{id}/reset": {"post"},
        "/v1/sandboxes/{id}/exec": {"post"},
        "/v1/sandboxes/{id}/processes": {"post"},
        "/v1/sandboxes/{id}/processes/{handle}": {"get"},
        "/v1/sandboxes/{id}/processes/{handle}/stdin": {"post"},
        "/v1/sandboxes/{id}/processes/{handle}/signal": {"post"},
        "/v1/sandboxes/{id}/processes/{handle}/wait": {"post"},
        "/v1/sandboxes/{id}/sessions": {"post"},
        "/v1/sandboxes/{id}/sessions/{session}/run": {"post"},
        "/v1/sandboxes/{id}/sessions/{session}": {"delete"},
        "/v1/sandboxes/{id}/files": {"get", "put", "delete"},
        "/v1/sandboxes/{id}/files/list": {"get"},
        "/v1/sandboxes/{id}/files/stat": {"get"},
        "/v1/sandboxes/{id}/files/mkdir": {"post"},
        "/v1/sandboxes/{id}/tar": {"get", "put"},
        "/v1/templates": {"get", "post"},
        "/v1/templates/{name}": {"get", "delete"},
        "/v1/pools": {"get"},
        "/v1/pools/{template}": {"get", "put"},
        "/v1/events": {"get"},
    }
    missing = {p: sorted(m - paths.get(p, set())) for p, m in used.items() if m - paths.get(p, set())}
    assert not missing, missing
