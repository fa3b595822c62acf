"""Typed errors of the dsec API.

Every error the server answers is an ``application/problem+json`` document with a stable
``code``; :func:`error_from_problem` maps that code to one subclass of :class:`DsecError`, so
callers can write ``except dsec.SandboxNotFound:``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DsecError",
    "Unavailable",
    "NodeLost",
    "DsecConnectionError",
    "DsecTimeoutError",
    "InvalidRequest",
    "Unauthorized",
    "Forbidden",
    "SandboxNotFound",
    "TemplateNotFound",
    "NotFound",
    "HandleNotFound",
    "InvalidTransition",
    "IdempotencyConflict",
    "TooLarge",
    "QuotaExceeded",
    "ResourceExhausted",
    "Draining",
    "ExecTimeout",
    "AgentUnavailable",
    "PathEscape",
    "PermissionDenied",
    "NoSpace",
    "WrongFileType",
    "SpawnFailed",
    "InternalError",
    "TemplateInvalid",
    "UnsupportedVersion",
    "UnknownOutcome",
    "TrajectoryDiverged",
    "TrajectoryNotFound",
    "SnapshotNotFound",
    "MethodNotAllowed",
    "ERROR_CLASSES",
    "error_from_problem",
]


class DsecError(Exception):
    """Base class of every error raised by the SDK.

    Attributes:
        code: the stable error code (``sandbox_not_found``, ``quota_exceeded``, ...).
        status: the HTTP status (0 when no answer was received).
        detail: the human-readable detail of the problem document.
        request_id: the server's request id, to quote in a bug report.
        title: the problem title.
        problem: the whole problem document as received.
        retry_after: seconds from a ``Retry-After`` header, if any.
    """

    #: the code this class stands for; the base class uses it for unknown codes
    default_code: str = "unknown"

    def __init__(
        self,
        code: str | None = None,
        status: int = 0,
        detail: str | None = None,
        request_id: str | None = None,
        *,
        title: str | None = None,
        problem: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.code: str = code or self.default_code
        self.status: int = status
        self.detail: str | None = detail
        self.request_id: str | None = request_id
        self.title: str | None = title
        self.problem: dict[str, Any] = dict(problem or {})
        self.retry_after: float | None = retry_after
        msg = f"{self.code} ({status})" if status else self.code
        if detail:
            msg += f": {detail}"
        elif title:
            msg += f": {title}"
        if request_id:
            msg += f" [request_id={request_id}]"
        super().__init__(msg)


class DsecConnectionError(DsecError):
    """The server could not be reached (after the configured retries)."""

    default_code = "connection_error"


class DsecTimeoutError(DsecError):
    """The HTTP request itself timed out on the client side."""

    default_code = "client_timeout"


class InvalidRequest(DsecError):
    """``invalid_request`` (400): the request is malformed or names something unsupported."""

    default_code = "invalid_request"


class Unauthorized(DsecError):
    """``unauthorized`` (401): missing or unknown API key."""

    default_code = "unauthorized"


class Forbidden(DsecError):
    """``forbidden`` (403): the key's tenant may not do this (e.g. an admin-only endpoint)."""

    default_code = "forbidden"


class NotFound(DsecError):
    """``not_found`` (404): the path or object does not exist."""

    default_code = "not_found"


class SandboxNotFound(NotFound):
    """``sandbox_not_found`` (404): no such sandbox for this tenant."""

    default_code = "sandbox_not_found"


class TemplateNotFound(NotFound):
    """``template_not_found`` (404)."""

    default_code = "template_not_found"


class HandleNotFound(NotFound):
    """``handle_not_found`` (404): no such background process or session."""

    default_code = "handle_not_found"


class InvalidTransition(DsecError):
    """``invalid_transition`` (409): the sandbox's state does not allow this operation."""

    default_code = "invalid_transition"


class IdempotencyConflict(DsecError):
    """``idempotency_conflict`` (409): the key was used before with a different request."""

    default_code = "idempotency_conflict"


class TooLarge(DsecError):
    """``too_large`` (413)."""

    default_code = "too_large"


class QuotaExceeded(DsecError):
    """``quota_exceeded`` (429): the tenant's quota (sandboxes, memory) is used up."""

    default_code = "quota_exceeded"


class ResourceExhausted(DsecError):
    """``resource_exhausted`` (503): the node is out of a resource."""

    default_code = "resource_exhausted"


class Draining(DsecError):
    """``draining`` (503): the node is shutting down; see :attr:`retry_after`."""

    default_code = "draining"


class ExecTimeout(DsecError):
    """``exec_timeout`` (504)."""

    default_code = "exec_timeout"


class AgentUnavailable(DsecError):
    """``agent_unavailable`` (502): the in-sandbox agent does not answer."""

    default_code = "agent_unavailable"


class PathEscape(DsecError):
    """``path_escape`` (400): a path resolves outside the sandbox root."""

    default_code = "path_escape"


class PermissionDenied(DsecError):
    """``permission_denied`` (403): a file operation was refused inside the sandbox."""

    default_code = "permission_denied"


class NoSpace(DsecError):
    """``no_space`` (507): the sandbox's writable layer is full."""

    default_code = "no_space"


class WrongFileType(DsecError):
    """``wrong_file_type`` (400): e.g. reading a directory as a file."""

    default_code = "wrong_file_type"


class SpawnFailed(DsecError):
    """``spawn_failed`` (400): the command could not be started (not found, not executable)."""

    default_code = "spawn_failed"


class InternalError(DsecError):
    """``internal`` (500)."""

    default_code = "internal"


class TemplateInvalid(DsecError):
    """``template_invalid`` (400): an imported template is malformed or hostile."""

    default_code = "template_invalid"


class UnsupportedVersion(DsecError):
    """``unsupported_version`` (400): a protocol version the node does not speak."""

    default_code = "unsupported_version"


class UnknownOutcome(DsecError):
    """``unknown_outcome`` (409): a trajectory step was started but its result was never logged.

    It may or may not have run; the caller decides (e.g. sends a different action for the step).
    """

    default_code = "unknown_outcome"


class TrajectoryDiverged(DsecError):
    """``trajectory_diverged`` (409): a step beyond the trajectory's next one."""

    default_code = "trajectory_diverged"


class SnapshotNotFound(NotFound):
    """``snapshot_not_found`` (404): no such snapshot for this tenant."""

    default_code = "snapshot_not_found"


class TrajectoryNotFound(NotFound):
    """``trajectory_not_found`` (404): no such trajectory for this tenant."""

    default_code = "trajectory_not_found"


class MethodNotAllowed(DsecError):
    """``method_not_allowed`` (405): the path does not take this HTTP method (a client older or
    newer than the node)."""

    default_code = "method_not_allowed"


class Unavailable(DsecError):
    """``unavailable`` (503): a store the call needs (a cluster's etcd, every source of a
    template's layers) does not answer now; retry after ``Retry-After``."""

    default_code = "unavailable"


class NodeLost(DsecError):
    """``node_lost`` (410): the sandbox's node was lost (its cluster lease expired); the
    sandbox is gone (its state reads ``lost``)."""

    default_code = "node_lost"


#: stable error code -> exception class
ERROR_CLASSES: dict[str, type[DsecError]] = {
    cls.default_code: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        SandboxNotFound,
        TemplateNotFound,
        HandleNotFound,
        InvalidTransition,
        IdempotencyConflict,
        TooLarge,
        QuotaExceeded,
        ResourceExhausted,
        Draining,
        ExecTimeout,
        AgentUnavailable,
        PathEscape,
        PermissionDenied,
        NoSpace,
        WrongFileType,
        SpawnFailed,
        InternalError,
        TemplateInvalid,
        UnsupportedVersion,
        UnknownOutcome,
        TrajectoryDiverged,
        TrajectoryNotFound,
        SnapshotNotFound,
        Unavailable,
        NodeLost,
        MethodNotAllowed,
    )
}

_STATUS_FALLBACK: dict[int, type[DsecError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    413: TooLarge,
    429: QuotaExceeded,
    500: InternalError,
    502: AgentUnavailable,
    503: ResourceExhausted,
    504: ExecTimeout,
}


def error_from_problem(
    problem: Mapping[str, Any] | None,
    status: int = 0,
    *,
    request_id: str | None = None,
    retry_after: float | None = None,
) -> DsecError:
    """Build the typed exception for a problem document (or for a bare status).

    An unknown ``code`` gives the class of its HTTP status (or plain :class:`DsecError`),
    carrying that code.
    """
    problem = dict(problem or {})
    code = problem.get("code")
    status = int(problem.get("status") or status or 0)
    if isinstance(code, str) and code:
        # a code newer than this SDK still gets the class of its status (NotFound for a 404, ...)
        cls: type[DsecError] = ERROR_CLASSES.get(code) or _STATUS_FALLBACK.get(status, DsecError)
    else:
        cls = _STATUS_FALLBACK.get(status, DsecError)
        code = cls.default_code if cls is not DsecError else f"http_{status}"
    detail = problem.get("detail")
    return cls(
        code,
        status,
        detail if isinstance(detail, str) else None,
        problem.get("request_id") or request_id,
        title=problem.get("title"),
        problem=problem,
        retry_after=retry_after,
    )
