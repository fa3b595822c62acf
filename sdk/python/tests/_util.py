"""Small helpers shared by the system tests."""

from __future__ import annotations

import glob
import io
import os
import subprocess
import tarfile
from typing import Dict, Iterable, List, Set

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


def rootfs_tar(dirs: Iterable[str], files: Iterable[str], binaries: Iterable[str], extra: Dict[str, bytes]) -> bytes:
    """A root filesystem tarball: `dirs` (`tmp` sticky), host `files` at their own paths, host
    `binaries` at their own paths with every shared library `ldd` finds for them, and `extra`
    (path → content)."""
    binaries = list(binaries)
    libs = set()
    out = subprocess.run(["ldd", *binaries], capture_output=True, text=True).stdout
    for line in out.splitlines():
        path = next((w for w in line.split() if w.startswith("/")), None)
        if path and not path.endswith(":"):
            libs.add(path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tf.addfile(info)
        for p in [*files, *binaries, *sorted(libs)]:
            tf.add(os.path.realpath(p), arcname=p.lstrip("/"), recursive=False)
        for name, data in extra.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
