"""The code runner: the SDK's run_code/run_codes, and the real `sandbox-fusion` client from PyPI
pointed at `/t/<key>` (SandboxFusion clients cannot send headers), unchanged."""

from __future__ import annotations

import base64

import pytest

import dsec

from _util import rootfs_tar


def test_run_code_verdicts(client: dsec.Client) -> None:
    r = client.run_code("print(1 + 1)")
    assert r["status"] == "Success", r
    assert r["substrate"] == "function"
    assert r["run_result"]["stdout"] == "2\n"
    r = client.run_code("while True: pass", run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded", r
    r = client.run_code("x = bytearray(1 << 30)", memory_limit_mb=200)
    assert r["run_result"]["status"] == "MemoryLimitExceeded", r
    r = client.run_code('#include <stdio.h>\nint main(){puts("c ok");}', "c")
    assert r["run_result"]["stdout"] == "c ok\n", r
    with pytest.raises(dsec.DsecError) as e:
        client.run_code("1", "cobol")
    assert e.value.code == "invalid_request"


def test_run_codes_batch_is_isolated(client: dsec.Client) -> None:
    reqs = [{"code": f"import os\nprint({i}, os.path.exists('/tmp/x'))\nopen('/tmp/x', 'w')", "language": "python"} for i in range(20)]
    items = client.run_codes(reqs, concurrency=8)
    assert [it["ok"] for it in items] == [True] * 20, items
    assert [it["result"]["run_result"]["stdout"] for it in items] == [f"{i} False\n" for i in range(20)]


def test_run_batch_answers_at_its_colon_path_too(server, client: dsec.Client) -> None:
    """`POST /v1/run:batch` (the API-style name) is the same endpoint as `/v1/run/batch`,
    with a key header or with the key in the path."""
    import httpx

    body = {"requests": [{"code": f"print({i} * 3)", "language": "python"} for i in range(3)], "concurrency": 2}
    for path, headers in (
        ("/v1/run:batch", {"X-API-Key": client.api_key}),
        (f"/t/{client.api_key}/v1/run:batch", {}),
    ):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert [it["result"]["run_result"]["stdout"] for it in r.json()["items"]] == ["0\n", "3\n", "6\n"]
    r = httpx.post(server.url + "/v1/run:batch", json=body, timeout=60)
    assert r.status_code == 401, r.text


def test_sandbox_fusion_client_unchanged(server, client: dsec.Client) -> None:
    import sandbox_fusion as sf  # installed by scripts/test-python.sh; a missing install fails
    endpoint = f"{server.url}/t/{client.api_key}"
    r = sf.run_code(sf.RunCodeRequest(code="print(input() * 2)", language="python", stdin="ab\n"), endpoint=endpoint)
    assert r.status == sf.RunStatus.Success, r
    assert r.run_result.stdout == "abab\n"
    assert r.run_result.return_code == 0
    r = sf.run_code(sf.RunCodeRequest(code="import sys; sys.exit(4)", language="python"), endpoint=endpoint)
    assert r.status == sf.RunStatus.Failed and r.run_result.return_code == 4, r
    r = sf.run_code(
        sf.RunCodeRequest(code="import time; time.sleep(5)", language="python", run_timeout=1), endpoint=endpoint
    )
    assert r.run_result.status == sf.CommandRunStatus.TimeLimitExceeded, r
    r = sf.run_code(
        sf.RunCodeRequest(
            code='#include <iostream>\nint main(){std::string s; std::cin >> s; std::cout << s.size() << "\\n";}',
            language="cpp",
            stdin="hello",
        ),
        endpoint=endpoint,
    )
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "5\n", r
    r = sf.run_code(
        sf.RunCodeRequest(
            code="print(open('in.txt').read()); open('out.txt', 'w').write('o')",
            language="python",
            files={"in.txt": base64.b64encode(b"data").decode()},
            fetch_files=["out.txt"],
        ),
        endpoint=endpoint,
    )
    assert r.run_result.stdout == "data\n" and r.files == {"out.txt": base64.b64encode(b"o").decode()}, r
    # A language its client knows and its server does not: 422, as SandboxFusion's server answers.
    with pytest.raises(Exception, match="responded with code 422"):
        sf.run_code(sf.RunCodeRequest(code="1", language="gtest"), endpoint=endpoint, max_attempts=1)


def test_module_level_run_code(server, client: dsec.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_URL", server.url)
    monkeypatch.setenv("DSEC_API_KEY", client.api_key)
    monkeypatch.setattr(dsec, "_default_client", None)
    assert dsec.run_code("print(6 * 7)")["run_result"]["stdout"] == "42\n"
    items = dsec.run_codes([{"code": f"print({i})", "language": "python"} for i in range(3)], concurrency=2)
    assert [it["result"]["run_result"]["stdout"] for it in items] == ["0\n", "1\n", "2\n"]


def _python_rootfs() -> bytes:
    """A root filesystem with the host's Python (interpreter, standard library, the shared
    libraries they link) and one file in /root that is there before any call."""
    import os
    import sys

    lib = "/usr/lib/python3.%d" % sys.version_info[1]
    files, sos = [], []
    for top, dirs, names in os.walk(lib):
        dirs[:] = [d for d in dirs if d not in ("test", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages")]
        for n in names:
            (sos if n.endswith(".so") else files).append(os.path.join(top, n))
    return rootfs_tar(
        ("usr", "usr/bin", "usr/lib", "lib", "lib64", "lib/x86_64-linux-gnu", "tmp", "root", "home", "proc", "dev", "etc"),
        files,
        ["/usr/bin/python3", *sos],
        {"root/keep": b"original\n"},
    )


def test_function_sandbox_tainted_by_a_call_is_replaced(client: dsec.Client) -> None:
    """A call that changes a file that was there before the zygote started (only a reset undoes
    that) taints its sandbox: the sandbox refuses its next call, the node replaces it and runs
    the call on another. No later call sees the change."""
    import uuid

    name = f"py-{uuid.uuid4().hex[:8]}"
    client.upload_template(name, _python_rootfs())
    probe = "import os\nprint(os.lstat('/root/keep').st_mtime_ns, open('/root/keep').read().strip())"
    first = client.run_code(probe, template=name)
    assert first["status"] == "Success", first
    assert first["run_result"]["stdout"].endswith(" original\n"), first
    r = client.run_code("open('/root/keep', 'w').write('changed')", template=name)
    assert r["status"] == "Success", r
    # More calls than the template has zygote sandboxes: every one of them serves one.
    for _ in range(10):
        again = client.run_code(probe, template=name)
        assert again["status"] == "Success", again
        assert again["run_result"]["stdout"] == first["run_result"]["stdout"], again
