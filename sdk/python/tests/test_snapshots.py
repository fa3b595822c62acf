"""Snapshots, forks and restores through the SDK, sync and async."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import dsec


def test_snapshot_fork_restore_and_tree(client: dsec.Client, uid: str) -> None:
    with client.create_sandbox(labels={"snap": uid}) as sb:
        assert sb.exec("echo one > /workspace/a").ok
        snap = sb.snapshot(labels={"t": uid})
        assert isinstance(snap, dsec.Snapshot)
        assert (snap.sandbox, snap.parent, snap.memory) == (sb.id, None, False)
        assert snap.size_bytes >= 4
        forks = sb.fork(2, labels={"snap": uid})
        try:
            assert len(forks) == 2 and forks.errors == []
            for i, f in enumerate(forks):
                assert f.exec("cat /workspace/a").text == "one\n"
                f.exec(f"echo {i} > /workspace/mine")
            assert [f.exec("cat /workspace/mine").text for f in forks] == ["0\n", "1\n"]
            child = forks.sandboxes[0].snapshot()
            assert child.parent == forks.snapshot.id
            tree = client.snapshot_tree(forks.snapshot.id)
            assert [c["id"] for c in tree["children"]] == [child.id]
        finally:
            for f in forks:
                f.destroy()
        sb.exec("rm /workspace/a; echo b > /workspace/b")
        sb.restore(snap)
        assert sb.exec("ls /workspace").text == "a\n"
        made = dsec.Sandbox.create(client, snapshot=snap.id)
        with made:
            assert made.exec("cat /workspace/a").text == "one\n"
        assert [s.id for s in client.snapshots(labels={"t": uid})] == [snap.id]
        with pytest.raises(dsec.InvalidTransition):
            client.delete_snapshot(snap.id)
    deleted = client.delete_snapshot(forks.snapshot.id, recursive=True)
    assert sorted(deleted) == sorted([forks.snapshot.id, child.id])
    assert client.delete_snapshot(snap.id, recursive=True) == [snap.id]
    with pytest.raises(dsec.SnapshotNotFound):
        client.get_snapshot(snap.id)


@pytest.mark.asyncio
async def test_async_snapshot_and_restore(server) -> None:
    async with server.async_client() as ac:
        async with await dsec.AsyncSandbox.create(ac) as sb:
            await sb.exec("echo x > /workspace/x")
            snap = await sb.snapshot()
            await sb.exec("rm /workspace/x")
            await sb.restore(snap.id)
            assert (await sb.exec("cat /workspace/x")).text == "x\n"
            assert [s.id for s in await ac.snapshots(sandbox=sb.id)] == [snap.id]
            forks = await sb.fork(1)
            assert (await forks.sandboxes[0].exec("cat /workspace/x")).text == "x\n"
            await forks.sandboxes[0].destroy()
        assert sorted(await ac.delete_snapshot(snap.id, recursive=True)) == sorted([snap.id, forks.snapshot.id])


def test_the_tree_search_example(client: dsec.Client) -> None:
    path = Path(__file__).resolve().parents[3] / "examples" / "tree_search.py"
    spec = importlib.util.spec_from_file_location("tree_search", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    found = mod.search(client)
    assert found is not None and sum(found) == mod.GOAL, found
    assert client.snapshots(labels={"example": "tree_search"}) == []
    assert not [s for s in client.list_sandboxes(labels={"example": "tree_search"}) if s.state != "stopped"]
