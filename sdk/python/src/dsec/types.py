"""Plain data types of the dsec API and the helpers that build and parse its bodies."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import (
    Any,
    Generic,
    Literal,
    Protocol,
    TypeVar,
    Union,
    cast,
)

from typing_extensions import TypedDict, Unpack

from .errors import DsecError

__all__ = [
    "Snapshot",
    "ForkResult",
    "Command",
    "SandboxState",
    "Substrate",
    "ExecStatus",
    "SessionKind",
    "CreateOptions",
    "ExecOptions",
    "WriteOptions",
    "SandboxQuery",
    "Annotation",
    "TenantQuota",
    "RequestOptions",
    "FINAL_STATES",
    "BatchCreateResult",
    "ExecResult",
    "ExecEvent",
    "ProcessStatus",
    "FileEntry",
    "Template",
    "PoolStats",
    "Tenant",
    "BatchDeleteItem",
    "TrajectoryInfo",
    "decode_data",
    "exec_body",
]

#: a command: an argv list (run directly) or a string (run by ``/bin/sh -c``)
Command = Union[str, Sequence[str]]

#: the lifecycle state of a sandbox
SandboxState = Literal["creating", "ready", "running", "resetting", "stopping", "stopped", "failed", "lost"]

#: states a sandbox never leaves
FINAL_STATES: frozenset[SandboxState] = frozenset({"stopped", "failed", "lost"})

#: how a sandbox is isolated: namespaces and cgroups, a QEMU microVM, or a QEMU q35 VM
Substrate = Literal["container", "microvm", "vm"]

#: how a command ended (a timeout is a result, not an exception)
ExecStatus = Literal["ok", "nonzero_exit", "timeout", "oom", "killed", "output_limit"]

#: the kind of a persistent session
SessionKind = Literal["shell", "python"]


class CreateOptions(TypedDict, total=False):
    """What a sandbox is created from (the keywords of ``Sandbox.create`` and
    ``Client.create_sandbox``); a key left out or ``None`` is left to the server's default.

    Keys:
        template: template name (server default: ``host``).
        substrate: ``container`` (the default), ``microvm`` or ``vm`` (a QEMU guest restored
            from its template's snapshot); every other call is the same.
        limits: partial limits (``memory_max``, ``pids_max``, ``cpu_max``, ...).
        env: environment of every exec.
        secret_env: environment whose values are redacted from the trajectory log.
        labels: free-form labels to find the sandbox by.
        ttl_ms: lifetime after which the node destroys the sandbox.
        lease_ms: owner lease; the sandbox is destroyed unless ``heartbeat`` renews it.
        writable_root: make the whole root writable instead of only the scratch dirs.
        userns: the user namespace, on unless ``False``: root inside is an unprivileged
            host id range of the sandbox's own, and ``RLIMIT_NPROC`` refuses a fork bomb's
            forks before they cost the node anything. ``False`` (the sandbox's root is host
            root with every capability dropped) is for the admin tenant only.
        snapshot: make it from this snapshot (``sn-…``): its template, substrate and files.
        network: network egress, ``{"egress": "none"}`` when absent (only loopback);
            ``{"egress": {"allow": ["pypi.org", "*.pythonhosted.org", "github.com:443",
            "10.20.0.0/16"], "deny": [...], "bandwidth_bps": n, "max_connections": n}}`` or
            ``{"egress": "all"}``, within the tenant's ``egress_ceiling``; ``"reserved":
            ["169.254.169.254:80"]`` beside ``allow`` reaches a network no policy otherwise
            reaches, as an admin allows it.
    """

    snapshot: str | None
    network: Mapping[str, Any] | None
    template: str | None
    substrate: Substrate | None
    limits: Mapping[str, Any] | None
    env: Mapping[str, str] | None
    secret_env: Mapping[str, str] | None
    labels: Mapping[str, str] | None
    ttl_ms: int | None
    lease_ms: int | None
    writable_root: bool | None
    userns: bool | None


class ExecOptions(TypedDict, total=False):
    """How a command runs (the keywords of ``exec``, ``exec_stream`` and ``spawn``).

    Keys:
        env: extra environment.
        cwd: working directory.
        timeout_ms: wall-clock limit; reaching it is a result with ``status == "timeout"``.
        stdin: bytes or text fed to the command's stdin.
        cpu_limit_ms: CPU-time limit.
        output_limit: bytes of stdout/stderr kept (and the hard bound that kills the command).
        user: the user of the sandbox it runs as (a name in its ``/etc/passwd`` or a uid;
            default: the template's user, else root).
    """

    env: Mapping[str, str] | None
    cwd: str | None
    timeout_ms: int | None
    stdin: str | bytes | None
    cpu_limit_ms: int | None
    output_limit: int | None
    user: str | None


class WriteOptions(TypedDict, total=False):
    """How ``files.write`` writes.

    Keys:
        mode: the file's mode as an int (e.g. ``0o644``).
        parents: make missing parent directories (default True).
        trajectory: log the write as a step of this trajectory.
        step: its step number (default: the next one).
    """

    mode: int | None
    parents: bool
    trajectory: str | None
    step: int | None


class SandboxQuery(TypedDict, total=False):
    """Which sandboxes ``list_sandboxes`` yields.

    Keys:
        state: only those in this state (without it, ``stopped`` ones are left out).
        labels: only those with all these labels.
        page_size: sandboxes per request (the listing follows ``next_cursor`` page by page).
        tenant: another tenant's id (admin only).
    """

    state: SandboxState | None
    labels: Mapping[str, str] | None
    page_size: int | None
    tenant: str | None


class Annotation(TypedDict, total=False):
    """A trajectory annotation: of the whole trajectory, or of one ``step``."""

    step: int | None
    reward: float | None
    labels: Sequence[str] | None
    data: Mapping[str, Any] | None


class TenantQuota(TypedDict, total=False):
    """A tenant's quota; a key left out or ``None`` is unlimited."""

    max_sandboxes: int | None
    max_memory_bytes: int | None
    #: the widest network egress its sandboxes may have: ``"none"`` (the default), ``"all"`` or
    #: an allow list (``{"allow": [...], "reserved"?, "bandwidth_bps"?, "max_connections"?}``;
    #: its ``reserved`` rules are what its sandboxes may list as theirs)
    egress_ceiling: Any


class RequestOptions(TypedDict, total=False):
    """The keywords of ``Client.request`` and ``Client.stream``.

    Keys:
        params: the query (a mapping, or pairs for repeated keys).
        json: a JSON body.
        content: a raw body.
        headers: extra headers.
        idempotency_key: the ``Idempotency-Key`` (generated for a mutation when not given).
        timeout: the HTTP timeout in seconds (default: the client's ``timeout``).
    """

    params: Any
    json: Any
    content: bytes | None
    headers: Mapping[str, str] | None
    idempotency_key: str | None
    timeout: float | None


def check_keys(options: Mapping[str, Any], allowed: Any) -> None:
    """Refuse a keyword ``allowed`` (a ``TypedDict``) does not name, as a signature would."""
    unknown = sorted(set(options) - set(allowed.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")


def _counts(d: Mapping[str, Any], *keys: str) -> dict[str, int]:
    """Integer fields of an answer (0 when absent or null)."""
    return {k: int(d.get(k) or 0) for k in keys}


def decode_data(data: Any) -> bytes:
    """Decode an output capture's ``data``: a string (valid UTF-8) or a list of byte values."""
    if data is None:
        return b""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, list):
        return bytes(data)
    raise TypeError(f"unexpected output data of type {type(data).__name__}")


def exec_body(
    cmd: Command,
    *,
    trajectory: str | None = None,
    step: int | None = None,
    **options: Unpack[ExecOptions],
) -> dict[str, Any]:
    """Build the JSON body of an exec (also used for background processes)."""
    check_keys(options, ExecOptions)
    env, cwd, stdin = options.get("env"), options.get("cwd"), options.get("stdin")
    timeout_ms, cpu_limit_ms = options.get("timeout_ms"), options.get("cpu_limit_ms")
    output_limit = options.get("output_limit")
    body: dict[str, Any] = {}
    if isinstance(cmd, str):
        body["shell"] = cmd
    else:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("cmd must be a shell string or a non-empty sequence of strings")
        body["argv"] = argv
    if env is not None:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if timeout_ms is not None:
        body["timeout_ms"] = int(timeout_ms)
    if cpu_limit_ms is not None:
        body["cpu_limit_ms"] = int(cpu_limit_ms)
    if output_limit is not None:
        body["output_limit"] = int(output_limit)
    user = options.get("user")
    if user is not None:
        body["user"] = str(user)
    if stdin is not None:
        if isinstance(stdin, str):
            body["stdin"] = stdin
        else:
            body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
    if trajectory is not None:
        body["trajectory"] = trajectory
        if step is not None:
            body["step"] = int(step)
    elif step is not None:
        raise ValueError("step= needs trajectory=")
    return body


@dataclass
class ExecResult:
    """The outcome of one command.

    ``status`` (an :data:`ExecStatus`) is ``ok``, ``nonzero_exit``, ``timeout``, ``oom``,
    ``killed`` or ``output_limit``; a timeout is a normal result, not an exception.
    """

    status: ExecStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_total: int = 0
    stderr_total: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_us: int | None = None
    cpu_us: int | None = None
    peak_rss_kb: int | None = None
    #: the trajectory step this exec was logged as (``Dsec-Step``), if it was one
    step: int | None = None
    #: True when the node answered a re-sent step from its log without running it
    replayed: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_response(cls, resp: Any) -> ExecResult:
        """From an HTTP answer: the body plus the trajectory headers."""
        r = cls.from_json(resp.json())
        step = resp.headers.get("dsec-step")
        r.step = int(step) if step and step.isdigit() else None
        r.replayed = resp.headers.get("dsec-replayed") == "true"
        return r

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ExecResult:
        out = d.get("stdout") or {}
        err = d.get("stderr") or {}
        stdout = decode_data(out.get("data"))
        stderr = decode_data(err.get("data"))
        return cls(
            status=cast(ExecStatus, str(d.get("status"))),
            exit_code=d.get("exit_code"),
            signal=d.get("signal"),
            stdout=stdout,
            stderr=stderr,
            stdout_total=int(out.get("total", len(stdout)) or 0),
            stderr_total=int(err.get("total", len(stderr)) or 0),
            stdout_truncated=bool(out.get("truncated", False)),
            stderr_truncated=bool(err.get("truncated", False)),
            wall_us=d.get("wall_us"),
            cpu_us=d.get("cpu_us"),
            peak_rss_kb=d.get("peak_rss_kb"),
            raw=dict(d),
        )

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its limits."""
        return self.status == "ok"

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        """stderr decoded as UTF-8 (invalid bytes replaced)."""
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def truncated(self) -> bool:
        """True when either capture was cut by the output limit."""
        return self.stdout_truncated or self.stderr_truncated


@dataclass
class ExecEvent:
    """One event of a streamed exec.

    ``type`` is ``stdout`` / ``stderr`` (with :attr:`data`), ``exit`` (with :attr:`result`) or
    ``error`` (with :attr:`error`). Unknown event types are passed through with ``raw`` set.
    """

    type: str
    data: bytes = b""
    result: ExecResult | None = None
    error: DsecError | None = None
    raw: Any = None

    @property
    def text(self) -> str:
        """The chunk decoded as UTF-8 (a chunk may end in the middle of a character)."""
        return self.data.decode("utf-8", errors="replace")


@dataclass
class ProcessStatus:
    """Whether a background process is still running."""

    running: bool
    pid: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProcessStatus:
        return cls(running=bool(d.get("running")), pid=d.get("pid"), raw=dict(d))


@dataclass
class FileEntry:
    """One directory entry (``kind`` is ``file``, ``dir``, ``symlink``, ...)."""

    name: str
    kind: str
    size: int = 0
    mode: int = 0
    mtime: Any = None
    link_target: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileEntry:
        return cls(
            name=str(d.get("name", "")),
            kind=str(d.get("kind", "")),
            **_counts(d, "size", "mode"),
            mtime=d.get("mtime"),
            link_target=d.get("link_target"),
            raw=dict(d),
        )

    @property
    def is_dir(self) -> bool:
        return self.kind in ("dir", "directory")

    @property
    def is_file(self) -> bool:
        return self.kind in ("file", "regular")


@dataclass
class Template:
    """A template: named, ordered image layers."""

    name: str
    layers: list[Any] = field(default_factory=list)
    source: Any = None
    created_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Template:
        return cls(
            name=str(d.get("name")),
            layers=list(d.get("layers") or []),
            source=d.get("source"),
            created_at=d.get("created_at"),
            raw=dict(d),
        )


@dataclass
class PoolStats:
    """Warm-pool statistics of one template (see ``raw`` for fields newer than this SDK)."""

    template: str
    min: int = 0
    max: int = 0
    target: int = 0
    ready: int = 0
    creating: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    acquire_rate: float = 0.0
    refill_ms: float | None = None
    peak: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PoolStats:
        return cls(
            template=str(d.get("template")),
            **_counts(d, "min", "max", "target", "ready", "creating", "hits", "misses"),
            hit_rate=float(d.get("hit_rate") or 0.0),
            acquire_rate=float(d.get("acquire_rate") or 0.0),
            refill_ms=d.get("refill_ms"),
            peak=d.get("peak"),
            raw=dict(d),
        )


@dataclass
class Tenant:
    """A tenant. ``api_key`` is only known right after creation; ``usage`` only for ``/v1/tenant``.

    The ``admin`` tenant is the operator: it may read and delete any tenant's sandboxes.
    """

    id: str
    name: str
    api_key: str | None = None
    max_sandboxes: int | None = None
    max_memory_bytes: int | None = None
    usage: dict[str, Any] | None = None
    admin: bool = False
    created_at_ms: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Tenant:
        usage = d.get("usage")
        if usage is None and ("sandboxes" in d or "memory_bytes" in d):
            usage = {"sandboxes": d.get("sandboxes"), "memory_bytes": d.get("memory_bytes")}
        return cls(
            id=str(d.get("id")),
            name=str(d.get("name")),
            api_key=d.get("api_key"),
            max_sandboxes=d.get("max_sandboxes"),
            max_memory_bytes=d.get("max_memory_bytes"),
            usage=usage,
            admin=bool(d.get("admin", False)),
            created_at_ms=d.get("created_at_ms"),
            raw=dict(d),
        )


@dataclass
class BatchDeleteItem:
    """The outcome of deleting one sandbox in a batch."""

    id: str
    ok: bool
    error: DsecError | None = None


@dataclass
class TrajectoryInfo:
    """Counters of one trajectory in the node's log."""

    id: str
    last_step: int | None = None
    intents: int = 0
    results: int = 0
    acknowledged: int = 0
    unknown: int = 0
    annotations: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TrajectoryInfo:
        return cls(
            id=str(d.get("id")),
            last_step=d.get("last_step"),
            **_counts(d, "intents", "results", "acknowledged", "unknown", "annotations"),
            raw=dict(d),
        )


class HasId(Protocol):
    """Anything with a sandbox id."""

    @property
    def id(self) -> str: ...


S = TypeVar("S", bound=HasId)


@dataclass
class BatchCreateResult(Generic[S]):
    """The outcome of a batch create: the sandboxes made and the errors of the others.

    Iterating it yields the sandboxes; ``len()`` counts them.
    """

    sandboxes: list[S] = field(default_factory=list)
    errors: list[DsecError] = field(default_factory=list)

    def __iter__(self) -> Iterator[S]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.sandboxes]


@dataclass
class Snapshot:
    """A snapshot of a sandbox (``Sandbox.snapshot``): its files at that moment, which new
    sandboxes are made from (``Sandbox.create(snapshot=...)``, ``Sandbox.fork``) and a sandbox
    is rolled back to (``Sandbox.restore``). A container's snapshot holds files, not process
    memory (``memory`` is ``False``)."""

    id: str
    parent: str | None
    sandbox: str
    template: str
    substrate: str
    size_bytes: int
    depth: int
    memory: bool
    created_at: str
    labels: dict[str, str] = field(default_factory=dict)
    trajectory: str | None = None
    step: int | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Snapshot:
        return cls(
            id=str(d["id"]),
            parent=d.get("parent"),
            sandbox=str(d.get("sandbox")),
            template=str(d.get("template")),
            substrate=str(d.get("substrate")),
            size_bytes=int(d.get("size_bytes") or 0),
            depth=int(d.get("depth") or 0),
            memory=bool(d.get("memory")),
            created_at=str(d.get("created_at")),
            labels=dict(d.get("labels") or {}),
            trajectory=d.get("trajectory"),
            step=d.get("step"),
        )


@dataclass
class ForkResult(Generic[S]):
    """What ``Sandbox.fork`` made: the snapshot and the sandboxes made from it (with the
    errors of those that could not be made). Iterating it yields the sandboxes."""

    snapshot: Snapshot
    sandboxes: list[S] = field(default_factory=list)
    errors: list[DsecError] = field(default_factory=list)

    def __iter__(self) -> Iterator[S]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)
