"""Sandboxes and what runs in them: :class:`Sandbox` (sync) and :class:`AsyncSandbox` (async)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import tarfile
import time
from typing import IO, Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Union

from . import _transport as t
from .client import AsyncClient, Client
from .errors import DsecError, SandboxNotFound
from .types import Command, ExecEvent, ExecResult, FileEntry, ProcessStatus, exec_body

__all__ = [
    "Sandbox",
    "Process",
    "Session",
    "Files",
    "AsyncSandbox",
    "AsyncProcess",
    "AsyncSession",
    "AsyncFiles",
    "FINAL_STATES",
]

#: states a sandbox never leaves
FINAL_STATES = frozenset({"stopped", "failed"})

TarSource = Union[bytes, bytearray, str, "os.PathLike[str]", IO[bytes]]


def _read_tar_source(src: TarSource) -> bytes:
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return f.read()
    return src.read()


def _tar_dir(local_dir: Union[str, "os.PathLike[str]"]) -> bytes:
    """Pack the contents of a local directory (not the directory itself) as a tar stream."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in sorted(os.listdir(local_dir)):
            tf.add(os.path.join(local_dir, name), arcname=name)
    return buf.getvalue()


def _untar_to(data: bytes, local_dir: Union[str, "os.PathLike[str]"]) -> None:
    """Unpack a tar stream from a sandbox into a local directory, refusing unsafe members."""
    os.makedirs(local_dir, exist_ok=True)
    root = os.path.realpath(local_dir)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
        members = []
        for m in tf.getmembers():
            target = os.path.realpath(os.path.join(root, m.name))
            if not (target == root or target.startswith(root + os.sep)):
                raise ValueError(f"tar member {m.name!r} escapes {local_dir!r}")
            if m.issym() or m.islnk() or m.isdev():
                continue  # links and devices from a sandbox are not recreated on the host
            members.append(m)
        tf.extractall(root, members=members)  # noqa: S202 - members checked above


def _step_of(resp: Any) -> Optional[int]:
    step = resp.headers.get("dsec-step")
    return int(step) if step and step.isdigit() else None


def _stdin_body(data: Union[str, bytes, None], eof: bool) -> Dict[str, Any]:
    body: Dict[str, Any] = {"eof": bool(eof)}
    if data is None:
        pass
    elif isinstance(data, str):
        body["data"] = data
    else:
        body["data_b64"] = base64.b64encode(bytes(data)).decode("ascii")
    return body


class _SandboxData:
    """Accessors over a sandbox record as the server answered it."""

    data: Dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data.get("state"))

    @property
    def version(self) -> int:
        return int(self.data.get("version") or 0)

    @property
    def template(self) -> Optional[str]:
        return self.data.get("template")

    @property
    def substrate(self) -> Optional[str]:
        return self.data.get("substrate")

    @property
    def tenant(self) -> Optional[str]:
        return self.data.get("tenant")

    @property
    def labels(self) -> Dict[str, str]:
        return dict(self.data.get("labels") or {})

    @property
    def limits(self) -> Dict[str, Any]:
        return dict(self.data.get("limits") or {})

    @property
    def userns(self) -> bool:
        """Whether the sandbox runs in a user namespace (root inside is an unprivileged host uid)."""
        return bool(self.data.get("userns"))

    @property
    def env_keys(self) -> List[str]:
        return list(self.data.get("env_keys") or [])

    @property
    def created_at(self) -> Optional[str]:
        return self.data.get("created_at")

    @property
    def acquired_at(self) -> Optional[str]:
        """When the tenant got the sandbox (a pooled one was created earlier); RFC 3339."""
        return self.data.get("acquired_at")

    @property
    def expires_at(self) -> Optional[str]:
        return self.data.get("expires_at")

    @property
    def lease_expires_at(self) -> Optional[str]:
        return self.data.get("lease_expires_at")

    @property
    def pooled(self) -> bool:
        return bool(self.data.get("pooled"))

    @property
    def phase(self) -> Optional[str]:
        """What a ``creating`` sandbox waits for: ``"preparing"`` while the node makes the VM
        snapshot it is restored from (the first VM of a template on a host), else ``None``."""
        return self.data.get("phase")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.data.get('id')!r}, state={self.data.get('state')!r})"


# ------------------------------------------------------------------------------------------------
# sync


class Sandbox(_SandboxData):
    """One sandbox on a node; a context manager that destroys the sandbox on exit.

    Make one with :meth:`create` or :meth:`connect`::

        with Sandbox.create(template="host") as sb:
            print(sb.exec(["/usr/bin/python3", "-c", "print(1+1)"]).text)
    """

    def __init__(self, client: Client, data: Mapping[str, Any], *, owns_client: bool = False) -> None:
        self.client = client
        self.data = dict(data)
        self._owns_client = owns_client
        self.files = Files(self)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        client: Optional[Client] = None,
        *,
        template: Optional[str] = None,
        limits: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl_ms: Optional[int] = None,
        lease_ms: Optional[int] = None,
        substrate: str = "container",
        writable_root: Optional[bool] = None,
        userns: Optional[bool] = None,
        secret_env: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        **extra: Any,
    ) -> "Sandbox":
        """Create a sandbox and return it running.

        Args:
            client: the client to use; a new one from ``DSEC_URL``/``DSEC_API_KEY`` when omitted
                (it is closed with the sandbox).
            template: template name (server default: ``host``).
            limits: partial limits (``memory_max``, ``pids_max``, ``cpu_max``, ...).
            env: environment of every exec.
            labels: free-form labels to find the sandbox by.
            ttl_ms: lifetime after which the node destroys the sandbox.
            lease_ms: owner lease; the sandbox is destroyed unless :meth:`heartbeat` renews it.
            substrate: isolation substrate: ``container`` (default), ``microvm`` or ``vm`` (a QEMU
                guest restored from its template's snapshot); every other call is the same.
            writable_root: make the whole root writable instead of only the scratch dirs.
            userns: run in a user namespace: root inside is an unprivileged host uid, and
                ``RLIMIT_NPROC`` refuses a fork bomb's forks before they cost the node anything
                (created cold: never from a warm pool).
            secret_env: environment whose values are redacted from the trajectory log.
            idempotency_key: makes the create safe to repeat (same key → same sandbox).
        """
        owns = client is None
        c = client if client is not None else Client()
        try:
            sb = c.create_sandbox(
                template=template,
                limits=limits,
                env=env,
                labels=labels,
                ttl_ms=ttl_ms,
                lease_ms=lease_ms,
                substrate=substrate,
                writable_root=writable_root,
                userns=userns,
                idempotency_key=idempotency_key,
                secret_env=dict(secret_env) if secret_env is not None else None,
                **extra,
            )
        except BaseException:
            if owns:
                c.close()
            raise
        sb._owns_client = owns
        return sb

    @classmethod
    def connect(cls, sandbox_id: str, client: Optional[Client] = None) -> "Sandbox":
        """Attach to an existing sandbox (``SandboxNotFound`` when this tenant has none)."""
        owns = client is None
        c = client if client is not None else Client()
        try:
            sb = c.get_sandbox(sandbox_id)
        except BaseException:
            if owns:
                c.close()
            raise
        sb._owns_client = owns
        return sb

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.destroy()
        except SandboxNotFound:
            pass
        finally:
            if self._owns_client:
                self.client.close()

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.id}{suffix}"

    # -- lifecycle -----------------------------------------------------------------------------

    def refresh(self) -> "Sandbox":
        """Re-read the sandbox record."""
        self.data = self.client.request_json("GET", self._path())
        return self

    def wait(self, state: str, timeout_ms: int = 30_000) -> "Sandbox":
        """Long-poll until the sandbox is in ``state`` (or in a final state) or the time is up.

        Returns the sandbox as it then is; check :attr:`state`. Waits longer than the server's
        long-poll bound (120 s) are made of several polls.
        """
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            poll = min(left, t.MAX_LONG_POLL_MS)
            self.data = self.client.request_json(
                "GET",
                self._path(),
                params={"wait": state, "timeout": poll},
                timeout=t.deadline_timeout(self.client.timeout, poll, 0),
            )
            if self.state == state or self.state in FINAL_STATES or left == 0:
                return self
            time.sleep(0.05)  # the server answered early: don't spin

    def wait_for_change(self, after_version: Optional[int] = None, timeout_ms: int = 30_000) -> "Sandbox":
        """Long-poll until the version exceeds ``after_version`` (default: the current one).

        Returns the sandbox as it then is, changed or not when the time ran out.
        """
        v = self.version if after_version is None else after_version
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            poll = min(max(0, int((deadline - time.monotonic()) * 1000)), t.MAX_LONG_POLL_MS)
            self.data = self.client.request_json(
                "GET",
                self._path(),
                params={"after_version": v, "timeout": poll},
                timeout=t.deadline_timeout(self.client.timeout, poll, 0),
            )
            if self.version > v or self.state in FINAL_STATES or time.monotonic() >= deadline:
                return self
            time.sleep(0.05)  # the server answered early: don't spin

    def heartbeat(self, lease_ms: Optional[int] = None) -> "Sandbox":
        """Renew the owner lease."""
        self.data = self.client.request_json("POST", self._path("/lease"), json=t.clean({"lease_ms": lease_ms}))
        return self

    def reset(self) -> "Sandbox":
        """Kill every process and give the sandbox a fresh writable layer."""
        self.data = self.client.request_json("POST", self._path("/reset"), json={}, timeout=max(self.client.timeout, 60.0))
        return self

    def destroy(self) -> "Sandbox":
        """Destroy the sandbox (state ``stopped``)."""
        self.data = self.client.delete_sandbox(self.id) or {**self.data, "state": "stopped"}
        return self

    # -- exec ----------------------------------------------------------------------------------

    def exec(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> ExecResult:
        """Run a command to completion.

        ``cmd`` is an argv list or a shell string (run by ``/bin/sh -c``). A timeout is a result
        with ``status == "timeout"``, not an exception.

        With ``trajectory`` (and optionally ``step``; default: the next one) the exec is a logged
        step of that trajectory: re-sending a step the node has a result for answers it from the
        log without running (``result.replayed``); one it has only an intent for raises
        :class:`UnknownOutcome`.
        """
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms,
            output_limit=output_limit, trajectory=trajectory, step=step,
        )
        resp = self.client.request(
            "POST",
            self._path("/exec"),
            json=body,
            timeout=t.deadline_timeout(self.client.timeout, timeout_ms, self.client.exec_timeout),
        )
        return ExecResult.from_response(resp)

    def exec_stream(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
    ) -> Iterator[ExecEvent]:
        """Run a command and yield its output as it comes.

        Yields :class:`ExecEvent` s: ``stdout``/``stderr`` chunks, then one ``exit`` (with the
        result; its captures are empty) or one ``error`` (with the typed error).
        """
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms, output_limit=output_limit
        )
        with self.client.stream(
            "POST",
            self._path("/exec"),
            params={"stream": "true"},
            json=body,
            headers={"Accept": "text/event-stream"},
            timeout=t.deadline_timeout(self.client.timeout, timeout_ms, self.client.exec_timeout),
        ) as resp:
            for ev in self.client.iter_sse(resp):
                out = t.exec_event_from_sse(ev.event, ev.data)
                yield out
                if out.type in ("exit", "error"):
                    return

    def spawn(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
    ) -> "Process":
        """Start a command in the background; returns a :class:`Process` handle."""
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms, output_limit=output_limit
        )
        data = self.client.request_json("POST", self._path("/processes"), json=body)
        return Process(self, data)

    def session(
        self, kind: str = "shell", *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None
    ) -> "Session":
        """Open a persistent ``shell`` or ``python`` session whose state survives across inputs."""
        data = self.client.request_json(
            "POST", self._path("/sessions"), json=t.clean({"kind": kind, "env": dict(env) if env else None, "cwd": cwd})
        )
        return Session(self, data)


class Process:
    """A background process started by :meth:`Sandbox.spawn`."""

    def __init__(self, sandbox: Sandbox, data: Mapping[str, Any]) -> None:
        self.sandbox = sandbox
        self.handle: int = int(data["handle"])
        self.pid: Optional[int] = data.get("pid")
        self.result: Optional[ExecResult] = None

    def __repr__(self) -> str:
        return f"Process(handle={self.handle}, pid={self.pid})"

    def _path(self, suffix: str = "") -> str:
        return self.sandbox._path(f"/processes/{self.handle}{suffix}")

    def status(self) -> ProcessStatus:
        """Whether the process is still running."""
        return ProcessStatus.from_json(self.sandbox.client.request_json("GET", self._path()))

    def write_stdin(self, data: Union[str, bytes, None] = None, *, eof: bool = False) -> None:
        """Write to the process's stdin; ``eof=True`` closes it afterwards."""
        self.sandbox.client.request("POST", self._path("/stdin"), json=_stdin_body(data, eof))

    def close_stdin(self) -> None:
        self.write_stdin(None, eof=True)

    def signal(self, signal: int = 15) -> None:
        """Send a signal (default SIGTERM)."""
        self.sandbox.client.request("POST", self._path("/signal"), json={"signal": int(signal)})

    def kill(self) -> None:
        self.signal(9)

    def wait(self, timeout_ms: int = 30_000) -> Optional[ExecResult]:
        """Wait up to ``timeout_ms`` for the process to end; its result, or ``None`` if still running."""
        data = self.sandbox.client.request_json(
            "POST",
            self._path("/wait"),
            json={"timeout_ms": int(timeout_ms)},
            timeout=t.deadline_timeout(self.sandbox.client.timeout, timeout_ms, 0),
        )
        if data is None or ("status" not in data and data.get("running")):
            return None
        self.result = ExecResult.from_json(data)
        return self.result


class Session:
    """A persistent shell or Python interpreter inside a sandbox."""

    def __init__(self, sandbox: Sandbox, data: Mapping[str, Any]) -> None:
        self.sandbox = sandbox
        self.id: int = int(data["session"])

    def __repr__(self) -> str:
        return f"Session(id={self.id})"

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except DsecError:
            pass

    def _path(self, suffix: str = "") -> str:
        return self.sandbox._path(f"/sessions/{self.id}{suffix}")

    def run(
        self,
        input: str,
        *,
        timeout_ms: Optional[int] = None,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> ExecResult:
        """Feed one input (shell command line or Python code) and return its output.

        ``trajectory``/``step`` log it as a trajectory step, as :meth:`Sandbox.exec` does.
        """
        resp = self.sandbox.client.request(
            "POST",
            self._path("/run"),
            json=t.clean({"input": input, "timeout_ms": timeout_ms, "trajectory": trajectory, "step": step}),
            timeout=t.deadline_timeout(self.sandbox.client.timeout, timeout_ms, self.sandbox.client.exec_timeout),
        )
        return ExecResult.from_response(resp)

    def close(self) -> None:
        self.sandbox.client.request("DELETE", self._path())


class Files:
    """File operations inside a sandbox; every path is resolved inside the sandbox root."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    @property
    def _c(self) -> Client:
        return self.sandbox.client

    def read(self, path: str, *, max_bytes: Optional[int] = None) -> bytes:
        return self._c.request("GET", self.sandbox._path("/files"), params=t.clean({"path": path, "max_bytes": max_bytes})).content

    def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def write(
        self,
        path: str,
        data: Union[str, bytes],
        *,
        mode: Optional[int] = None,
        parents: bool = True,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> Optional[int]:
        """Write a whole file (``mode`` as an int, e.g. ``0o644``; missing parents are made).

        With ``trajectory`` the write is a logged step; its step number is returned.
        """
        content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        params = t.clean(
            {"path": path, "mode": mode, "parents": "true" if parents else "false", "trajectory": trajectory, "step": step}
        )
        resp = self._c.request(
            "PUT",
            self.sandbox._path("/files"),
            params=params,
            content=content,
            headers={"Content-Type": "application/octet-stream"},
            timeout=max(self._c.timeout, 120.0),
        )
        return _step_of(resp)

    def list(self, path: str = "/") -> List[FileEntry]:
        body = self._c.request_json("GET", self.sandbox._path("/files/list"), params={"path": path})
        return [FileEntry.from_json(e) for e in body.get("entries") or []]

    def stat(self, path: str) -> FileEntry:
        return FileEntry.from_json(self._c.request_json("GET", self.sandbox._path("/files/stat"), params={"path": path}))

    def exists(self, path: str) -> bool:
        from .errors import NotFound

        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._c.request(
            "DELETE", self.sandbox._path("/files"), params={"path": path, "recursive": "true" if recursive else "false"}
        )

    def mkdir(self, path: str, *, parents: bool = False, mode: Optional[int] = None) -> None:
        self._c.request(
            "POST", self.sandbox._path("/files/mkdir"), json=t.clean({"path": path, "parents": parents, "mode": mode})
        )

    def upload_tar(self, path: str, tar: TarSource) -> None:
        """Unpack a tar stream (bytes, a file path or a binary file object) into directory ``path``."""
        self._c.request(
            "PUT",
            self.sandbox._path("/tar"),
            params={"path": path},
            content=_read_tar_source(tar),
            headers={"Content-Type": "application/x-tar"},
            timeout=max(self._c.timeout, 300.0),
        )

    def download_tar(self, path: str) -> bytes:
        """Pack directory ``path`` as a tar stream."""
        return self._c.request(
            "GET", self.sandbox._path("/tar"), params={"path": path}, timeout=max(self._c.timeout, 300.0)
        ).content

    def upload_dir(self, local_dir: Union[str, "os.PathLike[str]"], path: str) -> None:
        """Copy the contents of a local directory into directory ``path`` of the sandbox."""
        self.upload_tar(path, _tar_dir(local_dir))

    def download_dir(self, path: str, local_dir: Union[str, "os.PathLike[str]"]) -> None:
        """Copy directory ``path`` of the sandbox into a local directory (links are skipped)."""
        _untar_to(self.download_tar(path), local_dir)


# ------------------------------------------------------------------------------------------------
# async


class AsyncSandbox(_SandboxData):
    """Async twin of :class:`Sandbox`; ``async with`` destroys it on exit::

        async with await AsyncSandbox.create(client) as sb:
            r = await sb.exec("echo hi")
    """

    def __init__(self, client: AsyncClient, data: Mapping[str, Any], *, owns_client: bool = False) -> None:
        self.client = client
        self.data = dict(data)
        self._owns_client = owns_client
        self.files = AsyncFiles(self)

    @classmethod
    async def create(
        cls,
        client: Optional[AsyncClient] = None,
        *,
        template: Optional[str] = None,
        limits: Optional[Mapping[str, Any]] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl_ms: Optional[int] = None,
        lease_ms: Optional[int] = None,
        substrate: str = "container",
        writable_root: Optional[bool] = None,
        userns: Optional[bool] = None,
        secret_env: Optional[Mapping[str, str]] = None,
        idempotency_key: Optional[str] = None,
        **extra: Any,
    ) -> "AsyncSandbox":
        """Create a sandbox; see :meth:`Sandbox.create`."""
        owns = client is None
        c = client if client is not None else AsyncClient()
        try:
            sb = await c.create_sandbox(
                template=template,
                limits=limits,
                env=env,
                labels=labels,
                ttl_ms=ttl_ms,
                lease_ms=lease_ms,
                substrate=substrate,
                writable_root=writable_root,
                userns=userns,
                idempotency_key=idempotency_key,
                secret_env=dict(secret_env) if secret_env is not None else None,
                **extra,
            )
        except BaseException:
            if owns:
                await c.aclose()
            raise
        sb._owns_client = owns
        return sb

    @classmethod
    async def connect(cls, sandbox_id: str, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        owns = client is None
        c = client if client is not None else AsyncClient()
        try:
            sb = await c.get_sandbox(sandbox_id)
        except BaseException:
            if owns:
                await c.aclose()
            raise
        sb._owns_client = owns
        return sb

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.destroy()
        except SandboxNotFound:
            pass
        finally:
            if self._owns_client:
                await self.client.aclose()

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.id}{suffix}"

    async def refresh(self) -> "AsyncSandbox":
        self.data = await self.client.request_json("GET", self._path())
        return self

    async def wait(self, state: str, timeout_ms: int = 30_000) -> "AsyncSandbox":
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            poll = min(left, t.MAX_LONG_POLL_MS)
            self.data = await self.client.request_json(
                "GET",
                self._path(),
                params={"wait": state, "timeout": poll},
                timeout=t.deadline_timeout(self.client.timeout, poll, 0),
            )
            if self.state == state or self.state in FINAL_STATES or left == 0:
                return self
            await asyncio.sleep(0.05)  # the server answered early: don't spin

    async def wait_for_change(self, after_version: Optional[int] = None, timeout_ms: int = 30_000) -> "AsyncSandbox":
        v = self.version if after_version is None else after_version
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            poll = min(max(0, int((deadline - time.monotonic()) * 1000)), t.MAX_LONG_POLL_MS)
            self.data = await self.client.request_json(
                "GET",
                self._path(),
                params={"after_version": v, "timeout": poll},
                timeout=t.deadline_timeout(self.client.timeout, poll, 0),
            )
            if self.version > v or self.state in FINAL_STATES or time.monotonic() >= deadline:
                return self
            await asyncio.sleep(0.05)

    async def heartbeat(self, lease_ms: Optional[int] = None) -> "AsyncSandbox":
        self.data = await self.client.request_json("POST", self._path("/lease"), json=t.clean({"lease_ms": lease_ms}))
        return self

    async def reset(self) -> "AsyncSandbox":
        self.data = await self.client.request_json(
            "POST", self._path("/reset"), json={}, timeout=max(self.client.timeout, 60.0)
        )
        return self

    async def destroy(self) -> "AsyncSandbox":
        self.data = (await self.client.delete_sandbox(self.id)) or {**self.data, "state": "stopped"}
        return self

    async def exec(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> ExecResult:
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms,
            output_limit=output_limit, trajectory=trajectory, step=step,
        )
        resp = await self.client.request(
            "POST",
            self._path("/exec"),
            json=body,
            timeout=t.deadline_timeout(self.client.timeout, timeout_ms, self.client.exec_timeout),
        )
        return ExecResult.from_response(resp)

    async def exec_stream(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
    ) -> AsyncIterator[ExecEvent]:
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms, output_limit=output_limit
        )
        async with self.client.stream(
            "POST",
            self._path("/exec"),
            params={"stream": "true"},
            json=body,
            headers={"Accept": "text/event-stream"},
            timeout=t.deadline_timeout(self.client.timeout, timeout_ms, self.client.exec_timeout),
        ) as resp:
            async for ev in self.client.iter_sse(resp):
                out = t.exec_event_from_sse(ev.event, ev.data)
                yield out
                if out.type in ("exit", "error"):
                    return

    async def spawn(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        stdin: Union[str, bytes, None] = None,
        cpu_limit_ms: Optional[int] = None,
        output_limit: Optional[int] = None,
    ) -> "AsyncProcess":
        body = exec_body(
            cmd, env=env, cwd=cwd, timeout_ms=timeout_ms, stdin=stdin, cpu_limit_ms=cpu_limit_ms, output_limit=output_limit
        )
        return AsyncProcess(self, await self.client.request_json("POST", self._path("/processes"), json=body))

    async def session(
        self, kind: str = "shell", *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None
    ) -> "AsyncSession":
        data = await self.client.request_json(
            "POST", self._path("/sessions"), json=t.clean({"kind": kind, "env": dict(env) if env else None, "cwd": cwd})
        )
        return AsyncSession(self, data)


class AsyncProcess:
    """Async twin of :class:`Process`."""

    def __init__(self, sandbox: AsyncSandbox, data: Mapping[str, Any]) -> None:
        self.sandbox = sandbox
        self.handle: int = int(data["handle"])
        self.pid: Optional[int] = data.get("pid")
        self.result: Optional[ExecResult] = None

    def __repr__(self) -> str:
        return f"AsyncProcess(handle={self.handle}, pid={self.pid})"

    def _path(self, suffix: str = "") -> str:
        return self.sandbox._path(f"/processes/{self.handle}{suffix}")

    async def status(self) -> ProcessStatus:
        return ProcessStatus.from_json(await self.sandbox.client.request_json("GET", self._path()))

    async def write_stdin(self, data: Union[str, bytes, None] = None, *, eof: bool = False) -> None:
        await self.sandbox.client.request("POST", self._path("/stdin"), json=_stdin_body(data, eof))

    async def close_stdin(self) -> None:
        await self.write_stdin(None, eof=True)

    async def signal(self, signal: int = 15) -> None:
        await self.sandbox.client.request("POST", self._path("/signal"), json={"signal": int(signal)})

    async def kill(self) -> None:
        await self.signal(9)

    async def wait(self, timeout_ms: int = 30_000) -> Optional[ExecResult]:
        data = await self.sandbox.client.request_json(
            "POST",
            self._path("/wait"),
            json={"timeout_ms": int(timeout_ms)},
            timeout=t.deadline_timeout(self.sandbox.client.timeout, timeout_ms, 0),
        )
        if data is None or ("status" not in data and data.get("running")):
            return None
        self.result = ExecResult.from_json(data)
        return self.result


class AsyncSession:
    """Async twin of :class:`Session`."""

    def __init__(self, sandbox: AsyncSandbox, data: Mapping[str, Any]) -> None:
        self.sandbox = sandbox
        self.id: int = int(data["session"])

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id})"

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.close()
        except DsecError:
            pass

    def _path(self, suffix: str = "") -> str:
        return self.sandbox._path(f"/sessions/{self.id}{suffix}")

    async def run(
        self,
        input: str,
        *,
        timeout_ms: Optional[int] = None,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> ExecResult:
        resp = await self.sandbox.client.request(
            "POST",
            self._path("/run"),
            json=t.clean({"input": input, "timeout_ms": timeout_ms, "trajectory": trajectory, "step": step}),
            timeout=t.deadline_timeout(self.sandbox.client.timeout, timeout_ms, self.sandbox.client.exec_timeout),
        )
        return ExecResult.from_response(resp)

    async def close(self) -> None:
        await self.sandbox.client.request("DELETE", self._path())


class AsyncFiles:
    """Async twin of :class:`Files`."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    @property
    def _c(self) -> AsyncClient:
        return self.sandbox.client

    async def read(self, path: str, *, max_bytes: Optional[int] = None) -> bytes:
        resp = await self._c.request(
            "GET", self.sandbox._path("/files"), params=t.clean({"path": path, "max_bytes": max_bytes})
        )
        return resp.content

    async def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(
        self,
        path: str,
        data: Union[str, bytes],
        *,
        mode: Optional[int] = None,
        parents: bool = True,
        trajectory: Optional[str] = None,
        step: Optional[int] = None,
    ) -> Optional[int]:
        content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        params = t.clean(
            {"path": path, "mode": mode, "parents": "true" if parents else "false", "trajectory": trajectory, "step": step}
        )
        resp = await self._c.request(
            "PUT",
            self.sandbox._path("/files"),
            params=params,
            content=content,
            headers={"Content-Type": "application/octet-stream"},
            timeout=max(self._c.timeout, 120.0),
        )
        return _step_of(resp)

    async def list(self, path: str = "/") -> List[FileEntry]:
        body = await self._c.request_json("GET", self.sandbox._path("/files/list"), params={"path": path})
        return [FileEntry.from_json(e) for e in body.get("entries") or []]

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.from_json(
            await self._c.request_json("GET", self.sandbox._path("/files/stat"), params={"path": path})
        )

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._c.request(
            "DELETE", self.sandbox._path("/files"), params={"path": path, "recursive": "true" if recursive else "false"}
        )

    async def mkdir(self, path: str, *, parents: bool = False, mode: Optional[int] = None) -> None:
        await self._c.request(
            "POST", self.sandbox._path("/files/mkdir"), json=t.clean({"path": path, "parents": parents, "mode": mode})
        )

    async def upload_tar(self, path: str, tar: TarSource) -> None:
        await self._c.request(
            "PUT",
            self.sandbox._path("/tar"),
            params={"path": path},
            content=_read_tar_source(tar),
            headers={"Content-Type": "application/x-tar"},
            timeout=max(self._c.timeout, 300.0),
        )

    async def download_tar(self, path: str) -> bytes:
        resp = await self._c.request(
            "GET", self.sandbox._path("/tar"), params={"path": path}, timeout=max(self._c.timeout, 300.0)
        )
        return resp.content

    async def upload_dir(self, local_dir: Union[str, "os.PathLike[str]"], path: str) -> None:
        await self.upload_tar(path, _tar_dir(local_dir))

    async def download_dir(self, path: str, local_dir: Union[str, "os.PathLike[str]"]) -> None:
        _untar_to(await self.download_tar(path), local_dir)

