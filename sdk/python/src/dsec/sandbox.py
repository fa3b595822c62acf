"""Sandboxes and what runs in them: :class:`Sandbox` (sync) and :class:`AsyncSandbox` (async)."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import tarfile
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from typing import IO, Any, Callable, Generic, Optional, TypeVar, Union, cast, overload

from typing_extensions import Self, Unpack

from . import _api as api
from . import types as ty
from .client import AsyncClient, Client
from .errors import DsecError, NotFound, SandboxNotFound
from .types import FINAL_STATES  # re-exported: dsec.sandbox.FINAL_STATES

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

TarSource = Union[bytes, bytearray, str, "os.PathLike[str]", IO[bytes]]


def _read_tar_source(src: TarSource) -> bytes:
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return f.read()
    return src.read()


def _tar_dir(local_dir: str | os.PathLike[str]) -> bytes:
    """Pack the contents of a local directory (not the directory itself) as a tar stream."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in sorted(os.listdir(local_dir)):
            tf.add(os.path.join(local_dir, name), arcname=name)
    return buf.getvalue()


def _untar_to(data: bytes, local_dir: str | os.PathLike[str]) -> None:
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


V = TypeVar("V")


class _Field(Generic[V]):
    """A field of the sandbox record as a read-only attribute (``None`` when absent)."""

    def __init__(self, doc: str | None = None) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Field[V]: ...

    @overload
    def __get__(self, obj: _SandboxData, owner: type) -> V | None: ...

    def __get__(self, obj: _SandboxData | None, owner: type) -> _Field[V] | V | None:
        if obj is None:
            return self
        return cast(Optional[V], obj.data.get(self.name))

    def __set__(self, obj: _SandboxData, value: object) -> None:
        raise AttributeError(f"can't set attribute {self.name!r}")


class _SandboxData:
    """Accessors over a sandbox record as the server answered it."""

    def __init__(self, data: Mapping[str, Any], owns_client: bool) -> None:
        self.data = dict(data)
        self._owns_client = owns_client

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> ty.SandboxState:
        return cast(ty.SandboxState, str(self.data.get("state")))

    @property
    def version(self) -> int:
        return int(self.data.get("version") or 0)

    template = _Field[str]()
    substrate = _Field[ty.Substrate]()

    tenant = _Field[str]()

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.data.get("labels") or {})

    @property
    def limits(self) -> dict[str, Any]:
        return dict(self.data.get("limits") or {})

    @property
    def userns(self) -> bool:
        """Whether the sandbox runs in a user namespace (root inside is an unprivileged host uid)."""
        return bool(self.data.get("userns"))

    @property
    def network(self) -> dict[str, Any]:
        """Its network policy (``{"egress": "none"}`` when it has none)."""
        return dict(self.data.get("network") or {"egress": "none"})

    network_address = _Field[str]("Its address on the node's egress subnet, while it has a path out.")

    @property
    def env_keys(self) -> list[str]:
        return list(self.data.get("env_keys") or [])

    created_at = _Field[str]()
    acquired_at = _Field[str]("When the tenant got the sandbox (a pooled one was created earlier); RFC 3339.")
    expires_at = _Field[str]()
    lease_expires_at = _Field[str]()

    @property
    def pooled(self) -> bool:
        return bool(self.data.get("pooled"))

    phase = _Field[str](
        'What a ``creating`` sandbox waits for: ``"preparing"`` while the node makes the VM snapshot it is'
        ' restored from (the first VM of a template on a host), ``"fetching"`` while a node of a cluster'
        " fetches a template it does not hold, else ``None``."
    )
    fetched = _Field[dict[str, Any]](
        "In a cluster, what the node fetched to make the sandbox: ``{layers, bytes, from, ms}`` (``from``:"
        ' ``"node:<name>"`` or ``"origin"``); ``None`` when it held the template.'
    )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.data.get('id')!r}, state={self.data.get('state')!r})"

    def _path(self, suffix: str = "") -> str:
        return api.sandbox_path(self.id, suffix)

    def _set(self, data: dict[str, Any]) -> Self:
        self.data = dict(data)
        return self

    def _destroyed(self, data: dict[str, Any] | None) -> Self:
        return self._set(data or {**self.data, "state": "stopped"})

    def _since(self, after_version: int | None) -> int:
        return self.version if after_version is None else after_version


class _ProcessData:
    """A background process's handle and pid, and its result once it ended."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.handle: int = int(data["handle"])
        self.pid: int | None = data.get("pid")
        self.result: ty.ExecResult | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(handle={self.handle}, pid={self.pid})"

    def _ended(self, result: ty.ExecResult | None) -> ty.ExecResult | None:
        if result is not None:
            self.result = result
        return result


class _SessionData:
    """A session's id."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.id: int = int(data["session"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id})"


# ------------------------------------------------------------------------------------------------
# sync


class Sandbox(_SandboxData):
    """One sandbox on a node; a context manager that destroys the sandbox on exit.

    Make one with :meth:`create` or :meth:`connect`::

        with Sandbox.create(template="host") as sb:
            print(sb.exec(["/usr/bin/python3", "-c", "print(1+1)"]).text)
    """

    def __init__(self, client: Client, data: Mapping[str, Any], *, owns_client: bool = False) -> None:
        super().__init__(data, owns_client)
        self.client = client
        self.files = Files(self)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls, client: Client | None = None, *, idempotency_key: str | None = None, **spec: Unpack[ty.CreateOptions]
    ) -> Sandbox:
        """Create a sandbox and return it running.

        Args:
            client: the client to use; a new one from ``DSEC_URL``/``DSEC_API_KEY`` when omitted
                (it is closed with the sandbox).
            idempotency_key: makes the create safe to repeat (same key → same sandbox).
            spec: what to create from (:class:`dsec.CreateOptions`): ``template``,
                ``substrate`` (``container``, the default, ``microvm`` or ``vm``), ``limits``,
                ``env``, ``secret_env``, ``labels``, ``ttl_ms``, ``lease_ms``,
                ``writable_root``, ``userns``.
        """
        return _owning(client, lambda c: c.create_sandbox(idempotency_key=idempotency_key, **spec))

    @classmethod
    def connect(cls, sandbox_id: str, client: Client | None = None) -> Sandbox:
        """Attach to an existing sandbox (``SandboxNotFound`` when this tenant has none)."""
        return _owning(client, lambda c: c.get_sandbox(sandbox_id))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with contextlib.suppress(SandboxNotFound):
                self.destroy()
        finally:
            if self._owns_client:
                self.client.close()

    # -- lifecycle -----------------------------------------------------------------------------

    def refresh(self) -> Sandbox:
        """Re-read the sandbox record."""
        return self._set(self.client._send(api.refresh(self.id)))

    def wait(self, state: ty.SandboxState, timeout_ms: int = 30_000) -> Sandbox:
        """Long-poll until the sandbox is in ``state`` (or in a final state) or the time is up.

        Returns the sandbox as it then is; check :attr:`state`. Waits longer than the server's
        long-poll bound (120 s) are made of several polls.
        """
        return self._set(self.client._run(api.wait(self.id, state, timeout_ms)))

    def wait_for_change(self, after_version: int | None = None, timeout_ms: int = 30_000) -> Sandbox:
        """Long-poll until the version exceeds ``after_version`` (default: the current one).

        Returns the sandbox as it then is, changed or not when the time ran out.
        """
        return self._set(self.client._run(api.wait_for_change(self.id, self._since(after_version), timeout_ms)))

    def heartbeat(self, lease_ms: int | None = None) -> Sandbox:
        """Renew the owner lease."""
        return self._set(self.client._send(api.heartbeat(self.id, lease_ms)))

    def reset(self) -> Sandbox:
        """Kill every process and give the sandbox a fresh writable layer."""
        return self._set(self.client._send(api.reset(self.id)))

    def set_network(self, network: Mapping[str, Any]) -> Sandbox:
        """Replace its network policy (``{"egress": ...}``) while it runs: e.g. open it for a
        ``pip install``, then ``{"egress": "none"}`` for the episode."""
        return self._set(self.client._send(api.set_network(self.id, network)))

    def snapshot(
        self, *, labels: Mapping[str, str] | None = None, trajectory: str | None = None, step: int | None = None
    ) -> ty.Snapshot:
        """Snapshot the sandbox's files (a logged step of ``trajectory`` when given); it goes on
        as it was."""
        return self.client._send(api.take_snapshot(self.id, labels, trajectory, step))

    def fork(
        self,
        count: int = 1,
        *,
        labels: Mapping[str, str] | None = None,
        trajectory: str | None = None,
        step: int | None = None,
    ) -> ty.ForkResult[Sandbox]:
        """Snapshot the sandbox and make ``count`` sandboxes from it, alike to this one."""
        return self.client._send(api.fork(self.client._sandbox, self.id, count, labels, trajectory, step))

    def restore(
        self, snapshot: str | ty.Snapshot, *, trajectory: str | None = None, step: int | None = None
    ) -> Sandbox:
        """Roll the sandbox back to a snapshot: every process killed, its files the snapshot's;
        a later ``reset`` comes back to it."""
        sid = snapshot.id if isinstance(snapshot, ty.Snapshot) else snapshot
        return self._set(self.client._send(api.restore(self.id, sid, trajectory, step)))

    def destroy(self) -> Sandbox:
        """Destroy the sandbox (state ``stopped``)."""
        return self._destroyed(self.client.delete_sandbox(self.id))

    # -- exec ----------------------------------------------------------------------------------

    def exec(
        self,
        cmd: ty.Command,
        *,
        trajectory: str | None = None,
        step: int | None = None,
        **options: Unpack[ty.ExecOptions],
    ) -> ty.ExecResult:
        """Run a command to completion.

        ``cmd`` is an argv list or a shell string (run by ``/bin/sh -c``); ``options`` are
        :class:`dsec.ExecOptions` (``env``, ``cwd``, ``timeout_ms``, ``stdin``,
        ``cpu_limit_ms``, ``output_limit``). A timeout is a result with ``status ==
        "timeout"``, not an exception.

        With ``trajectory`` (and optionally ``step``; default: the next one) the exec is a logged
        step of that trajectory: re-sending a step the node has a result for answers it from the
        log without running (``result.replayed``); one it has only an intent for raises
        :class:`UnknownOutcome`.
        """
        call = api.exec(self.id, cmd, self.client.exec_timeout, trajectory=trajectory, step=step, **options)
        return self.client._send(call)

    def exec_stream(self, cmd: ty.Command, **options: Unpack[ty.ExecOptions]) -> Iterator[ty.ExecEvent]:
        """Run a command and yield its output as it comes.

        Yields :class:`ExecEvent` s: ``stdout``/``stderr`` chunks, then one ``exit`` (with the
        result; its captures are empty) or one ``error`` (with the typed error).
        """
        yield from self.client._events(api.exec_stream(self.id, cmd, self.client.exec_timeout, **options))

    def spawn(self, cmd: ty.Command, **options: Unpack[ty.ExecOptions]) -> Process:
        """Start a command in the background; returns a :class:`Process` handle."""
        return Process(self, self.client._send(api.spawn(self.id, cmd, **options)))

    def session(
        self, kind: ty.SessionKind = "shell", *, env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> Session:
        """Open a persistent ``shell`` or ``python`` session whose state survives across inputs."""
        return Session(self, self.client._send(api.open_session(self.id, kind, env, cwd)))


class Process(_ProcessData):
    """A background process started by :meth:`Sandbox.spawn`."""

    def __init__(self, sandbox: Sandbox, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.sandbox = sandbox

    def status(self) -> ty.ProcessStatus:
        """Whether the process is still running."""
        return self.sandbox.client._send(api.process_status(self.sandbox.id, self.handle))

    def write_stdin(self, data: str | bytes | None = None, *, eof: bool = False) -> None:
        """Write to the process's stdin; ``eof=True`` closes it afterwards."""
        self.sandbox.client._send(api.write_stdin(self.sandbox.id, self.handle, data, eof))

    def close_stdin(self) -> None:
        self.write_stdin(None, eof=True)

    def signal(self, signal: int = 15) -> None:
        """Send a signal (default SIGTERM)."""
        self.sandbox.client._send(api.signal(self.sandbox.id, self.handle, signal))

    def kill(self) -> None:
        self.signal(9)

    def wait(self, timeout_ms: int = 30_000) -> ty.ExecResult | None:
        """Wait up to ``timeout_ms`` for the process to end; its result, or ``None`` if still running."""
        return self._ended(self.sandbox.client._send(api.wait_process(self.sandbox.id, self.handle, timeout_ms)))


class Session(_SessionData):
    """A persistent shell or Python interpreter inside a sandbox."""

    def __init__(self, sandbox: Sandbox, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.sandbox = sandbox

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(DsecError):
            self.close()

    def run(
        self, input: str, *, timeout_ms: int | None = None, trajectory: str | None = None, step: int | None = None
    ) -> ty.ExecResult:
        """Feed one input (shell command line or Python code) and return its output.

        ``trajectory``/``step`` log it as a trajectory step, as :meth:`Sandbox.exec` does.
        """
        c = self.sandbox.client
        return c._send(api.session_run(self.sandbox.id, self.id, input, c.exec_timeout, timeout_ms, trajectory, step))

    def close(self) -> None:
        self.sandbox.client._send(api.close_session(self.sandbox.id, self.id))


SB = TypeVar("SB", "Sandbox", "AsyncSandbox")


class _FilesOf(Generic[SB]):
    """The files of one sandbox."""

    def __init__(self, sandbox: SB) -> None:
        self.sandbox: SB = sandbox


class Files(_FilesOf["Sandbox"]):
    """File operations inside a sandbox; every path is resolved inside the sandbox root."""

    @property
    def _c(self) -> Client:
        return self.sandbox.client

    def read(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return self._c._send(api.read_file(self.sandbox.id, path, max_bytes))

    def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def write(self, path: str, data: str | bytes, **options: Unpack[ty.WriteOptions]) -> int | None:
        """Write a whole file (``mode`` as an int, e.g. ``0o644``; missing parents are made
        unless ``parents=False``).

        With ``trajectory`` (and optionally ``step``) the write is a logged step; its step
        number is returned.
        """
        return self._c._send(api.write_file(self.sandbox.id, path, data, options))

    def list(self, path: str = "/") -> builtins.list[ty.FileEntry]:
        return self._c._send(api.list_files(self.sandbox.id, path))

    def stat(self, path: str) -> ty.FileEntry:
        return self._c._send(api.stat_file(self.sandbox.id, path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._c._send(api.remove_file(self.sandbox.id, path, recursive))

    def mkdir(self, path: str, *, parents: bool = False, mode: int | None = None) -> None:
        self._c._send(api.mkdir(self.sandbox.id, path, parents, mode))

    def upload_tar(self, path: str, tar: TarSource) -> None:
        """Unpack a tar stream (bytes, a file path or a binary file object) into directory ``path``."""
        self._c._send(api.upload_tar(self.sandbox.id, path, _read_tar_source(tar)))

    def download_tar(self, path: str) -> bytes:
        """Pack directory ``path`` as a tar stream."""
        return self._c._send(api.download_tar(self.sandbox.id, path))

    def upload_dir(self, local_dir: str | os.PathLike[str], path: str) -> None:
        """Copy the contents of a local directory into directory ``path`` of the sandbox."""
        self.upload_tar(path, _tar_dir(local_dir))

    def download_dir(self, path: str, local_dir: str | os.PathLike[str]) -> None:
        """Copy directory ``path`` of the sandbox into a local directory (links are skipped)."""
        _untar_to(self.download_tar(path), local_dir)


def _owning(client: Client | None, make: Callable[[Client], Sandbox]) -> Sandbox:
    """``make(client)``, with a new client that the sandbox owns when none is given."""
    c = client if client is not None else Client()
    try:
        sb = make(c)
    except BaseException:
        if client is None:
            c.close()
        raise
    sb._owns_client = client is None
    return sb


async def _aowning(client: AsyncClient | None, make: Callable[[AsyncClient], Awaitable[AsyncSandbox]]) -> AsyncSandbox:
    """:func:`_owning` for an async client."""
    c = client if client is not None else AsyncClient()
    try:
        sb = await make(c)
    except BaseException:
        if client is None:
            await c.aclose()
        raise
    sb._owns_client = client is None
    return sb


# ------------------------------------------------------------------------------------------------
# async


class AsyncSandbox(_SandboxData):
    """Async twin of :class:`Sandbox`; ``async with`` destroys it on exit::

    async with await AsyncSandbox.create(client) as sb:
        r = await sb.exec("echo hi")
    """

    def __init__(self, client: AsyncClient, data: Mapping[str, Any], *, owns_client: bool = False) -> None:
        super().__init__(data, owns_client)
        self.client = client
        self.files = AsyncFiles(self)

    @classmethod
    async def create(
        cls,
        client: AsyncClient | None = None,
        *,
        idempotency_key: str | None = None,
        **spec: Unpack[ty.CreateOptions],
    ) -> AsyncSandbox:
        """Create a sandbox; see :meth:`Sandbox.create`."""
        return await _aowning(client, lambda c: c.create_sandbox(idempotency_key=idempotency_key, **spec))

    @classmethod
    async def connect(cls, sandbox_id: str, client: AsyncClient | None = None) -> AsyncSandbox:
        return await _aowning(client, lambda c: c.get_sandbox(sandbox_id))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            with contextlib.suppress(SandboxNotFound):
                await self.destroy()
        finally:
            if self._owns_client:
                await self.client.aclose()

    async def refresh(self) -> AsyncSandbox:
        return self._set(await self.client._send(api.refresh(self.id)))

    async def wait(self, state: ty.SandboxState, timeout_ms: int = 30_000) -> AsyncSandbox:
        return self._set(await self.client._run(api.wait(self.id, state, timeout_ms)))

    async def wait_for_change(self, after_version: int | None = None, timeout_ms: int = 30_000) -> AsyncSandbox:
        plan = api.wait_for_change(self.id, self._since(after_version), timeout_ms)
        return self._set(await self.client._run(plan))

    async def heartbeat(self, lease_ms: int | None = None) -> AsyncSandbox:
        return self._set(await self.client._send(api.heartbeat(self.id, lease_ms)))

    async def snapshot(
        self, *, labels: Mapping[str, str] | None = None, trajectory: str | None = None, step: int | None = None
    ) -> ty.Snapshot:
        return await self.client._send(api.take_snapshot(self.id, labels, trajectory, step))

    async def fork(
        self,
        count: int = 1,
        *,
        labels: Mapping[str, str] | None = None,
        trajectory: str | None = None,
        step: int | None = None,
    ) -> ty.ForkResult[AsyncSandbox]:
        return await self.client._send(api.fork(self.client._sandbox, self.id, count, labels, trajectory, step))

    async def restore(
        self, snapshot: str | ty.Snapshot, *, trajectory: str | None = None, step: int | None = None
    ) -> AsyncSandbox:
        sid = snapshot.id if isinstance(snapshot, ty.Snapshot) else snapshot
        return self._set(await self.client._send(api.restore(self.id, sid, trajectory, step)))

    async def reset(self) -> AsyncSandbox:
        return self._set(await self.client._send(api.reset(self.id)))

    async def set_network(self, network: Mapping[str, Any]) -> AsyncSandbox:
        return self._set(await self.client._send(api.set_network(self.id, network)))

    async def destroy(self) -> AsyncSandbox:
        return self._destroyed(await self.client.delete_sandbox(self.id))

    async def exec(
        self,
        cmd: ty.Command,
        *,
        trajectory: str | None = None,
        step: int | None = None,
        **options: Unpack[ty.ExecOptions],
    ) -> ty.ExecResult:
        call = api.exec(self.id, cmd, self.client.exec_timeout, trajectory=trajectory, step=step, **options)
        return await self.client._send(call)

    async def exec_stream(self, cmd: ty.Command, **options: Unpack[ty.ExecOptions]) -> AsyncIterator[ty.ExecEvent]:
        async for ev in self.client._events(api.exec_stream(self.id, cmd, self.client.exec_timeout, **options)):
            yield ev

    async def spawn(self, cmd: ty.Command, **options: Unpack[ty.ExecOptions]) -> AsyncProcess:
        return AsyncProcess(self, await self.client._send(api.spawn(self.id, cmd, **options)))

    async def session(
        self, kind: ty.SessionKind = "shell", *, env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> AsyncSession:
        return AsyncSession(self, await self.client._send(api.open_session(self.id, kind, env, cwd)))


class AsyncProcess(_ProcessData):
    """Async twin of :class:`Process`."""

    def __init__(self, sandbox: AsyncSandbox, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.sandbox = sandbox

    async def status(self) -> ty.ProcessStatus:
        return await self.sandbox.client._send(api.process_status(self.sandbox.id, self.handle))

    async def write_stdin(self, data: str | bytes | None = None, *, eof: bool = False) -> None:
        await self.sandbox.client._send(api.write_stdin(self.sandbox.id, self.handle, data, eof))

    async def close_stdin(self) -> None:
        await self.write_stdin(None, eof=True)

    async def signal(self, signal: int = 15) -> None:
        await self.sandbox.client._send(api.signal(self.sandbox.id, self.handle, signal))

    async def kill(self) -> None:
        await self.signal(9)

    async def wait(self, timeout_ms: int = 30_000) -> ty.ExecResult | None:
        call = api.wait_process(self.sandbox.id, self.handle, timeout_ms)
        return self._ended(await self.sandbox.client._send(call))


class AsyncSession(_SessionData):
    """Async twin of :class:`Session`."""

    def __init__(self, sandbox: AsyncSandbox, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.sandbox = sandbox

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(DsecError):
            await self.close()

    async def run(
        self, input: str, *, timeout_ms: int | None = None, trajectory: str | None = None, step: int | None = None
    ) -> ty.ExecResult:
        c = self.sandbox.client
        call = api.session_run(self.sandbox.id, self.id, input, c.exec_timeout, timeout_ms, trajectory, step)
        return await c._send(call)

    async def close(self) -> None:
        await self.sandbox.client._send(api.close_session(self.sandbox.id, self.id))


class AsyncFiles(_FilesOf["AsyncSandbox"]):
    """Async twin of :class:`Files`."""

    @property
    def _c(self) -> AsyncClient:
        return self.sandbox.client

    async def read(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return await self._c._send(api.read_file(self.sandbox.id, path, max_bytes))

    async def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: str | bytes, **options: Unpack[ty.WriteOptions]) -> int | None:
        return await self._c._send(api.write_file(self.sandbox.id, path, data, options))

    async def list(self, path: str = "/") -> builtins.list[ty.FileEntry]:
        return await self._c._send(api.list_files(self.sandbox.id, path))

    async def stat(self, path: str) -> ty.FileEntry:
        return await self._c._send(api.stat_file(self.sandbox.id, path))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._c._send(api.remove_file(self.sandbox.id, path, recursive))

    async def mkdir(self, path: str, *, parents: bool = False, mode: int | None = None) -> None:
        await self._c._send(api.mkdir(self.sandbox.id, path, parents, mode))

    async def upload_tar(self, path: str, tar: TarSource) -> None:
        await self._c._send(api.upload_tar(self.sandbox.id, path, _read_tar_source(tar)))

    async def download_tar(self, path: str) -> bytes:
        return await self._c._send(api.download_tar(self.sandbox.id, path))

    async def upload_dir(self, local_dir: str | os.PathLike[str], path: str) -> None:
        await self.upload_tar(path, _tar_dir(local_dir))

    async def download_dir(self, path: str, local_dir: str | os.PathLike[str]) -> None:
        _untar_to(await self.download_tar(path), local_dir)
