"""Smoke test of the `dsec sandbox` CLI against the running server."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

import dsec


def _run(server, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_URL=server.url, DSEC_API_KEY=server.admin_key)
    p = subprocess.run([str(server.binary), *args], env=env, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"dsec {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def test_cli_sandbox_smoke(server, client: dsec.Client) -> None:
    top = _run(server, "--help")
    if not re.search(r"^\s+sandbox\b", top.stdout, re.M):
        pytest.skip("the dsec CLI has no `sandbox` subcommand (not built yet)")
    created = _run(server, "sandbox", "create", "--json")
    sb_id = json.loads(created.stdout)["id"]
    server.created_ids.add(sb_id)
    try:
        assert sb_id in [s.id for s in client.list_sandboxes()]
        listed = _run(server, "sandbox", "list")
        assert sb_id in listed.stdout
        out = _run(server, "sandbox", "exec", sb_id, "--", "/bin/echo", "from-cli")
        assert out.stdout == "from-cli\n"
    finally:
        _run(server, "sandbox", "kill", sb_id)
    assert sb_id not in [s.id for s in client.list_sandboxes() if s.state not in dsec.FINAL_STATES]
