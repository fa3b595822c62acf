"""The durability promise: kill -9 of the daemon loses no acknowledged sandbox."""

from __future__ import annotations

import pytest

import dsec


@pytest.mark.durability
def test_sandbox_survives_server_kill9(fresh_server) -> None:
    c = fresh_server.client()
    sb = dsec.Sandbox.create(c, labels={"durable": "yes"})
    sb.files.write("/tmp/keep", b"still here")
    p = sb.spawn(["/bin/sleep", "300"])
    key = fresh_server.admin_key
    c.close()

    fresh_server.kill9()
    fresh_server.clients = []
    fresh_server.start()  # same data dir, same run dir, same port
    assert fresh_server.admin_key == key, "the admin key changed across a restart"

    c2 = fresh_server.client()
    again = dsec.Sandbox.connect(sb.id, c2)
    assert again.state == "running"
    assert [s.id for s in c2.list_sandboxes(labels={"durable": "yes"})] == [sb.id]
    # the same sandbox (not a new one): its files and processes are still there
    assert again.files.read("/tmp/keep") == b"still here"
    r = again.exec("echo alive; ls /tmp/keep")
    assert r.ok and r.text == "alive\n/tmp/keep\n"
    assert dsec.Process(again, {"handle": p.handle}).status().running
    again.destroy()
    # fresh_server's teardown: SIGTERM exits 0, and no cgroup of this sandbox is left


@pytest.mark.durability
def test_idempotent_create_replays_after_kill9(fresh_server) -> None:
    c = fresh_server.client()
    sb = c.create_sandbox(idempotency_key="durable-create-1")
    fresh_server.kill9()
    fresh_server.clients = []
    fresh_server.start()
    c2 = fresh_server.client()
    again = c2.create_sandbox(idempotency_key="durable-create-1")
    assert again.id == sb.id
    assert len([s for s in c2.list_sandboxes() if s.state not in dsec.FINAL_STATES]) == 1
    again.destroy()


def test_second_server_leaves_other_sandboxes_alone(client: dsec.Client, tmp_path_factory) -> None:
    """A server's recovery reaps only what its own run dir knows, not other servers' sandboxes."""
    from conftest import finish_server, new_server, start_or_clean

    sb = dsec.Sandbox.create(client, labels={"neighbour": "yes"})
    other = new_server(tmp_path_factory.mktemp("dsec"), "neighbour")
    try:
        start_or_clean(other)
        r = sb.exec("echo still-mine")
        assert r.ok and r.text == "still-mine\n", r
    finally:
        finish_server(other)
        try:
            sb.destroy()
        except dsec.DsecError:
            pass


def test_sigterm_drains_in_flight_exec(fresh_server) -> None:
    import threading
    import time

    c = fresh_server.client()
    sb = dsec.Sandbox.create(c)
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = sb.exec(["/bin/sh", "-c", "sleep 1.5; echo finished"], timeout_ms=20_000)
        except Exception as e:  # noqa: BLE001 - asserted below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    assert fresh_server.proc is not None
    fresh_server.proc.send_signal(15)
    time.sleep(0.2)
    # new work is refused while draining (or the listener is already closed)
    late = dsec.Client(fresh_server.url, fresh_server.admin_key, max_retries=0)
    try:
        with pytest.raises((dsec.Draining, dsec.DsecConnectionError)) as ei:
            late.create_sandbox()
        if isinstance(ei.value, dsec.Draining):
            assert ei.value.status == 503 and ei.value.retry_after is not None
    finally:
        late.close()
    t.join(30)
    assert "error" not in out, out
    assert out["result"].ok and out["result"].text == "finished\n"
    assert fresh_server.stop() == 0
    # the sandbox outlives the daemon; a restarted one still has it
    fresh_server.clients = []
    fresh_server.start()
    c2 = fresh_server.client()
    again = dsec.Sandbox.connect(sb.id, c2)
    assert again.exec("echo back").text == "back\n"
    again.destroy()


@pytest.mark.durability
def test_sdk_retries_across_a_server_restart(fresh_server) -> None:
    import threading
    import time

    c = fresh_server.client(max_retries=8)
    sb = dsec.Sandbox.create(c)
    fresh_server.kill9()
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(0.7)
        fresh_server.start()  # same port: the client's URL stays good
        restarted.set()

    t = threading.Thread(target=restart)
    t.start()
    try:
        # the node is down: these calls see refused connections, back off and retry
        r = sb.exec("echo through-the-restart")
        made = c.create_sandbox(labels={"after": "restart"})
    finally:
        t.join(60)
    assert restarted.is_set()
    assert r.ok and r.text == "through-the-restart\n"
    assert made.exec("true").ok
    assert sorted(s.id for s in c.list_sandboxes()) == sorted([sb.id, made.id])
    c.delete_sandboxes([sb.id, made.id])
