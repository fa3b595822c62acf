"""The async client against the real server."""

from __future__ import annotations

import asyncio

import pytest

import dsec


@pytest.mark.asyncio
async def test_async_basic_flow(server, uid: str) -> None:
    async with server.async_client() as c:
        async with await dsec.AsyncSandbox.create(c, labels={"async": uid}) as sb:
            assert sb.state == "running"
            r = await sb.exec(["/usr/bin/python3", "-c", "print(6 * 7)"])
            assert r.ok and r.text == "42\n"

            # several execs at once on one sandbox
            results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(5)))
            assert [x.text for x in results] == [f"{i}\n" for i in range(5)]

            chunks = []
            async for ev in sb.exec_stream("echo a; sleep 0.2; echo b"):
                chunks.append(ev)
            assert chunks[-1].type == "exit" and chunks[-1].result.exit_code == 0
            assert b"".join(e.data for e in chunks if e.type == "stdout") == b"a\nb\n"

            await sb.files.write("/tmp/async.bin", b"\x00\x01\x02")
            assert await sb.files.read("/tmp/async.bin") == b"\x00\x01\x02"

            async with await sb.session("python") as py:
                await py.run("y = 5")
                assert (await py.run("print(y * 2)")).text == "10\n"

            p = await sb.spawn(["/bin/cat"])
            await p.write_stdin("ping", eof=True)
            res = await p.wait(10_000)
            assert res is not None and res.text == "ping"

            ids = [s.id async for s in c.list_sandboxes(labels={"async": uid})]
            assert ids == [sb.id]
        # destroyed on leaving the block
        try:
            gone = await c.get_sandbox(sb.id)
            assert gone.state in dsec.FINAL_STATES
        except dsec.SandboxNotFound:
            pass


@pytest.mark.asyncio
async def test_async_batch_and_errors(server, uid: str) -> None:
    async with server.async_client() as c:
        res = await c.create_sandboxes(4, labels={"abatch": uid})
        assert len(res) == 4 and not res.errors
        out = await c.delete_sandboxes(labels={"abatch": uid})
        assert sorted(i.id for i in out if i.ok) == sorted(res.ids)
        with pytest.raises(dsec.TemplateNotFound):
            await c.create_sandbox(template="missing-template-xyz")
