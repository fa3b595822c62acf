"""Small helpers shared by the system tests."""

from __future__ import annotations

from typing import Dict, List

import dsec


def sandbox_exists(client: dsec.Client, sandbox_id: str) -> bool:
    """True when the sandbox is visible and not in a final state."""
    try:
        sb = client.get_sandbox(sandbox_id)
    except dsec.SandboxNotFound:
        return False
    return sb.state not in dsec.FINAL_STATES


def live(sandboxes) -> List[str]:
    return sorted(s.id for s in sandboxes if s.state not in dsec.FINAL_STATES)


def labels_of(items) -> Dict[str, Dict[str, str]]:
    return {s.id: s.labels for s in items}
