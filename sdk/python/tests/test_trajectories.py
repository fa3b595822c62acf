"""Trajectories: logged steps, fast-forward replay, annotations, export, redaction."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

import dsec

COUNT = "echo x >> /tmp/ran; wc -l < /tmp/ran"


def _tid() -> str:
    return f"traj-{uuid.uuid4().hex[:10]}"


def test_steps_replay_and_branch(sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    r1 = sandbox.exec(COUNT, trajectory=tid)
    assert r1.step == 1 and not r1.replayed and r1.text.strip() == "1"
    r2 = sandbox.exec(["/bin/echo", "two"], trajectory=tid)
    assert r2.step == 2 and r2.text == "two\n"

    # fast-forward: the same request for a logged step answers from the log, without running
    again = sandbox.exec(COUNT, trajectory=tid, step=1)
    assert again.replayed and again.step == 1
    assert again.raw == r1.raw
    assert sandbox.files.read("/tmp/ran") == b"x\n"

    # a step beyond the next one
    with pytest.raises(dsec.TrajectoryDiverged) as ei:
        sandbox.exec("true", trajectory=tid, step=5)
    assert ei.value.status == 409

    # another action for a logged step runs live (a new branch)
    other = sandbox.exec("echo branch", trajectory=tid, step=2)
    assert not other.replayed and other.step == 2 and other.text == "branch\n"


def test_session_and_file_steps(sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    assert sandbox.files.write("/tmp/input.txt", b"41", trajectory=tid) == 1
    with sandbox.session("python") as py:
        r = py.run("print(int(open('/tmp/input.txt').read()) + 1)", trajectory=tid)
        assert r.step == 2 and r.text == "42\n"
        again = py.run("print(int(open('/tmp/input.txt').read()) + 1)", trajectory=tid, step=2)
        assert again.replayed and again.text == "42\n"
    info = sandbox.client.get_trajectory(tid)
    assert info.id == tid and info.last_step == 2
    assert info.acknowledged == info.results and info.unknown == 0
    assert tid in [x.id for x in sandbox.client.list_trajectories()]


def test_records_annotations_and_export(sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    sandbox.exec("echo a", trajectory=tid)
    sandbox.exec("echo b; exit 3", trajectory=tid)
    c = sandbox.client
    kinds = [(r["step"], r["kind"]) for r in c.trajectory_records(tid)]
    assert (1, "intent") in kinds and (1, "result") in kinds and (2, "result") in kinds
    assert kinds.index((1, "intent")) < kinds.index((1, "result"))
    assert [r["step"] for r in c.trajectory_records(tid, from_step=2)][0] == 2

    lsn = c.annotate_trajectory(tid, step=1, reward=1.0, labels=["good"], data={"judge": "unit"})
    assert lsn > 0
    c.annotate_trajectory(tid, reward=0.5)
    rows = c.export_trajectory(tid)
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["trajectory"] == tid
    assert rows[1]["exit_code"] == 3
    assert all(k in rows[0] for k in ("op", "action", "observation", "outcome", "annotations"))
    assert "good" in str(rows[0]["annotations"])


def test_secret_env_is_redacted(client: dsec.Client) -> None:
    tid = _tid()
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    with dsec.Sandbox.create(client, secret_env={"TOKEN": secret}) as sb:
        assert sb.exec("test -n \"$TOKEN\" && echo set").text == "set\n"  # the sandbox has it
        r = sb.exec("echo token=$TOKEN", trajectory=tid)
        assert secret not in r.text and "[REDACTED]" in r.text
        records = list(client.trajectory_records(tid))
        assert records and secret not in str(records)
        assert secret not in str(client.export_trajectory(tid))


def test_tenants_do_not_share_trajectories(server, sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    sandbox.exec("true", trajectory=tid)
    other = server.new_tenant()
    assert tid not in [x.id for x in other.list_trajectories()]
    with pytest.raises(dsec.TrajectoryNotFound) as ei:
        other.get_trajectory(tid)
    assert ei.value.status == 404


@pytest.mark.durability
def test_step_cut_by_kill9_is_unknown_outcome(fresh_server) -> None:
    c = fresh_server.client(max_retries=0)
    sb = dsec.Sandbox.create(c)
    tid = _tid()
    sb.exec("echo warm-up", trajectory=tid)
    out: dict = {}

    def run() -> None:
        try:
            out["r"] = sb.exec("sleep 3; echo done", trajectory=tid)
        except dsec.DsecError as e:
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.8)  # the intent is durable before the command runs
    fresh_server.kill9()
    t.join(30)
    assert isinstance(out.get("e"), dsec.DsecConnectionError), out
    fresh_server.clients = []
    fresh_server.start()
    c2 = fresh_server.client(max_retries=0)
    again = dsec.Sandbox.connect(sb.id, c2)
    # the warm-up step replays; the cut one may or may not have run: the node says so
    assert again.exec("echo warm-up", trajectory=tid, step=1).replayed
    with pytest.raises(dsec.UnknownOutcome) as ei:
        again.exec("sleep 3; echo done", trajectory=tid, step=2)
    assert ei.value.status == 409
    info = c2.get_trajectory(tid)
    assert info.unknown == 1
    again.destroy()


def test_follow_trajectory_streams_new_records(server, sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    sandbox.exec("true", trajectory=tid)  # the trajectory exists
    got: list = []
    done = threading.Event()
    follower = server.client()

    def follow() -> None:
        try:
            for rec in follower.follow_trajectory(tid):
                got.append(rec)
                if any(r.get("step") == 2 and r.get("kind") == "result" for r in got):
                    break
        except dsec.DsecError as e:
            got.append(e)
        done.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    time.sleep(0.5)
    sandbox.exec("echo streamed", trajectory=tid)
    assert done.wait(15), got
    assert any(isinstance(r, dict) and r.get("step") == 2 and r.get("kind") == "intent" for r in got), got


def test_trajectory_object_resumes_by_fast_forward(sandbox: dsec.Sandbox) -> None:
    tid = _tid()
    actions = [COUNT, "echo two", COUNT]
    traj = dsec.Trajectory(sandbox, tid)
    first = [traj.exec(a) for a in actions]
    assert [r.step for r in first] == [1, 2, 3]

    # A trainer preempted here rebuilds its object and re-sends what it had sent.
    again = dsec.Trajectory(sandbox, tid)
    report = again.resume(actions + ["echo four"])
    assert report.replayed == [1, 2, 3] and report.live == [4] and report.unknown == []
    assert [r.raw for r in report.results[:3]] == [r.raw for r in first]
    assert sandbox.files.read("/tmp/ran") == b"x\nx\n", "nothing ran twice"

    assert again.annotate(reward=1.0, labels=["ok"]) > 0
    info = again.info()
    assert info.raw["results"] == 4 and info.raw["unknown"] == 0
    rows = again.export(label="ok")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    kinds = [rec["kind"] for rec in again.steps()]
    assert kinds.count("intent") == 4 and kinds.count("result") == 4
    again.finish()
