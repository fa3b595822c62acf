"""dsec: Python SDK for the dsec sandbox node.

Quick start::

    import dsec

    with dsec.Sandbox.create() as sb:          # DSEC_URL / DSEC_API_KEY from the environment
        r = sb.exec(["/usr/bin/python3", "-c", "print(1 + 1)"])
        assert r.ok and r.text == "2\\n"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .client import AsyncClient, Client
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .sandbox import (
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    Files,
    Process,
    Sandbox,
    Session,
)
from .trajectory import AsyncTrajectory, ResumeReport, Trajectory
from .types import *  # noqa: F403
from .types import __all__ as _types_all

__version__ = "0.1.0"

_default_client: Client | None = None


def _client() -> Client:
    global _default_client
    if _default_client is None:
        _default_client = Client()  # DSEC_URL / DSEC_API_KEY
    return _default_client


def run_code(code: str, language: str = "python", **options: Any) -> dict[str, Any]:
    """Run a snippet on the node from ``DSEC_URL`` with ``DSEC_API_KEY`` (see
    :meth:`Client.run_code`)."""
    return _client().run_code(code, language, **options)


def run_codes(requests: Sequence[Mapping[str, Any]], *, concurrency: int = 16) -> list[dict[str, Any]]:
    """Run many snippets at most ``concurrency`` at once (see :meth:`Client.run_codes`)."""
    return _client().run_codes(requests, concurrency=concurrency)


__all__ = [
    "Client",
    "AsyncClient",
    "Sandbox",
    "AsyncSandbox",
    "Process",
    "AsyncProcess",
    "Session",
    "AsyncSession",
    "Files",
    "AsyncFiles",
    "Trajectory",
    "AsyncTrajectory",
    "ResumeReport",
    "run_code",
    "run_codes",
    *_types_all,
    *_errors_all,
]
