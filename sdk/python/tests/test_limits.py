"""Limits and the typed errors of file operations, leases and memory quotas."""

from __future__ import annotations

import os
import time

import pytest

import dsec

from _util import sandbox_exists

MiB = 1 << 20


def test_memory_limit_gives_oom_status(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client, limits={"memory_max": 64 * MiB}) as sb:
        assert sb.limits["memory_max"] == 64 * MiB
        assert sb.limits["pids_max"] == 256  # unspecified limits take the defaults
        r = sb.exec(["/usr/bin/python3", "-c", "x = bytearray(300 << 20); print(len(x))"])
        assert r.status == "oom", r
        assert sb.exec("echo survived").text == "survived\n"


def test_disk_limit_gives_no_space(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client, limits={"disk_bytes": 4 * MiB}) as sb:
        with pytest.raises(dsec.NoSpace) as ei:
            sb.files.write("/tmp/big", b"x" * (8 * MiB))
        assert ei.value.status == 507


def test_read_only_root(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.PermissionDenied) as ei:
        sandbox.files.write("/usr/bin/evil", b"x")
    assert ei.value.status == 403
    r = sandbox.exec("echo x > /usr/local/evil")
    assert r.exit_code != 0


def test_writable_root(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client, writable_root=True) as sb:
        r = sb.exec("echo x > /usr/local/evil && cat /usr/local/evil")
        assert r.ok and r.text == "x\n"
    # the host is untouched
    assert not os.path.exists("/usr/local/evil")


def test_userns_bounds_forks_by_rlimit(client: dsec.Client) -> None:
    # The user namespace is the default.
    with dsec.Sandbox.create(client, limits={"pids_max": 32}) as sb:
        assert sb.userns
        r = sb.exec("awk '/Max processes/ {print $3}' /proc/self/limits; awk '{print $2}' /proc/self/uid_map")
        nproc, first = r.text.split()
        assert nproc == "28", r
        # root is the first id of a host id range of its own: 2^20 + k * 65536
        assert int(first) >= 1 << 20 and (int(first) - (1 << 20)) % 65536 == 0, r
        # A fork beyond the rlimit fails at once with EAGAIN; the sandbox stays usable.
        r = sb.exec(
            [
                "/usr/bin/python3",
                "-c",
                "import os, signal, time\nkids = []\ntry:\n    while True:\n"
                "        pid = os.fork()\n        if pid == 0:\n            time.sleep(30)\n"
                "            os._exit(0)\n        kids.append(pid)\nexcept BlockingIOError:\n"
                "    print(len(kids))\nfor k in kids:\n    os.kill(k, signal.SIGKILL)\n    os.waitpid(k, 0)",
            ],
            timeout_ms=10_000,
        )
        assert r.ok and 16 <= int(r.text) < 28, r
        assert sb.exec("echo ok").text == "ok\n"
    # The admin tenant may opt out: root inside is then host root (no capabilities).
    with dsec.Sandbox.create(client, userns=False) as sb:
        assert not sb.userns
        assert sb.exec("awk '{print $2}' /proc/self/uid_map").text == "0\n"


def test_only_the_admin_may_opt_out_of_the_user_namespace(server) -> None:
    tenant = server.new_tenant()
    with pytest.raises(dsec.Forbidden) as ei:
        dsec.Sandbox.create(tenant, userns=False)
    assert ei.value.code == "forbidden" and "admin" in str(ei.value)
    with dsec.Sandbox.create(tenant, userns=True) as sb:
        assert sb.userns


def test_path_escape(sandbox: dsec.Sandbox) -> None:
    for p in ("../../etc/passwd", "/../../etc/hostname"):
        with pytest.raises(dsec.PathEscape) as ei:
            sandbox.files.read(p)
        assert ei.value.status == 400


def test_idempotency_key_too_long(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidRequest):
        sandbox.client.request("POST", sandbox._path("/lease"), json={}, idempotency_key="k" * 129)


def test_lease_not_renewed_destroys_sandbox(client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client, lease_ms=1_000)
    kept = dsec.Sandbox.create(client, lease_ms=1_000)
    try:
        for _ in range(4):
            time.sleep(0.5)
            kept.heartbeat(lease_ms=1_000)
        assert kept.refresh().state == "running"
        try:
            sb.wait("stopped", timeout_ms=15_000)
        except dsec.SandboxNotFound:
            pass
        assert not sandbox_exists(client, sb.id)
    finally:
        kept.destroy()


def test_memory_quota(server) -> None:
    t = server.new_tenant(max_memory_bytes=600 * MiB)
    first = dsec.Sandbox.create(t)  # default memory_max: 512 MiB
    try:
        with pytest.raises(dsec.QuotaExceeded):
            dsec.Sandbox.create(t)
        with dsec.Sandbox.create(t, limits={"memory_max": 64 * MiB}) as small:
            assert small.exec("true").ok
            assert t.tenant().usage["memory_bytes"] == 576 * MiB
    finally:
        first.destroy()


def test_node_sandbox_limit_is_resource_exhausted(tmp_path_factory) -> None:
    from conftest import finish_server, new_server, start_or_clean

    srv = new_server(tmp_path_factory.mktemp("dsec"), "small")
    srv.extra_args = ["--max-sandboxes", "2", "--pool-max", "0"]
    start_or_clean(srv)
    try:
        c = srv.client(max_retries=0)
        a = c.create_sandbox()
        b = c.create_sandbox()
        with pytest.raises(dsec.ResourceExhausted) as ei:
            c.create_sandbox()
        assert ei.value.status == 503
        a.destroy()
        assert c.create_sandbox().exec("true").ok  # room again
        b.destroy()
    finally:
        finish_server(srv)


def test_long_poll_timeout_units(sandbox: dsec.Sandbox) -> None:
    t0 = time.monotonic()
    body = sandbox.client.request_json(
        "GET", sandbox._path(), params={"after_version": sandbox.version, "timeout": "300ms"}
    )
    assert 0.2 < time.monotonic() - t0 < 10
    assert body["id"] == sandbox.id


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _online_cpus() -> int:
    with open("/sys/devices/system/cpu/online") as f:
        n = 0
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
        return n


def test_limits_beyond_the_node_are_invalid_request(client: dsec.Client) -> None:
    mem = _mem_total()
    cpus = _online_cpus()
    cases = [
        ({"memory_max": 999_999 << 40}, ["memory_max", str(999_999 << 40), str(mem), "MemTotal"]),
        ({"memory_max": (1 << 64) - 1}, ["memory_max"]),
        ({"disk_bytes": mem + 1}, ["disk_bytes", str(mem + 1), str(mem)]),
        ({"cpu_max": cpus + 1}, ["cpu_max", f"at most {cpus} CPUs"]),
    ]

    def records() -> set:
        return {s.id for s in client.list_sandboxes()} | {s.id for s in client.list_sandboxes(state="stopped")}

    before = records()
    for limits, words in cases:
        with pytest.raises(dsec.InvalidRequest) as ei:
            dsec.Sandbox.create(client, limits=limits)
        e = ei.value
        assert (e.status, e.code) == (400, "invalid_request"), e
        for w in words:
            assert w in (e.detail or ""), (w, e.detail)
    # Nothing was recorded (so nothing was made).
    assert records() == before
