"""Small helpers shared by the system tests."""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Set

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


def cgroup_dirs_named(ids: Set[str]) -> List[str]:
    """Every sandbox cgroup directory (v1 hierarchies and v2) whose name is one of `ids`."""
    bases = set(glob.glob("/sys/fs/cgroup/*/dsec")) | set(glob.glob("/sys/fs/cgroup/dsec"))
    found = []
    for base in sorted(bases):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        found += [os.path.join(base, n) for n in names if n in ids]
    return found
