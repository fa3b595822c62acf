"""Smoke test of the `dsec sandbox` CLI against the running server (and the SDK sees its work)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Optional

import pytest

import dsec


def _run(server, *args: str, check: bool = True, stdin: Optional[bytes] = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_URL=server.url, DSEC_API_KEY=server.admin_key)
    p = subprocess.run(
        [str(server.binary), *args], env=env, input=stdin, capture_output=True, timeout=120
    )
    if check and p.returncode != 0:
        raise AssertionError(f"dsec {' '.join(args)} exited {p.returncode}:\n{p.stdout!r}\n{p.stderr!r}")
    return p


def test_cli_sandbox_smoke(server, client: dsec.Client, uid: str) -> None:
    top = _run(server, "--help")
    if not re.search(rb"^\s+sandbox\b", top.stdout, re.M):
        pytest.skip("the dsec CLI has no `sandbox` subcommand")
    created = _run(server, "sandbox", "create", "--label", f"cli={uid}", "--json")
    sb_id = json.loads(created.stdout)["id"]
    server.created_ids.add(sb_id)
    try:
        # the SDK sees what the CLI made
        sb = dsec.Sandbox.connect(sb_id, client)
        assert sb.labels == {"cli": uid} and sb.state == "running"
        assert sb_id in _run(server, "sandbox", "list", "--label", f"cli={uid}").stdout.decode()

        out = _run(server, "sandbox", "exec", sb_id, "--", "/bin/echo", "from-cli")
        assert out.stdout == b"from-cli\n"
        # the command's exit code is dsec's
        bad = _run(server, "sandbox", "exec", sb_id, "--shell", "echo oops >&2; exit 3", check=False)
        assert bad.returncode == 3 and bad.stderr.endswith(b"oops\n")

        # files written by the CLI are read by the SDK, and the other way round
        _run(server, "sandbox", "files", sb_id, "write", "/tmp/cli.bin", stdin=b"\x00\xffcli")
        assert sb.files.read("/tmp/cli.bin") == b"\x00\xffcli"
        sb.files.write("/tmp/sdk.txt", b"from the sdk\n")
        assert _run(server, "sandbox", "files", sb_id, "read", "/tmp/sdk.txt").stdout == b"from the sdk\n"

        # a missing sandbox is exit code 3 with a `dsec:` line
        missing = _run(server, "sandbox", "get", "sb-0000000000000000", check=False)
        assert missing.returncode == 3 and b"dsec:" in missing.stderr
    finally:
        _run(server, "sandbox", "kill", "--label", f"cli={uid}")
    assert sb_id not in [s.id for s in client.list_sandboxes(labels={"cli": uid})]
