"""VM substrates (`microvm`, `vm`): what only a virtual machine has to prove.

The exec/files/sessions/limits suite runs against every substrate through the parametrised
`sandbox` fixture (conftest.py); this file adds the abuse cases inside a guest, the guest's
identity after a snapshot restore, QEMU being killed, the daemon being killed with VMs running,
and guest-chosen paths (C-10).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

import dsec

from _util import cgroup_dirs_named

VMS = ["microvm", "vm"]
REPO = Path(__file__).resolve().parents[3]
PY = "/usr/bin/python3"


def qemu_pid(srv, sid: str) -> int:
    return int((srv.run_dir / "sandboxes" / sid / "qemu.pid").read_text())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("substrate", VMS)
def test_guest_identity_after_restore(client: dsec.Client, substrate: str) -> None:
    """Clones of one snapshot get their own hostname, the host's clock and fresh entropy."""
    a = dsec.Sandbox.create(client, substrate=substrate)
    b = dsec.Sandbox.create(client, substrate=substrate)
    try:
        assert a.substrate == substrate
        probe = "hostname; date +%s; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
        ra, rb = a.exec(probe), b.exec(probe)
        assert ra.ok and rb.ok, (ra, rb)
        ha, ta, ea = ra.text.split("\n")[:3]
        hb, tb, eb = rb.text.split("\n")[:3]
        assert ha == a.id and hb == b.id
        assert abs(int(ta) - time.time()) < 30 and abs(int(tb) - time.time()) < 30
        assert ea != eb, "two clones of one snapshot produced the same random bytes"
        # a guest kernel of its own, not the host's
        uname = a.exec("uname -r").text.strip()
        assert uname != os.uname().release
        # the accelerator in use and the restores are reported
        ready = client.readyz()
        assert ready["vm"]["started"] and ready["vm"]["accel"] in ("tcg", "kvm")
        assert ready["vm"]["kernel"] == uname
        text = client.metrics()
        assert f'dsec_vm_accel{{accel="{ready["vm"]["accel"]}"}} 1' in text
        assert f'dsec_vm_sandboxes_created_total{{substrate="{substrate}"}}' in text
    finally:
        a.destroy()
        b.destroy()


@pytest.mark.parametrize("substrate", VMS)
def test_reset_restores_the_snapshot(client: dsec.Client, substrate: str) -> None:
    with dsec.Sandbox.create(client, substrate=substrate) as sb:
        sb.files.write("/tmp/state", b"dirty")
        assert sb.exec("ls /tmp/state").ok
        sb.reset()
        r = sb.exec("ls /tmp/state")
        assert r.status == "nonzero_exit", r
        assert sb.exec("hostname").text.strip() == sb.id


@pytest.mark.parametrize("substrate", VMS)
def test_r03_memory_bomb_is_oom_inside_only(client: dsec.Client, substrate: str) -> None:
    with dsec.Sandbox.create(client, substrate=substrate, limits={"memory_max": 256 << 20}) as sb:
        r = sb.exec([PY, "-c", "a = []\nwhile True: a.append(bytearray(1 << 20))"], timeout_ms=60_000)
        assert r.status == "oom", r
        # the agent's memory guard (a PSI trigger the guest kernel took) is what ends a thrash
        assert "memory-guard" in sb.exec("cat /proc/1/task/*/comm").text.split()
        # the guest survives its OOM and keeps serving
        again = sb.exec("echo alive")
        assert again.ok and again.text == "alive\n"
        assert sb.exec("echo still").text == "still\n"


@pytest.mark.parametrize("substrate", VMS)
def test_r04_disk_quota_is_a_disk_not_guest_ram(client: dsec.Client, substrate: str) -> None:
    """The writable layer is a disk of `disk_bytes` of its own: more than the guest's RAM can
    be written, and filling it is ENOSPC inside only."""
    limits = {"memory_max": 256 << 20, "disk_bytes": 384 << 20}
    with dsec.Sandbox.create(client, substrate=substrate, limits=limits) as sb:
        r = sb.exec("head -c 300000000 /dev/zero > /tmp/a && stat -c %s /tmp/a", timeout_ms=120_000)
        assert r.ok and r.text == "300000000\n", r
        fill = sb.exec("head -c 300000000 /dev/zero > /tmp/b; echo rc=$?", timeout_ms=120_000)
        assert "rc=1" in fill.text and "No space" in fill.stderr_text, fill
        assert sb.exec("rm /tmp/a /tmp/b && echo still").text == "still\n"


@pytest.mark.parametrize("substrate", VMS)
def test_r06_spin_and_sleep_time_out(client: dsec.Client, substrate: str) -> None:
    with dsec.Sandbox.create(client, substrate=substrate) as sb:
        t0 = time.monotonic()
        r = sb.exec("sleep 1000", timeout_ms=1000)
        assert r.status == "timeout", r
        r = sb.exec("while :; do :; done", timeout_ms=1000)
        assert r.status == "timeout", r
        r = sb.exec("cat", timeout_ms=1000)  # stdin closed: returns at once
        assert r.ok
        assert time.monotonic() - t0 < 30
        assert sb.exec("echo ok").ok


@pytest.mark.parametrize("substrate", VMS)
def test_r08_output_flood_is_capped(client: dsec.Client, substrate: str) -> None:
    with dsec.Sandbox.create(client, substrate=substrate) as sb:
        r = sb.exec(
            [PY, "-c", "import sys\nwhile True: sys.stdout.buffer.write(b'\\xff' * 65536)"],
            output_limit=1 << 20,
            timeout_ms=60_000,
        )
        assert r.status == "output_limit", r
        assert r.stdout_truncated and len(r.stdout) <= 1 << 20
        # a grandchild holding the pipe does not hold the exec
        t0 = time.monotonic()
        r = sb.exec("(sleep 100 &) ; echo main-done", timeout_ms=30_000)
        assert r.ok and r.text.startswith("main-done"), r
        assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("substrate", VMS)
def test_c10_guest_paths_are_not_followed_on_the_host(client: dsec.Client, substrate: str, tmp_path: Path) -> None:
    with dsec.Sandbox.create(client, substrate=substrate) as sb:
        r = sb.exec(
            "mkdir -p /tmp/out && echo data > /tmp/out/file && "
            "ln -s /etc /tmp/out/etc-link && ln -s ../../../../../../tmp /tmp/out/up && "
            f"ln -s {REPO / 'Cargo.toml'} /tmp/hostfile"
        )
        assert r.ok, r
        dest = tmp_path / "dl"
        sb.files.download_dir("/tmp/out", dest)
        assert (dest / "file").read_bytes() == b"data\n"
        # links from a guest are never recreated (nor followed) on the host
        assert not os.path.lexists(dest / "etc-link") and not os.path.lexists(dest / "up")
        # a guest symlink to a host path resolves beneath the guest's root, where that path
        # does not exist: the host's file is never reached
        assert (REPO / "Cargo.toml").exists()
        with pytest.raises(dsec.NotFound):
            sb.files.read("/tmp/hostfile")
        # a tar whose member names climb out of the destination is refused outright
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w") as tf:
            info = tarfile.TarInfo("../../escape")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
        sb.files.write("/tmp/evil.tar", evil.getvalue())
        assert sb.exec("mkdir -p /tmp/e && tar -xf /tmp/evil.tar -C /tmp/e 2>&1; true").ok
        listing = sb.files.list("/tmp")
        assert all("/" not in e.name for e in listing)


@pytest.mark.durability
@pytest.mark.parametrize("substrate", VMS)
def test_qemu_kill9_is_recorded_and_cleaned(fresh_server, substrate: str) -> None:
    c = fresh_server.client()
    sb = dsec.Sandbox.create(c, substrate=substrate)
    pid = qemu_pid(fresh_server, sb.id)
    assert alive(pid)
    os.kill(pid, 9)
    # the node notices, records why, and leaves nothing behind
    assert wait_until(lambda: c.get_sandbox(sb.id).state in ("failed", "stopped"), 30), c.get_sandbox(sb.id)
    rec = c.get_sandbox(sb.id)
    assert "QEMU" in (rec.data.get("error") or ""), rec.data
    assert wait_until(lambda: not cgroup_dirs_named({sb.id}), 20)
    assert not (fresh_server.run_dir / "sandboxes" / sb.id).exists()
    try:
        sb.destroy()
    except dsec.DsecError:
        pass


@pytest.mark.durability
def test_daemon_kill9_with_vms_running(fresh_server) -> None:
    """VMs outlive the daemon like containers: the restarted daemon re-attaches to each QEMU
    (the guest's agent greets the new connection), and files, background processes and the
    list are as they were."""
    c = fresh_server.client()
    vms = [dsec.Sandbox.create(c, substrate=s, labels={"restart": "vm"}) for s in VMS]
    procs = []
    for v in vms:
        v.files.write("/tmp/keep", b"still here")
        procs.append(v.spawn(["/bin/sleep", "300"]))
    pids = [qemu_pid(fresh_server, v.id) for v in vms]
    c.close()
    fresh_server.kill9()
    fresh_server.clients = []
    fresh_server.start()
    c2 = fresh_server.client()
    assert {s.id for s in c2.list_sandboxes(labels={"restart": "vm"})} == {v.id for v in vms}
    for v, pid, p in zip(vms, pids, procs):
        again = dsec.Sandbox.connect(v.id, c2)
        assert again.state == "running", again.data
        assert qemu_pid(fresh_server, v.id) == pid and alive(pid), "not the same QEMU"
        assert again.files.read("/tmp/keep") == b"still here"
        assert dsec.Process(again, {"handle": p.handle}).status().running
        r = again.exec("echo alive; hostname")
        assert r.ok and r.text == f"alive\n{v.id}\n", r
        again.destroy()
        assert wait_until(lambda: not alive(pid), 20)  # noqa: B023 - called before the loop moves on
        assert not cgroup_dirs_named({v.id})


@pytest.mark.parametrize("substrate", VMS)
def test_warm_pool_of_vms(client: dsec.Client, substrate: str) -> None:
    """A VM pool is named `<template>@<substrate>` and serves creates of that substrate."""
    name = f"host@{substrate}"
    st = client.set_pool(name, min=1, max=2)
    try:
        assert st.template == name and st.min == 1
        deadline = time.monotonic() + 120
        while client.get_pool(name).ready < 1:
            assert time.monotonic() < deadline, "the VM pool never filled"
            time.sleep(0.2)
        hits = client.get_pool(name).hits
        with dsec.Sandbox.create(client, substrate=substrate) as sb:
            assert sb.pooled and sb.substrate == substrate
            assert sb.exec("hostname").text.strip() == sb.id
        assert client.get_pool(name).hits == hits + 1
        # a container create does not take a VM from the pool
        with dsec.Sandbox.create(client) as c:
            assert c.substrate == "container"
    finally:
        client.set_pool(name, min=0, max=0)
    with pytest.raises(dsec.InvalidRequest):
        client.set_pool("host@function", min=0, max=1)


def test_qemus_cannot_signal_each_other(server, client: dsec.Client) -> None:
    """G-18: each VM's QEMU runs as a uid of its own, so a compromised QEMU cannot signal (or
    ptrace) another VM's QEMU."""
    with dsec.Sandbox.create(client, substrate="microvm") as a, dsec.Sandbox.create(
        client, substrate="microvm"
    ) as b:
        pa, pb = qemu_pid(server, a.id), qemu_pid(server, b.id)
        uid = (1 << 30) + pa
        assert Path(f"/proc/{pa}/status").read_text().count(f"\t{uid}") >= 4
        probe = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-0"]
        other = subprocess.run([*probe, str(pb)], capture_output=True, text=True)
        assert other.returncode != 0 and "not permitted" in other.stderr, other
        # the same uid reaches its own QEMU: the refusal above is the uid's, not setpriv's
        own = subprocess.run([*probe, str(pa)], capture_output=True, text=True)
        assert own.returncode == 0, own


@pytest.mark.parametrize("substrate", VMS)
def test_qemu_is_confined(server, client: dsec.Client, substrate: str) -> None:
    """QEMU is treated as hostile: unprivileged, chrooted, in the sandbox's cgroup with a
    memory cap, holding nothing of the daemon."""
    with dsec.Sandbox.create(client, substrate=substrate, limits={"memory_max": 256 << 20}) as sb:
        pid = qemu_pid(server, sb.id)
        status = Path(f"/proc/{pid}/status").read_text()
        # a uid and gid of its own: 2^30 + its pid (G-18), no passwd entry needed (G-24)
        for field in ("Uid:", "Gid:"):
            ids = next(l for l in status.splitlines() if l.startswith(field)).split()[1:]
            assert ids == [str((1 << 30) + pid)] * 4, f"QEMU runs as {field} {ids}"
        assert os.readlink(f"/proc/{pid}/root") == str(server.run_dir / "sandboxes" / sb.id / "jail")
        assert "Seccomp:\t2" in status, "QEMU has no seccomp filter"
        # in the sandbox's cgroup, memory capped at guest RAM + QEMU's overhead
        groups = cgroup_dirs_named({sb.id})
        assert groups
        assert any(str(pid) in Path(g, "cgroup.procs").read_text().split() for g in groups)
        for g in groups:
            for f in ("memory.max", "memory.limit_in_bytes"):
                p = Path(g, f)
                if p.exists():
                    assert int(p.read_text()) == (256 << 20) + (256 << 20)
        # no descriptor of the daemon's state, listeners or other sandboxes
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            assert str(server.data_dir) not in target, target
            assert not target.startswith(str(server.run_dir / "sandboxes")) or sb.id in target, target
