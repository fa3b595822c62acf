"""SandboxFusion's client from PyPI against `/run_code`, as datasets and reward code use it:
every language whose toolchain the test machine has (scripts/install-run-toolchains.sh installs
them into the host, whose root is the `host` template), extra request keys, timeouts outside
(0, 300], 422 for input SandboxFusion's server would not validate, `SandboxError` for what the
node cannot serve, and a missing toolchain answered as a missing command."""

from __future__ import annotations

import base64
import threading
import time
import uuid

import httpx
import pytest
import sandbox_fusion as sf  # installed by scripts/test-python.sh; a missing install fails

import dsec

from _util import rootfs_tar


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


# (language, code, stdin, what the run's stdout holds): the programs that read their stdin.
READING = [
    ("python", "print(input()[::-1])", "abc", "cba\n"),
    ("cpp", "#include <iostream>\nint main(){int a; std::cin >> a; std::cout << a * 2 << std::endl;}", "21", "42\n"),
    ("bash", "read x; echo $((x * 2))", "21", "42\n"),
    ("nodejs", "const s = require('fs').readFileSync(0, 'utf8');\nconsole.log(Number(s) * 2);", "21", "42\n"),
    ("go", 'package main\nimport "fmt"\nfunc main() { var a int; fmt.Scan(&a); fmt.Println(a * 2) }\n', "21", "42\n"),
    ("csharp", "using System;\nclass P { static void Main() { Console.WriteLine(int.Parse(Console.ReadLine()) * 2); } }", "21", "42\n"),
    ("perl", 'my $x = <STDIN>; print $x * 2, "\\n";', "21", "42\n"),
    ("ruby", "puts gets.to_i * 2", "21", "42\n"),
]
# (language, code, what the run's stdout holds): the programs that take no input.
PRINTING = [
    ("pytest", "def test_adds():\n    assert 1 + 1 == 2\n", "1 passed"),
    ("typescript", "const n: number = 6 * 7;\nconsole.log(n);", "42\n"),
    ("go_test", 'package main\nimport "testing"\nfunc TestAdds(t *testing.T) { if 1+1 != 2 { t.Fatal("no") } }\n', "ok"),
    ("java", "public class Main { public static void main(String[] a) { System.out.println(6 * 7); } }", "42\n"),
    ("php", 'echo 6 * 7, "\\n";', "42\n"),
    ("lua", "print(6 * 7)", "42\n"),
    ("sql", "select 6 * 7;", "42\n"),
    ("verilog", 'module tb; initial begin $display("%0d", 6 * 7); $finish; end endmodule', "42\n"),
    (
        "junit",
        "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
        "public class CalcTest {\n  @Test void adds() { assertEquals(4, 2 + 2); }\n}\n",
        "1 tests successful",
    ),
]
# (language, code, stdin, files, what the run's stdout holds). Every language SandboxFusion
# lists whose toolchain scripts/install-run-toolchains.sh installs, and those of the base system.
LANGUAGES = [
    *((lang, code, stdin, {}, out) for lang, code, stdin, out in READING),
    *((lang, code, "", {}, out) for lang, code, out in PRINTING),
    (
        "python_gpu",
        "",
        "",
        {"compile.py": b64("open('built', 'w').write('42')"), "run.py": b64("print(open('built').read())")},
        "42\n",
    ),
]


def test_every_installed_language_through_the_sandbox_fusion_client(server, client: dsec.Client) -> None:
    endpoint = f"{server.url}/t/{client.api_key}"
    listed = {item["name"] for item in client.request_json("GET", "/v1/languages")["items"]}
    missing = {lang for lang, *_ in LANGUAGES} - listed
    assert not missing, f"toolchains missing on this host (run scripts/install-run-toolchains.sh): {missing}"
    for lang, code, stdin, files, out in LANGUAGES:
        req = sf.RunCodeRequest(
            code=code, language=lang, stdin=stdin, files=files, compile_timeout=60, run_timeout=60
        )
        r = sf.run_code(req, endpoint=endpoint, max_attempts=1)
        assert r.status == sf.RunStatus.Success, (lang, r)
        assert out in r.run_result.stdout, (lang, r)
    # A compile error is a compile result with its code, and no run.
    r = sf.run_code(sf.RunCodeRequest(code="package main\nfunc main() { x }", language="go"), endpoint=endpoint)
    assert r.status == sf.RunStatus.Failed and r.run_result is None, r
    assert r.compile_result.return_code != 0 and "undefined: x" in r.compile_result.stderr, r


def test_dataset_rows_and_timeouts_answer_as_sandbox_fusion_does(server, client: dsec.Client) -> None:
    endpoint = f"{server.url}/t/{client.api_key}"
    # A dataset row posted as it is: its extra keys are ignored.
    row = {"code": "print(6 * 7)", "language": "python", "task_id": "HumanEval/0", "test": "assert True", "labels": {"x": 1}}
    resp = httpx.post(f"{endpoint}/run_code", json=row, timeout=60)
    assert resp.status_code == 200, resp.text
    r = sf.RunCodeResponse(**resp.json())
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "42\n", r
    # Timeouts: above the node's maximum clamped (and said so), 0 a time-out at once.
    resp = httpx.post(f"{endpoint}/run_code", json={**row, "run_timeout": 3600, "compile_timeout": -1}, timeout=60)
    assert resp.status_code == 200 and resp.json()["clamped"] == {"run_timeout": 300.0, "compile_timeout": 0.0}, resp.text
    r = sf.run_code(sf.RunCodeRequest(code="print(1)", language="python", run_timeout=3600), endpoint=endpoint)
    assert r.status == sf.RunStatus.Success, r
    r = sf.run_code(sf.RunCodeRequest(code="print(1)", language="python", run_timeout=0), endpoint=endpoint)
    assert r.status == sf.RunStatus.Failed and r.run_result.status == sf.CommandRunStatus.TimeLimitExceeded, r
    r = sf.run_code(sf.RunCodeRequest(code="int main(){}", language="cpp", compile_timeout=0), endpoint=endpoint)
    assert r.compile_result.status == sf.CommandRunStatus.TimeLimitExceeded and r.run_result is None, r
    assert sf.summary_run_code_result(r, sf.SummaryMapping(CompileTimeout="CT")) == "CT"
    # A language the client knows and SandboxFusion's server does not: 422, as there.
    with pytest.raises(Exception, match="responded with code 422"):
        sf.run_code(sf.RunCodeRequest(code="1", language="react"), endpoint=endpoint, max_attempts=1)
    resp = httpx.post(f"{endpoint}/run_code", json={"language": "python"}, timeout=60)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "code"], resp.text
    # The native API keeps refusing unknown fields.
    resp = httpx.post(f"{server.url}/v1/run", json=row, headers={"X-API-Key": client.api_key}, timeout=60)
    assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", resp.text


def test_a_missing_toolchain_answers_as_a_missing_command(server, client: dsec.Client) -> None:
    """A template with Python and a shell and no other toolchain: a Go run is `Failed` with the
    compile phase's 127, as SandboxFusion's shell answers for a command it lacks; an
    interpreted language gets it in the run phase."""
    import os
    import sys

    name = f"bare-{uuid.uuid4().hex[:8]}"
    lib = "/usr/lib/python3.%d" % sys.version_info[1]
    files = [os.path.join(lib, n) for n in os.listdir(lib) if n.endswith(".py")]
    client.upload_template(
        name,
        rootfs_tar(
            ("usr", "usr/bin", "usr/lib", "bin", "lib", "lib64", "lib/x86_64-linux-gnu", "tmp", "root", "proc", "dev", "etc"),
            files,
            ["/usr/bin/python3", "/bin/sh"],
            {},
        ),
    )
    endpoint = f"{server.url}/t/{client.api_key}/run_code"
    for lang, phase in (("go", "compile_result"), ("ruby", "run_result")):
        resp = httpx.post(endpoint, json={"code": "x", "language": lang, "template": name}, timeout=120)
        assert resp.status_code == 200, resp.text
        r = sf.RunCodeResponse(**resp.json())
        assert r.status == sf.RunStatus.Failed, r
        result = getattr(r, phase)
        assert result.return_code == 127 and "command not found" in result.stderr, r
    langs = client.request_json("GET", "/v1/languages", params={"template": name})
    # python_gpu needs only python3 (its files make the program).
    assert [item["name"] for item in langs["items"]] == ["python", "python_gpu"], langs


def test_what_the_node_cannot_serve_is_a_sandbox_error(server, client: dsec.Client) -> None:
    """A tenant at its quota of runs in flight: SandboxFusion's route answers 200 with
    `SandboxError` (its client raises it), not a problem document."""
    t = client.create_tenant(f"sf-quota-{uuid.uuid4().hex[:6]}", max_sandboxes=1)
    key = t.api_key
    endpoint = f"{server.url}/t/{key}"
    slow = threading.Thread(
        target=lambda: httpx.post(
            f"{endpoint}/run_code", json={"code": "import time; time.sleep(2)", "language": "python"}, timeout=60
        )
    )
    slow.start()
    try:
        time.sleep(0.7)
        resp = httpx.post(f"{endpoint}/run_code", json={"code": "print(1)", "language": "python"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "SandboxError" and resp.json()["code"] == "quota_exceeded", resp.text
        with pytest.raises(Exception, match="Sandbox responded with error"):
            sf.run_code(sf.RunCodeRequest(code="print(1)", language="python"), endpoint=endpoint, max_attempts=1)
    finally:
        slow.join()
