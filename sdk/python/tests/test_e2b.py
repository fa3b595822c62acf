"""The official E2B Python SDKs, unmodified, against a dsec node.

A user switches from E2B to dsec with three environment variables and nothing else:
`E2B_API_URL` and `E2B_SANDBOX_URL` both name the node's own listener (the control plane and the
in-sandbox "envd" and code interpreter APIs share it; the SDK routes sandbox requests with the
`E2b-Sandbox-Id` / `E2b-Sandbox-Port` / `X-Access-Token` headers) and `E2B_API_KEY` is a dsec API
key. These tests set exactly those (and pass `api_key`/`api_url` where the SDK takes them) and
then use `e2b` 2.63 and `e2b-code-interpreter` 2.11 as their documentation says; `e2b` 2.20 (the
older release that, after `Sandbox.connect(id)`, routes by the access token alone) runs from its
own venv (target/e2b20-venv, made by scripts/test-python.sh) as a subprocess.

Every sandbox a test makes is killed in its teardown.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import textwrap
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest
from e2b import (
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxInfo,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)
from e2b_code_interpreter import Sandbox as CISandbox

import dsec

REPO = Path(__file__).resolve().parents[3]
E2B20_PYTHON = REPO / "target/e2b20-venv/bin/python"

# The microvm substrate runs a subset (create, commands, files, kill). E2B has no substrate field:
# the node reads it from the create's metadata. test_vm.py runs its VM tests on every run, with
# no condition (scripts/test.sh installs QEMU; the node falls back to TCG without usable KVM),
# so the microvm cases here run on every run too.
SUBSTRATE_KEY = "dsec.substrate"
SUBSTRATES = ["container", "microvm"]

# Every sandbox these tests make carries this metadata, so the list test can tell its own apart.
SUITE = {"suite": "e2b"}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2b_env(server) -> Iterator[Dict[str, str]]:
    """The three variables a user sets to point the E2B SDKs at a dsec node (restored after)."""
    env = {
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_API_KEY": server.admin_key,
    }
    saved = {k: os.environ.get(k) for k in [*env, "E2B_DOMAIN", "E2B_DEBUG"]}
    os.environ.update(env)
    # a developer's own E2B settings must not leak into the run
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def opts(e2b_env: Dict[str, str]) -> Dict[str, str]:
    """The connection options the SDK's class methods take explicitly."""
    return {"api_key": e2b_env["E2B_API_KEY"], "api_url": e2b_env["E2B_API_URL"]}


def _kill_all(ids: List[str], opts: Dict[str, str]) -> None:
    for sid in ids:
        try:
            Sandbox.kill(sid, **opts)
        except Exception as e:  # the node's own teardown destroys what is left
            print(f"\n[e2b tests] could not kill {sid}: {e!r}")


@pytest.fixture
def make(opts: Dict[str, str]) -> Iterator[Callable[..., Sandbox]]:
    """A factory of E2B sandboxes (`substrate=` goes into the metadata); all killed afterwards."""
    made: List[str] = []

    def create(
        substrate: str = "container",
        metadata: Optional[Dict[str, str]] = None,
        cls: type = Sandbox,
        timeout: int = 600,
        **kw,
    ) -> Sandbox:
        md = {**SUITE, **(metadata or {})}
        if substrate != "container":
            md[SUBSTRATE_KEY] = substrate
        sbx = cls.create(metadata=md, timeout=timeout, **opts, **kw)
        made.append(sbx.sandbox_id)
        return sbx

    try:
        yield create
    finally:
        _kill_all(made, opts)


@pytest.fixture
def sbx(make: Callable[..., Sandbox]) -> Sandbox:
    """A fresh sandbox of the `base` template (container)."""
    return make()


@pytest.fixture(scope="module")
def ci(opts: Dict[str, str]) -> Iterator[CISandbox]:
    """One code interpreter sandbox (template `code-interpreter-v1`) for the interpreter tests."""
    sbx = CISandbox.create(metadata={**SUITE, "kind": "ci"}, timeout=600, **opts)
    try:
        yield sbx
    finally:
        _kill_all([sbx.sandbox_id], opts)


def list_all(query: SandboxQuery, opts: Dict[str, str]) -> List[SandboxInfo]:
    """Every page of `Sandbox.list(query)`."""
    pages = Sandbox.list(query=query, **opts)
    out: List[SandboxInfo] = []
    while pages.has_next:
        out += pages.next_items()
    return out


def assert_substrate(client: dsec.Client, sbx: Sandbox, substrate: str) -> None:
    """The E2B sandbox is a dsec sandbox of the same id, on the substrate its metadata chose."""
    assert client.get_sandbox(sbx.sandbox_id).substrate == substrate


# -- control plane -------------------------------------------------------------------------------


@pytest.mark.parametrize("substrate", SUBSTRATES)
def test_create_and_kill(make, client: dsec.Client, opts, substrate: str) -> None:
    sbx = make(substrate)
    assert sbx.sandbox_id
    assert_substrate(client, sbx, substrate)
    assert sbx.is_running()
    assert sbx.commands.run("echo up").stdout == "up\n"
    assert sbx.kill() is True
    assert sbx.is_running() is False
    # a second kill of the same id answers 404, which the SDK turns into False
    assert Sandbox.kill(sbx.sandbox_id, **opts) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **opts)


def test_list_filters_by_metadata(make, opts) -> None:
    uid = uuid.uuid4().hex[:10]
    a = make(metadata={"run": uid, "n": "0"})
    b = make(metadata={"run": uid, "n": "1"})
    other = make(metadata={"run": uid + "-other"})
    listed = list_all(SandboxQuery(metadata={"run": uid}), opts)
    assert sorted(s.sandbox_id for s in listed) == sorted([a.sandbox_id, b.sandbox_id])
    by_id = {s.sandbox_id: s for s in listed}
    assert by_id[a.sandbox_id].metadata == {**SUITE, "run": uid, "n": "0"}
    assert all(s.state == SandboxState.RUNNING for s in listed)
    # every key of the filter must match
    one = list_all(SandboxQuery(metadata={"run": uid, "n": "1"}), opts)
    assert [s.sandbox_id for s in one] == [b.sandbox_id]
    # with no filter the list holds all of them
    everything = {s.sandbox_id for s in list_all(SandboxQuery(), opts)}
    assert {a.sandbox_id, b.sandbox_id, other.sandbox_id} <= everything
    # a killed sandbox leaves the list
    assert a.kill()
    assert [s.sandbox_id for s in list_all(SandboxQuery(metadata={"run": uid}), opts)] == [b.sandbox_id]
    # paging: one at a time, the pages together are the whole list
    pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"}), limit=1, **opts)
    seen: List[str] = []
    while pages.has_next:
        items = pages.next_items()
        assert len(items) <= 1
        seen += [s.sandbox_id for s in items]
    assert {b.sandbox_id, other.sandbox_id} <= set(seen) and len(seen) == len(set(seen))


def test_connect_by_id(sbx: Sandbox, opts) -> None:
    sbx.commands.run("echo kept > /tmp/f")
    again = Sandbox.connect(sbx.sandbox_id, **opts)
    assert again.sandbox_id == sbx.sandbox_id
    assert again.commands.run("cat /tmp/f").stdout == "kept\n"
    assert again.files.read("/tmp/f") == "kept\n"
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("no-such-sandbox-" + uuid.uuid4().hex[:8], **opts)


def test_set_timeout(make, opts) -> None:
    sbx = make(timeout=300)
    info = sbx.get_info()
    assert timedelta(seconds=290) <= info.end_at - info.started_at <= timedelta(seconds=310)
    sbx.set_timeout(1200)
    longer = sbx.get_info()
    assert longer.end_at - info.end_at >= timedelta(seconds=850)
    # a short timeout ends the sandbox
    sbx.set_timeout(2)
    deadline = time.monotonic() + 30
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not sbx.is_running(), "the sandbox outlived its 2 s timeout by 30 s"
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(sbx.sandbox_id, 60, **opts)


def test_get_info(make, opts) -> None:
    before = datetime.now(timezone.utc)
    sbx = make(metadata={"who": "info"}, timeout=300)
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert "base" in (info.template_id, info.name), (info.template_id, info.name)
    assert info.started_at.tzinfo is not None
    assert before - timedelta(seconds=5) <= info.started_at <= datetime.now(timezone.utc) + timedelta(seconds=5)
    assert info.started_at < info.end_at
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {**SUITE, "who": "info"}
    assert info.cpu_count >= 1 and info.memory_mb > 0
    assert info.envd_version
    assert Sandbox.get_info(sbx.sandbox_id, **opts).sandbox_id == sbx.sandbox_id


def test_is_running(sbx: Sandbox, opts) -> None:
    assert sbx.is_running() is True
    other = Sandbox.connect(sbx.sandbox_id, **opts)
    assert other.is_running() is True
    assert Sandbox.kill(sbx.sandbox_id, **opts) is True
    assert sbx.is_running() is False
    assert other.is_running() is False


# -- commands ------------------------------------------------------------------------------------


@pytest.mark.parametrize("substrate", SUBSTRATES)
def test_run_foreground(make, substrate: str) -> None:
    sbx = make(substrate)
    r = sbx.commands.run("echo hi")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo no >&2; exit 4")
    assert (e.value.exit_code, e.value.stderr) == (4, "no\n")


def test_nonzero_exit_raises(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; echo oops >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"
    assert e.value.stderr == "oops\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("no-such-command-xyz")
    assert e.value.exit_code == 127
    assert "no-such-command-xyz" in e.value.stderr


def test_envs(make) -> None:
    sbx = make(envs={"FROM_CREATE": "c1", "SHARED": "create"})
    assert sbx.commands.run("echo $FROM_CREATE").stdout == "c1\n"
    r = sbx.commands.run('echo "$FROM_CREATE $PER_CMD $SHARED"', envs={"PER_CMD": "p1", "SHARED": "cmd"})
    assert r.stdout == "c1 p1 cmd\n"
    # a command's envs are its own
    assert sbx.commands.run('echo "[$PER_CMD] $SHARED"').stdout == "[] create\n"
    # the create's envs reach background commands and root too
    assert sbx.commands.run("echo $FROM_CREATE", user="root").stdout == "c1\n"
    assert sbx.commands.run("echo $FROM_CREATE", background=True).wait().stdout == "c1\n"


def test_internet_access_maps_onto_egress(make, client: dsec.Client) -> None:
    # E2B's default (allow_internet_access=True) is the public internet where the tenant may
    # have it (the admin tenant here): the sandbox has a path out; False keeps loopback only.
    on = make()
    assert "eth0" in on.commands.run("cat /proc/net/dev").stdout
    assert dsec.Sandbox.connect(on.sandbox_id, client).network == {"egress": "all"}
    off = make(allow_internet_access=False)
    assert "eth0" not in off.commands.run("cat /proc/net/dev").stdout
    assert dsec.Sandbox.connect(off.sandbox_id, client).network == {"egress": "none"}


def test_cwd(sbx: Sandbox) -> None:
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    sbx.files.make_dir("/tmp/a/b")
    assert sbx.commands.run("pwd", cwd="/tmp/a/b").stdout == "/tmp/a/b\n"
    # without cwd a command starts in the user's home
    assert sbx.commands.run("pwd").stdout == "/home/user\n"


def test_user_default_and_root(sbx: Sandbox) -> None:
    r = sbx.commands.run('whoami; id -u; echo "$HOME"')
    assert r.stdout == "user\n1000\n/home/user\n"
    r = sbx.commands.run('whoami; id -u; echo "$HOME"', user="root")
    assert r.stdout == "root\n0\n/root\n"
    # files follow the user too
    sbx.commands.run("touch /tmp/by-root", user="root")
    sbx.commands.run("touch /tmp/by-user")
    assert sbx.commands.run("stat -c %U /tmp/by-root /tmp/by-user").stdout == "root\nuser\n"
    with pytest.raises(CommandExitException):
        sbx.commands.run("touch /root/nope")


def test_background_and_wait(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    h = sbx.commands.run("sleep 2; echo bg; echo err >&2", background=True)
    assert time.monotonic() - t0 < 1.5, "run(background=True) waited for the command"
    assert h.pid > 0
    r = h.wait()
    assert (r.stdout, r.stderr, r.exit_code) == ("bg\n", "err\n", 0)
    assert time.monotonic() - t0 >= 2


def test_send_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True, timeout=30)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.send_stdin(h.pid, "world\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert (r.stdout, r.exit_code) == ("hello\nworld\n", 0)


def test_stream_input(sbx: Sandbox) -> None:
    """`commands.stream_input` (Process/StreamInput, a client stream of envelopes) feeds stdin in
    order; an unknown pid is NotFound."""
    h = sbx.commands.run("cat", background=True, stdin=True, timeout=30)
    sbx.commands.stream_input(h.pid, iter(["one\n", b"two\n", "three\n"]))
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert (r.stdout, r.exit_code) == ("one\ntwo\nthree\n", 0)
    with pytest.raises(NotFoundException):
        sbx.commands.stream_input(999_999, iter(["x"]))


def test_create_is_idempotent(e2b_env: Dict[str, str]) -> None:
    """A create retried with the same Idempotency-Key answers the first sandbox again."""
    import urllib.request

    body = json.dumps({"templateID": "base", "metadata": {"test": "idem"}}).encode()
    key = f"e2b-{uuid.uuid4()}"

    def create() -> Dict[str, str]:
        req = urllib.request.Request(
            e2b_env["E2B_API_URL"] + "/v2/sandboxes",
            data=body,
            headers={
                "X-API-KEY": e2b_env["E2B_API_KEY"],
                "Content-Type": "application/json",
                "Idempotency-Key": key,
            },
        )
        with urllib.request.urlopen(req) as r:
            assert r.status == 201
            out: Dict[str, str] = json.loads(r.read())
            return out

    first = create()
    try:
        again = create()
        assert again["sandboxID"] == first["sandboxID"]
        assert again["envdAccessToken"] == first["envdAccessToken"]
    finally:
        Sandbox.kill(first["sandboxID"], api_key=e2b_env["E2B_API_KEY"], api_url=e2b_env["E2B_API_URL"])


def test_kill_process(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 30", background=True, timeout=60)
    t0 = time.monotonic()
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0
    assert time.monotonic() - t0 < 10
    # the process is gone: a second kill finds nothing
    assert sbx.commands.kill(h.pid) is False
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_list_processes(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 30", background=True, envs={"MARK": "listed"}, cwd="/tmp", timeout=60)
    try:
        procs = {p.pid: p for p in sbx.commands.list()}
        assert h.pid in procs, procs
        p = procs[h.pid]
        assert p.cmd == "/bin/bash"
        assert p.args == ["-l", "-c", "sleep 30"]
        assert p.envs.get("MARK") == "listed"
        assert p.cwd == "/tmp"
    finally:
        h.kill()
    deadline = time.monotonic() + 10
    while h.pid in [p.pid for p in sbx.commands.list()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_connect_to_running_process(sbx: Sandbox) -> None:
    h = sbx.commands.run("echo early; sleep 3; echo later", background=True, timeout=30)
    pid = h.pid
    # dropping the stream does not stop the process
    h.disconnect()
    assert pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(pid, timeout=30)
    assert again.pid == pid
    r = again.wait()
    assert "later\n" in r.stdout
    assert r.exit_code == 0
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999, timeout=10)


@pytest.mark.slow
def test_command_longer_than_60s(sbx: Sandbox) -> None:
    """The SDK's default command timeout is 60 s; `timeout=0` lifts it, `timeout=90` raises it."""
    t0 = time.monotonic()
    unlimited = sbx.commands.run("sleep 65 && echo done", background=True, timeout=0)
    bounded = sbx.commands.run("sleep 65 && echo done", background=True, timeout=90)
    for h in (unlimited, bounded):
        r = h.wait()
        assert (r.stdout, r.exit_code) == ("done\n", 0)
    assert time.monotonic() - t0 >= 65


def test_on_stdout_callback(sbx: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    stamps: List[float] = []

    def on_out(s: str) -> None:
        out.append(s)
        stamps.append(time.monotonic())

    r = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done; echo bad >&2",
        on_stdout=on_out,
        on_stderr=err.append,
    )
    assert "".join(out) == "line1\nline2\nline3\n" == r.stdout
    assert "".join(err) == "bad\n" == r.stderr
    # the lines arrive as they are printed, not all at the end
    assert stamps[-1] - stamps[0] >= 0.5


def test_pty(sbx: Sandbox) -> None:
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)
    assert h.pid > 0
    out = bytearray()
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    sbx.pty.send_stdin(h.pid, b"tty\n")
    sbx.pty.send_stdin(h.pid, b"exit\n")
    r = h.wait(on_pty=out.extend)
    assert r.exit_code == 0
    text = out.decode("utf-8", "replace")
    assert "24 80" in text, text
    assert "/dev/pts/" in text, text


def test_port_forwarding(sbx: Sandbox, e2b_env: Dict[str, str]) -> None:
    """A web server in the sandbox is reached through the node: by E2b-Sandbox-Port, and by a
    Host of the form <port>-<id>.<domain>; a closed port answers 502 naming it."""
    import urllib.error
    import urllib.request

    sbx.files.write("/home/user/site/index.html", "hello from the sandbox\n")
    h = sbx.commands.run("cd /home/user/site && exec python3 -m http.server 8000", background=True, timeout=0)
    token = sbx._envd_access_token  # what the SDK sends as X-Access-Token
    assert token
    url = e2b_env["E2B_SANDBOX_URL"]
    try:
        by_header = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000", "X-Access-Token": token}
        deadline = time.time() + 10
        while True:
            try:
                with urllib.request.urlopen(urllib.request.Request(url + "/index.html", headers=by_header)) as r:
                    assert (r.status, r.read()) == (200, b"hello from the sandbox\n")
                break
            except urllib.error.HTTPError as e:
                assert e.code == 502 and time.time() < deadline, e.read()
                time.sleep(0.2)
        by_host = {"Host": f"8000-{sbx.sandbox_id}.sandbox.test", "X-Access-Token": token}
        with urllib.request.urlopen(urllib.request.Request(url + "/index.html", headers=by_host)) as r:
            assert r.read() == b"hello from the sandbox\n"
        closed = dict(by_header, **{"E2b-Sandbox-Port": "8001"})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(urllib.request.Request(url + "/", headers=closed))
        assert ei.value.code == 502
        assert "port 8001 is not open" in json.loads(ei.value.read())["message"]
        # without the sandbox's token: refused
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(
                urllib.request.Request(url + "/", headers=dict(by_header, **{"X-Access-Token": "sb-x.y"}))
            )
        assert ei.value.code == 401
    finally:
        h.kill()


# A thread-safety smoke test: the SDK holds one HTTP/1.1 connection per open stream, so several
# background commands and a foreground one at once must each get their own answer.
def test_concurrent_streams(sbx: Sandbox) -> None:
    handles = [sbx.commands.run(f"sleep 1; echo {i}", background=True, timeout=30) for i in range(5)]
    results: Dict[int, str] = {}

    def wait(i: int) -> None:
        results[i] = handles[i].wait().stdout

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    assert sbx.commands.run("echo fg").stdout == "fg\n"
    for t in threads:
        t.join(30)
    assert results == {i: f"{i}\n" for i in range(5)}


# -- files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("substrate", SUBSTRATES)
def test_files_write_read(make, substrate: str) -> None:
    sbx = make(substrate)
    info = sbx.files.write("/home/user/hello.txt", "héllo\nworld\n")
    assert (info.name, info.path) == ("hello.txt", "/home/user/hello.txt")
    assert sbx.files.read("/home/user/hello.txt") == "héllo\nworld\n"
    # a relative path is relative to the user's home
    assert sbx.files.read("hello.txt") == "héllo\nworld\n"
    assert sbx.commands.run("cat /home/user/hello.txt").stdout == "héllo\nworld\n"
    blob = bytes(range(256)) * 4
    sbx.files.write("/tmp/deep/er/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/deep/er/blob.bin", format="bytes")) == blob
    # overwrite
    sbx.files.write("/home/user/hello.txt", "short")
    assert sbx.files.read("/home/user/hello.txt") == "short"
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/no-such-file")


def test_files_dirs_list_remove_rename(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("/tmp/d/sub") is True
    assert sbx.files.make_dir("/tmp/d/sub") is False
    sbx.files.write("/tmp/d/a.txt", "a")
    entries = {e.name: e for e in sbx.files.list("/tmp/d")}
    assert set(entries) == {"sub", "a.txt"}
    assert entries["sub"].type == FileType.DIR
    assert entries["a.txt"].type == FileType.FILE
    assert entries["a.txt"].path == "/tmp/d/a.txt"
    sbx.files.write("/tmp/d/sub/b.txt", "b")
    deep = {e.path for e in sbx.files.list("/tmp/d", depth=2)}
    assert "/tmp/d/sub/b.txt" in deep
    assert sbx.files.exists("/tmp/d/a.txt") is True
    assert sbx.files.exists("/tmp/d/nothing") is False
    moved = sbx.files.rename("/tmp/d/a.txt", "/tmp/d/sub/c.txt")
    assert moved.path == "/tmp/d/sub/c.txt"
    assert sbx.files.exists("/tmp/d/a.txt") is False
    assert sbx.files.read("/tmp/d/sub/c.txt") == "a"
    sbx.files.remove("/tmp/d/sub/c.txt")
    assert sbx.files.exists("/tmp/d/sub/c.txt") is False
    sbx.files.remove("/tmp/d")
    assert sbx.files.exists("/tmp/d") is False
    with pytest.raises(FileNotFoundException):
        sbx.files.list("/tmp/d")


def test_files_get_info(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/info.txt", "12345")
    e = sbx.files.get_info("/home/user/info.txt")
    assert (e.name, e.path, e.type, e.size) == ("info.txt", "/home/user/info.txt", FileType.FILE, 5)
    assert (e.owner, e.group) == ("user", "user")
    assert e.permissions.startswith("-rw")
    assert abs(e.modified_time - datetime.now(timezone.utc)) < timedelta(minutes=2)
    d = sbx.files.get_info("/home/user")
    assert d.type == FileType.DIR and d.owner == "user"
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info("/home/user/missing")


def test_write_files(sbx: Sandbox) -> None:
    files = [{"path": f"/tmp/many/f{i}.txt", "data": f"content {i}"} for i in range(3)]
    files.append({"path": "/tmp/many/raw.bin", "data": b"\x00\x01\xff"})
    infos = sbx.files.write_files(files)
    assert [i.path for i in infos] == [f["path"] for f in files]
    for i in range(3):
        assert sbx.files.read(f"/tmp/many/f{i}.txt") == f"content {i}"
    assert bytes(sbx.files.read("/tmp/many/raw.bin", format="bytes")) == b"\x00\x01\xff"


def test_upload_10mb(sbx: Sandbox) -> None:
    data = os.urandom(10 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    sbx.files.write("/home/user/big.bin", data)
    assert sbx.files.get_info("/home/user/big.bin").size == len(data)
    assert sbx.commands.run("sha256sum /home/user/big.bin").stdout.split()[0] == digest
    assert hashlib.sha256(bytes(sbx.files.read("/home/user/big.bin", format="bytes"))).hexdigest() == digest
    # a file-like body goes up as one streamed octet-stream request
    sbx.files.write("/home/user/big2.bin", io.BytesIO(data))
    back = hashlib.sha256()
    for chunk in sbx.files.read("/home/user/big2.bin", format="stream"):
        back.update(chunk)
    assert back.hexdigest() == digest


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/w")
    handle = sbx.files.watch_dir("/home/user/w")
    try:
        sbx.files.write("/home/user/w/new.txt", "x")
        events = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            events += handle.get_new_events()
            if any(e.name == "new.txt" for e in events):
                break
            time.sleep(0.2)
        kinds = {e.type for e in events if e.name == "new.txt"}
        assert kinds & {FilesystemEventType.CREATE, FilesystemEventType.WRITE}, events
        # the events are handed out once
        sbx.commands.run("rm /home/user/w/new.txt")
        deadline = time.monotonic() + 10
        later: list = []
        while not any(e.type == FilesystemEventType.REMOVE for e in later) and time.monotonic() < deadline:
            later += handle.get_new_events()
            time.sleep(0.2)
        assert any(e.name == "new.txt" and e.type == FilesystemEventType.REMOVE for e in later), later
        assert not any(e.type == FilesystemEventType.CREATE for e in later), later
    finally:
        handle.stop()


@pytest.mark.asyncio
async def test_watch_dir_stream_async(e2b_env: Dict[str, str]) -> None:
    """The async SDK watches through the WatchDir server stream (start, then filesystem events)."""
    import asyncio

    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(api_key=e2b_env["E2B_API_KEY"], api_url=e2b_env["E2B_API_URL"])
    try:
        await sbx.files.make_dir("/home/user/aw")
        seen: List[object] = []
        handle = await sbx.files.watch_dir("/home/user/aw", on_event=seen.append, timeout=30)
        try:
            await sbx.files.write("/home/user/aw/a.txt", "x")
            for _ in range(100):
                if any(getattr(e, "name", "") == "a.txt" for e in seen):
                    break
                await asyncio.sleep(0.1)
            names = {(getattr(e, "name", ""), getattr(e, "type", None)) for e in seen}
            assert any(n == "a.txt" for n, _ in names), seen
        finally:
            await handle.stop()
    finally:
        await sbx.kill()


# -- code interpreter ----------------------------------------------------------------------------


def test_ci_state_between_runs(ci: CISandbox) -> None:
    assert ci.run_code("x = 41").error is None
    ex = ci.run_code("x + 1")
    assert ex.error is None
    assert ex.text == "42"
    # a code interpreter sandbox is an E2B sandbox too
    assert ci.commands.run("echo hi").stdout == "hi\n"


def test_ci_stdout_and_stderr(ci: CISandbox) -> None:
    seen: List[str] = []
    ex = ci.run_code(
        "import sys\nprint('hello')\nprint('warn', file=sys.stderr)",
        on_stdout=lambda m: seen.append(m.line),
    )
    assert ex.error is None
    assert "".join(ex.logs.stdout) == "hello\n"
    assert "".join(ex.logs.stderr) == "warn\n"
    assert "".join(seen) == "hello\n"


def test_ci_error(ci: CISandbox) -> None:
    ex = ci.run_code("1/0")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value
    assert "ZeroDivisionError" in ex.error.traceback
    # the kernel survives an error
    assert ci.run_code("2 + 2").text == "4"


def test_ci_contexts(ci: CISandbox) -> None:
    ctx = ci.create_code_context()
    assert ctx.id and ctx.language == "python"
    assert ci.run_code("only_here = 7", context=ctx).error is None
    assert ci.run_code("only_here * 6", context=ctx).text == "42"
    assert ci.run_code("'only_here' in globals()").text == "False"
    assert ctx.id in [c.id for c in ci.list_code_contexts()]
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]


# -- pause and resume ----------------------------------------------------------------------------


def test_pause_and_resume(sbx: Sandbox, opts) -> None:
    sbx.files.write("/home/user/keep.txt", "still here")
    # a process running at the pause runs on after the resume
    proc = sbx.commands.run("sleep 600", background=True, timeout=0)
    proc.disconnect()
    paused = sbx.pause()
    assert paused in (True, sbx.sandbox_id)
    assert Sandbox.get_info(sbx.sandbox_id, **opts).state == SandboxState.PAUSED
    ids = [s.sandbox_id for s in list_all(SandboxQuery(state=[SandboxState.PAUSED]), opts)]
    assert sbx.sandbox_id in ids
    resumed = Sandbox.connect(sbx.sandbox_id, **opts)
    assert resumed.sandbox_id == sbx.sandbox_id
    assert Sandbox.get_info(sbx.sandbox_id, **opts).state == SandboxState.RUNNING
    assert resumed.files.read("/home/user/keep.txt") == "still here"
    assert resumed.commands.run("cat /home/user/keep.txt").stdout == "still here"
    assert proc.pid in [p.pid for p in resumed.commands.list()]


# -- e2b 2.20 ------------------------------------------------------------------------------------

SDK20_CREATE = textwrap.dedent(
    """
    import json
    from e2b import Sandbox

    sbx = Sandbox.create(metadata={"suite": "e2b", "sdk": "2.20"}, timeout=300)
    print(json.dumps({"id": sbx.sandbox_id}), flush=True)
    r = sbx.commands.run("echo hi")
    sbx.commands.run("echo from-2.20 > /tmp/f")
    print(json.dumps({"stdout": r.stdout, "exit_code": r.exit_code}), flush=True)
    """
)

SDK20_CONNECT = textwrap.dedent(
    """
    import json, sys
    from e2b import Sandbox

    sbx = Sandbox.connect(sys.argv[1])
    cat = sbx.commands.run("cat /tmp/f").stdout
    sbx.files.write("/tmp/g", "written by 2.20")
    read = sbx.files.read("/tmp/g")
    print(json.dumps({"cat": cat, "read": read, "killed": sbx.kill()}), flush=True)
    """
)


def run_sdk20(script: str, *args: str) -> List[dict]:
    """Run `script` under e2b 2.20; its stdout is one JSON object a line."""
    assert E2B20_PYTHON.exists(), f"no {E2B20_PYTHON}: scripts/test-python.sh makes it"
    p = subprocess.run(
        [str(E2B20_PYTHON), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ},
    )
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0:
        # the lines it printed (the id) are still needed for the cleanup
        lines.append({"error": f"exit {p.returncode}: {p.stderr[-3000:]}"})
    return lines


def test_sdk_2_20_create_and_connect(e2b_env, opts) -> None:
    made: List[str] = []
    try:
        first = run_sdk20(SDK20_CREATE)
        made += [d["id"] for d in first if "id" in d]
        assert first == [{"id": made[0]}, {"stdout": "hi\n", "exit_code": 0}]
        # a fresh process connects by id: 2.20 then sends the access token and no sandbox id
        second = run_sdk20(SDK20_CONNECT, made[0])
        assert second == [{"cat": "from-2.20\n", "read": "written by 2.20", "killed": True}]
        assert Sandbox.kill(made[0], **opts) is False
    finally:
        _kill_all(made, opts)
