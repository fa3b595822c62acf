"""Trajectories through the async client: test_trajectories.py's steps, replay, annotations,
export, following and the resuming Trajectory object, awaited (on a container)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import AsyncIterator

import pytest

import dsec

COUNT = "echo x >> /tmp/ran; wc -l < /tmp/ran"


def _tid() -> str:
    return f"atraj-{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def _sandbox(server) -> AsyncIterator[dsec.AsyncSandbox]:
    async with server.async_client() as c:
        async with await dsec.AsyncSandbox.create(c, labels={"fixture": "async-trajectory"}, ttl_ms=600_000) as sb:
            yield sb


@pytest.mark.asyncio
async def test_async_steps_replay_and_branch(server) -> None:
    tid = _tid()
    async with _sandbox(server) as sb:
        r1 = await sb.exec(COUNT, trajectory=tid)
        assert r1.step == 1 and not r1.replayed and r1.text.strip() == "1"
        assert (await sb.exec(["/bin/echo", "two"], trajectory=tid)).step == 2
        again = await sb.exec(COUNT, trajectory=tid, step=1)
        assert again.replayed and again.step == 1 and again.raw == r1.raw
        assert await sb.files.read("/tmp/ran") == b"x\n"
        with pytest.raises(dsec.TrajectoryDiverged):
            await sb.exec("true", trajectory=tid, step=5)
        other = await sb.exec("echo branch", trajectory=tid, step=2)
        assert not other.replayed and other.step == 2 and other.text == "branch\n"


@pytest.mark.asyncio
async def test_async_session_file_steps_records_and_export(server) -> None:
    tid = _tid()
    async with _sandbox(server) as sb:
        c = sb.client
        assert await sb.files.write("/tmp/input.txt", b"41", trajectory=tid) == 1
        async with await sb.session("python") as py:
            r = await py.run("print(int(open('/tmp/input.txt').read()) + 1)", trajectory=tid)
            assert r.step == 2 and r.text == "42\n"
        info = await c.get_trajectory(tid)
        assert info.last_step == 2 and info.unknown == 0
        assert tid in [x.id for x in await c.list_trajectories()]
        kinds = [(rec["step"], rec["kind"]) async for rec in c.trajectory_records(tid)]
        assert (1, "intent") in kinds and (2, "result") in kinds
        assert await c.annotate_trajectory(tid, step=2, reward=1.0, labels=["good"]) > 0
        assert [row["step"] for row in await c.export_trajectory(tid)] == [1, 2]
        assert [row["step"] for row in await c.export_trajectory(tid, label="good")] == [2]


@pytest.mark.asyncio
async def test_async_follow_trajectory_streams_new_records(server) -> None:
    tid = _tid()
    async with _sandbox(server) as sb:
        await sb.exec("true", trajectory=tid)
        got: list = []

        async def follow() -> None:
            async with server.async_client() as follower:
                async for rec in follower.follow_trajectory(tid):
                    got.append(rec)
                    if rec.get("step") == 2 and rec.get("kind") == "result":
                        return

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0.5)
        await sb.exec("echo streamed", trajectory=tid)
        await asyncio.wait_for(task, 15)
        assert any(r.get("step") == 2 and r.get("kind") == "intent" for r in got), got


@pytest.mark.asyncio
async def test_async_trajectory_object_resumes_by_fast_forward(server) -> None:
    tid = _tid()
    actions = [COUNT, "echo two", COUNT]
    async with _sandbox(server) as sb:
        traj = dsec.AsyncTrajectory(sb, tid)
        first = [await traj.exec(a) for a in actions]
        assert [r.step for r in first] == [1, 2, 3] and traj.next_step == 4

        # A trainer preempted here rebuilds its object and re-sends what it had sent.
        again = dsec.AsyncTrajectory(sb, tid)
        report = await again.resume(actions + [("echo four", {"timeout_ms": 10_000})])
        assert report.replayed == [1, 2, 3] and report.live == [4] and report.unknown == []
        assert [r.raw for r in report.results[:3]] == [r.raw for r in first]
        assert await sb.files.read("/tmp/ran") == b"x\nx\n", "nothing ran twice"

        assert await again.annotate(reward=1.0, labels=["ok"]) > 0
        info = await again.info()
        assert info.results == 4 and info.unknown == 0
        assert [row["step"] for row in await again.export(label="ok")] == [1, 2, 3, 4]
        kinds = [rec["kind"] async for rec in again.steps()]
        assert kinds.count("intent") == 4 and kinds.count("result") == 4
        await again.finish()
