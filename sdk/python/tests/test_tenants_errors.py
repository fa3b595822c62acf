"""Tenants, quotas, idempotency and typed errors."""

from __future__ import annotations

import uuid

import httpx
import pytest

import dsec
import dsec._transport

from _util import live, sandbox_exists


def test_tenant_isolation(server) -> None:
    a = server.new_tenant()
    b = server.new_tenant()
    sb = dsec.Sandbox.create(a, labels={"owner": "a"})
    try:
        with pytest.raises(dsec.SandboxNotFound):
            dsec.Sandbox.connect(sb.id, b)
        intruder = dsec.Sandbox(b, {"id": sb.id})
        with pytest.raises(dsec.SandboxNotFound):
            intruder.exec("echo pwned")
        with pytest.raises(dsec.SandboxNotFound):
            intruder.files.read("/etc/hostname")
        with pytest.raises(dsec.SandboxNotFound):
            intruder.destroy()
        assert sb.id not in [s.id for s in b.list_sandboxes()]
        out = b.delete_sandboxes(labels={"owner": "a"})
        assert all(i.id != sb.id for i in out)
        # untouched for its owner
        assert sb.id in [s.id for s in a.list_sandboxes()]
        assert sb.exec("echo mine").text == "mine\n"
    finally:
        sb.destroy()


def test_tenant_info_and_admin_listing(server, client: dsec.Client) -> None:
    t = server.new_tenant(max_sandboxes=7)
    me = t.tenant()
    assert me.name == t.tenant_info.name
    assert me.max_sandboxes == 7
    assert me.usage is not None and me.usage.get("sandboxes") == 0
    names = [x.name for x in client.list_tenants()]
    assert t.tenant_info.name in names and "admin" in names
    assert all(x.api_key is None for x in client.list_tenants())
    with pytest.raises(dsec.Forbidden):
        t.create_tenant("not-allowed")
    with pytest.raises(dsec.Forbidden):
        t.list_tenants()


def test_quota_exceeded(server) -> None:
    t = server.new_tenant(max_sandboxes=1)
    first = dsec.Sandbox.create(t)
    try:
        with pytest.raises(dsec.QuotaExceeded) as ei:
            dsec.Sandbox.create(t)
        assert ei.value.status == 429
        assert ei.value.code == "quota_exceeded"
        assert len(live(t.list_sandboxes())) == 1
        assert t.tenant().usage.get("sandboxes") == 1
    finally:
        first.destroy()
    # the quota counts live sandboxes: room again
    with dsec.Sandbox.create(t) as again:
        assert again.exec("true").ok


def test_quota_in_batch_create(server) -> None:
    t = server.new_tenant(max_sandboxes=2)
    res = t.create_sandboxes(3)
    try:
        assert len(res.sandboxes) == 2
        assert len(res.errors) == 1 and isinstance(res.errors[0], dsec.QuotaExceeded)
    finally:
        t.delete_sandboxes(res.ids)


def test_idempotent_create(client: dsec.Client, uid: str) -> None:
    key = f"test-{uuid.uuid4().hex}"
    first = client.create_sandbox(labels={"idem": uid}, idempotency_key=key)
    try:
        second = client.create_sandbox(labels={"idem": uid}, idempotency_key=key)
        assert second.id == first.id
        assert live(client.list_sandboxes(labels={"idem": uid})) == [first.id]
        # the replay is marked (the server compares request bodies byte for byte, so send the
        # very body the SDK sent)
        body = dsec._transport.create_spec(labels={"idem": uid})
        resp = client.request("POST", "/v1/sandboxes", json=body, idempotency_key=key)
        assert resp.headers.get("idempotent-replayed") == "true"
        assert resp.json()["id"] == first.id
        # the same key with another request is a conflict
        with pytest.raises(dsec.IdempotencyConflict) as ei:
            client.create_sandbox(labels={"idem": uid, "other": "1"}, idempotency_key=key)
        assert ei.value.status == 409
        assert live(client.list_sandboxes(labels={"idem": uid})) == [first.id]
    finally:
        first.destroy()


def test_idempotency_keys_are_per_tenant(server, uid: str) -> None:
    a = server.new_tenant()
    b = server.new_tenant()
    key = f"shared-{uuid.uuid4().hex}"
    sa = a.create_sandbox(labels={"k": uid}, idempotency_key=key)
    sb = b.create_sandbox(labels={"k": uid}, idempotency_key=key)
    try:
        assert sa.id != sb.id
    finally:
        sa.destroy()
        sb.destroy()


def test_retry_reuses_idempotency_key(server, uid: str) -> None:
    """A transient failure after the server acted: the SDK's retry must not create twice."""
    real = httpx.HTTPTransport()
    seen_keys = []
    state = {"failed": False}

    class FlakyTransport(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                seen_keys.append(request.headers.get("idempotency-key"))
            resp = real.handle_request(request)
            if request.method == "POST" and request.url.path == "/v1/sandboxes" and not state["failed"]:
                state["failed"] = True
                resp.read()
                resp.close()
                return httpx.Response(503, json={"code": "resource_exhausted", "status": 503})
            return resp

    c = dsec.Client(server.url, server.admin_key, transport=FlakyTransport())
    tracked = server.client()
    try:
        sb = c.create_sandbox(labels={"flaky": uid})
        server.created_ids.add(sb.id)
        assert len(seen_keys) == 2 and seen_keys[0] and seen_keys[0] == seen_keys[1]
        assert live(tracked.list_sandboxes(labels={"flaky": uid})) == [sb.id]
        sb.destroy()
    finally:
        c.close()


def test_typed_errors(client: dsec.Client, server) -> None:
    with pytest.raises(dsec.TemplateNotFound) as ei:
        dsec.Sandbox.create(client, template="no-such-template-" + uuid.uuid4().hex[:6])
    assert ei.value.status == 404 and ei.value.code == "template_not_found"
    assert ei.value.request_id

    with pytest.raises(dsec.InvalidRequest) as ei2:
        dsec.Sandbox.create(client, substrate="firecracker")
    assert ei2.value.status == 400
    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(client, substrate="function")  # served by /v1/run

    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(client, limits={"memory_max": "lots"})

    with pytest.raises(dsec.InvalidRequest):
        client.request("POST", "/v1/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})

    with pytest.raises(dsec.SandboxNotFound) as ei3:
        dsec.Sandbox.connect("sb-0000000000000000", client)
    assert isinstance(ei3.value, dsec.NotFound) and ei3.value.status == 404

    bad = dsec.Client(server.url, api_key="not-a-key")
    try:
        with pytest.raises(dsec.Unauthorized) as ei4:
            list(bad.list_sandboxes())
        assert ei4.value.status == 401
    finally:
        bad.close()
    anon = dsec.Client(server.url, api_key="")
    try:
        with pytest.raises(dsec.Unauthorized):
            anon.tenant()
    finally:
        anon.close()


def test_x_api_key_header(server) -> None:
    r = httpx.get(f"{server.url}/v1/tenant", headers={"X-API-Key": server.admin_key})
    assert r.status_code == 200 and r.json()["name"] == "admin"


def test_problem_json_shape(server) -> None:
    r = httpx.get(f"{server.url}/v1/sandboxes/sb-0000000000000000",
                  headers={"Authorization": f"Bearer {server.admin_key}"})
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == "sandbox_not_found" and body["status"] == 404
    assert body["type"].endswith("/sandbox_not_found")
    assert body["title"] and body["request_id"]


def test_templates_pools_node(client: dsec.Client, server) -> None:
    names = [t.name for t in client.list_templates()]
    assert "host" in names
    assert client.get_template("host").name == "host"
    with pytest.raises(dsec.TemplateNotFound):
        client.get_template("nope-" + uuid.uuid4().hex[:6])
    assert isinstance(client.list_pools(), list)
    assert client.livez()
    assert client.readyz()["ready"] is True
    assert client.metrics().strip()
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/sandboxes" in doc.get("paths", {})


def test_metrics_show_each_live_sandbox(client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client)
    try:
        text = client.metrics()
        for name, kind in [
            ("dsec_sandbox_memory_bytes", "gauge"),
            ("dsec_sandbox_cpu_seconds_total", "counter"),
            ("dsec_sandbox_oom_kills_total", "counter"),
        ]:
            assert f"# TYPE {name} {kind}" in text
            series = [ln for ln in text.splitlines() if ln.startswith(f'{name}{{sandbox="{sb.id}"}} ')]
            assert len(series) == 1, (name, text)
            assert float(series[0].split()[-1]) >= 0
    finally:
        sb.destroy()


def test_destroyed_sandbox_rejects_exec(client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client)
    sb.destroy()
    with pytest.raises((dsec.SandboxNotFound, dsec.InvalidTransition)):
        sb.exec("true")
    assert not sandbox_exists(client, sb.id)


def test_concurrent_creates_with_one_key_make_one_sandbox(client: dsec.Client, uid: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    key = f"storm-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: client.create_sandbox(labels={"storm": uid}, idempotency_key=key).id, range(8)))
    try:
        assert len(set(ids)) == 1, ids
        assert live(client.list_sandboxes(labels={"storm": uid})) == [ids[0]]
    finally:
        client.delete_sandboxes(labels={"storm": uid})


def test_exec_with_a_key_runs_once(sandbox: dsec.Sandbox) -> None:
    key = f"exec-{uuid.uuid4().hex}"
    body = {"shell": "echo run >> /tmp/runs; wc -l < /tmp/runs"}
    first = sandbox.client.request("POST", sandbox._path("/exec"), json=body, idempotency_key=key)
    again = sandbox.client.request("POST", sandbox._path("/exec"), json=body, idempotency_key=key)
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    assert sandbox.files.read("/tmp/runs") == b"run\n"


def test_admin_reaches_every_sandbox(server, client: dsec.Client) -> None:
    t = server.new_tenant()
    sb = dsec.Sandbox.create(t)
    try:
        seen = client.get_sandbox(sb.id)
        assert seen.tenant == t.tenant_info.id
        assert sb.id not in [s.id for s in client.list_sandboxes()]  # the admin's own list
        assert [s.id for s in client.list_sandboxes(tenant=t.tenant_info.id)] == [sb.id]
        assert seen.destroy().state == "stopped"
        assert live(t.list_sandboxes()) == []
    finally:
        try:
            sb.destroy()
        except dsec.SandboxNotFound:
            pass
    # and the other way round: a tenant cannot list another's
    with pytest.raises((dsec.Forbidden, dsec.InvalidRequest)):
        list(t.list_sandboxes(tenant=client.tenant().id))
