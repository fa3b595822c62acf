"""System-test fixtures: a real `dsec server` on a free port, and clients that talk to it.

The server runs with a temporary data dir and a short run dir (unix socket paths are length
limited). Every sandbox created through a client made by `ServerProc.client()` is recorded, so
teardown can prove that none of them left a cgroup behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import List, Optional, Set

import httpx
import pytest

import dsec

from _util import cgroup_dirs_named

REPO = Path(__file__).resolve().parents[3]
LISTEN_RE = re.compile(r"dsec server listening on (http://\S+)")
KEY_RE = re.compile(r"admin api key:\s*(\S+)")
START_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0


def find_dsec_bin() -> Optional[Path]:
    env = os.environ.get("DSEC_BIN")
    if env:
        return Path(env)
    for cand in (
        REPO / "target/x86_64-unknown-linux-gnu/debug/dsec",
        REPO / "target/debug/dsec",
        REPO / "target/x86_64-unknown-linux-gnu/release/dsec",
    ):
        if cand.exists():
            return cand
    return None


def descendants(pid: int) -> Set[int]:
    """Every process below `pid` (by parent pid), now."""
    children: dict = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out: Set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _dsec_cgroups_of(pid: int) -> Set[str]:
    """Names of the sandbox (or pre-built shell) cgroups a process is in."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return set()
    return set(re.findall(r"/dsec/((?:sb|shell)-[^/\s]+)", text))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class ServerProc:
    """One `dsec server` process on a data dir and run dir, restartable on the same dirs."""

    def __init__(self, binary: Path, data_dir: Path, run_dir: Path, log_path: Path) -> None:
        self.extra_args: List[str] = []
        self.binary = binary
        self.data_dir = data_dir
        self.run_dir = run_dir
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.admin_key: Optional[str] = None
        self.port = 0
        self.stdout_lines: List[str] = []
        self.created_ids: Set[str] = set()
        self.clients: List[dsec.Client] = []
        self._reader: Optional[threading.Thread] = None
        self.stopped_descendants: Set[int] = set()
        self.owned_cgroups: Set[str] = set()

    # -- process control -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait for its `listening on` line."""
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        self.stdout_lines = []
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                "server",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--data-dir",
                str(self.data_dir),
                "--run-dir",
                str(self.run_dir),
                *self.extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        log.close()
        listening = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                m = KEY_RE.search(line)
                if m:
                    self.admin_key = m.group(1)
                m = LISTEN_RE.search(line)
                if m:
                    self.url = m.group(1).rstrip("/")
                    listening.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(
                    f"dsec server did not start (rc={self.proc.returncode}); stdout:\n"
                    + "".join(self.stdout_lines)
                    + "\nstderr tail:\n"
                    + self.stderr_tail()
                )
        assert self.url is not None
        self.port = int(self.url.rsplit(":", 1)[1])
        if self.admin_key is None:
            key_file = self.data_dir / "admin.key"
            self.admin_key = key_file.read_text().strip()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=5)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.1)
        raise RuntimeError(f"dsec server never became ready: {last}")

    def stop(self) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.stopped_descendants = descendants(self.proc.pid)
            self.owned_cgroups = {c for p in self.stopped_descendants for c in _dsec_cgroups_of(p)}
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("dsec server did not exit within the drain deadline") from None
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(STOP_TIMEOUT)
        if self._reader is not None:
            self._reader.join(5)

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # -- clients -------------------------------------------------------------------------------

    def _record(self, resp: httpx.Response, body: bytes) -> None:
        req = resp.request
        if req.method != "POST" or resp.status_code >= 300:
            return
        if req.url.path not in ("/v1/sandboxes", "/v1/sandboxes/batch"):
            return
        for m in re.finditer(rb'"id"\s*:\s*"(sb-[^"]+)"', body):
            self.created_ids.add(m.group(1).decode())

    def client(self, api_key: Optional[str] = None, **kw) -> dsec.Client:
        """A sync client (admin unless `api_key`), tracked for the leak check."""

        def hook(resp: httpx.Response) -> None:
            if resp.request.method == "POST" and resp.request.url.path.startswith("/v1/sandboxes"):
                if "stream=true" not in str(resp.request.url):
                    self._record(resp, resp.read())

        c = dsec.Client(self.url, api_key=api_key or self.admin_key, **kw)
        c._http.event_hooks["response"].append(hook)
        self.clients.append(c)
        return c

    def async_client(self, api_key: Optional[str] = None, **kw) -> dsec.AsyncClient:
        """An async client (admin unless `api_key`), tracked for the leak check."""

        async def hook(resp: httpx.Response) -> None:
            if resp.request.method == "POST" and resp.request.url.path.startswith("/v1/sandboxes"):
                if "stream=true" not in str(resp.request.url):
                    self._record(resp, await resp.aread())

        c = dsec.AsyncClient(self.url, api_key=api_key or self.admin_key, **kw)
        c._http.event_hooks["response"].append(hook)
        return c

    def new_tenant(self, **quota) -> dsec.Client:
        """Create a tenant with a unique name and return a client with its key."""
        admin = self.clients[0] if self.clients else self.client()
        t = admin.create_tenant(f"t-{uuid.uuid4().hex[:10]}", **quota)
        assert t.api_key, "create_tenant must answer the new tenant's api_key"
        c = self.client(t.api_key)
        c.tenant_info = t  # type: ignore[attr-defined]
        return c

    # -- teardown ------------------------------------------------------------------------------

    def destroy_leftovers(self) -> List[str]:
        """Destroy what the tests left running (through each tracked tenant's client)."""
        left = []
        for c in self.clients:
            try:
                ids = [s.id for s in c.list_sandboxes() if s.state not in dsec.FINAL_STATES]
            except dsec.DsecError:
                continue
            if ids:
                left += ids
                try:
                    c.delete_sandboxes(ids)
                except dsec.DsecError:
                    pass
        return left

    def empty_pools(self, timeout: float = 60.0) -> None:
        """Size every warm pool to zero and wait until no pooled sandbox is left.

        Sandboxes, pooled ones included, outlive a SIGTERM'd server by design (a restart adopts
        them); a test server that goes away for good must empty its pools first.
        """
        admin = self.clients[0] if self.clients else self.client()
        for p in admin.list_pools():
            admin.set_pool(p.template, min=0, max=0)
        deadline = time.monotonic() + timeout
        while True:
            busy = [p.raw for p in admin.list_pools() if p.ready or p.creating]
            if not busy:
                return
            assert time.monotonic() < deadline, f"pools never emptied: {busy}"
            time.sleep(0.2)

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []

    def assert_no_leaks(self, timeout: float = 15.0) -> None:
        """No cgroup of any sandbox this server made remains."""
        deadline = time.monotonic() + timeout
        while True:
            leaked = cgroup_dirs_named(self.created_ids | self.owned_cgroups)
            if not leaked or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not leaked, f"sandbox cgroups left behind: {leaked}"
        # the spawner, its pre-built shells and every supervisor went with the server
        alive: Set[int] = set()
        while True:
            alive = {p for p in self.stopped_descendants if Path(f"/proc/{p}").exists() and not _is_zombie(p)}
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not alive, f"processes of the server outlived it: {sorted(alive)}"
        shells = cgroup_dirs_named({f"shell-{p}" for p in self.stopped_descendants})
        assert not shells, f"pre-built shell cgroups left behind: {shells}"
        left = set(os.listdir(self.run_dir / "sandboxes")) if (self.run_dir / "sandboxes").is_dir() else set()
        assert not (left & self.created_ids), f"sandbox run dirs left behind: {sorted(left & self.created_ids)}"
        mounts = Path("/proc/self/mountinfo").read_text()
        stale = [i for i in self.created_ids if i in mounts]
        assert not stale, f"host mounts of sandboxes left behind: {stale}"


def new_server(tmp_root: Path, name: str) -> ServerProc:
    binary = find_dsec_bin()
    if binary is None or not binary.exists():
        pytest.fail(
            "no dsec binary: run `cargo build --workspace` or set DSEC_BIN", pytrace=False
        )
    if os.geteuid() != 0:
        pytest.fail("the system tests need root (the server makes namespaces and cgroups)", pytrace=False)
    data_dir = tmp_root / f"{name}-data"
    data_dir.mkdir()
    # unix socket paths are limited to 108 bytes: keep the run dir short
    run_dir = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    # mkdtemp makes it 0700: searchable by others, as /run/dsec is, so that sandboxes in a user
    # namespace (the runner's zygotes) can be made in it.
    run_dir.chmod(0o755)
    return ServerProc(binary, data_dir, run_dir, tmp_root / f"{name}-server.log")


def start_or_clean(srv: ServerProc) -> None:
    try:
        srv.start()
    except BaseException:
        shutil.rmtree(srv.run_dir, ignore_errors=True)
        raise


def finish_server(srv: ServerProc) -> None:
    """Clean up, SIGTERM, and check that the server exits 0 and leaks nothing."""
    try:
        if srv.proc is not None and srv.proc.poll() is not None:
            # a test left the server dead (e.g. failed between a kill -9 and the restart): its
            # sandboxes outlive it, so bring it back on the same dirs to destroy them
            srv.clients = []
            srv.start()
        if srv.proc is not None and srv.proc.poll() is None:
            left = srv.destroy_leftovers()
            if left:
                print(f"\n[dsec tests] destroyed sandboxes the tests left: {left}")
            srv.empty_pools()
        srv.close_clients()
        rc = srv.stop() if srv.proc is not None else 0
        assert srv.stopped_descendants, "the server had no child processes (no spawner?)"
        assert rc == 0, f"dsec server exited {rc} on SIGTERM; stderr tail:\n{srv.stderr_tail()}"
        srv.assert_no_leaks()
    finally:
        shutil.rmtree(srv.run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The shared server of the session."""
    srv = new_server(tmp_path_factory.mktemp("dsec"), "main")
    start_or_clean(srv)
    yield srv
    finish_server(srv)


@pytest.fixture
def fresh_server(tmp_path_factory: pytest.TempPathFactory):
    """A server of its own (for tests that kill or restart it)."""
    srv = new_server(tmp_path_factory.mktemp("dsec"), "own")
    start_or_clean(srv)
    yield srv
    finish_server(srv)


@pytest.fixture(scope="session")
def client(server: ServerProc) -> dsec.Client:
    """An admin client of the shared server."""
    return server.client()


# Every test that takes the `sandbox` fixture runs once per substrate: the same requests must
# give the same results on a container and on both VM substrates (QEMU; TCG on machines
# without usable hardware virtualisation).
SUBSTRATES = ["container", "microvm", "vm"]


@pytest.fixture(params=SUBSTRATES)
def substrate(request) -> str:
    return request.param


@pytest.fixture
def sandbox(client: dsec.Client, substrate: str):
    """A fresh sandbox (admin tenant) of each substrate, destroyed afterwards."""
    with dsec.Sandbox.create(
        client, labels={"fixture": "sandbox"}, ttl_ms=600_000, substrate=substrate
    ) as sb:
        yield sb


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:12]
