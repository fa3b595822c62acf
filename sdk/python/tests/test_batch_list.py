"""Batch create/delete and listing with labels and pagination."""

from __future__ import annotations

import dsec

from _util import live, sandbox_exists


def test_batch_create_20_and_delete_by_label(client: dsec.Client, uid: str) -> None:
    res = client.create_sandboxes(20, labels={"batch": uid}, ttl_ms=600_000)
    try:
        assert res.errors == []
        assert len(res) == 20
        ids = res.ids
        assert len(set(ids)) == 20
        assert all(s.state == "running" and s.labels == {"batch": uid} for s in res)
        # each one is a real sandbox
        assert res.sandboxes[0].exec("echo one").text == "one\n"
        assert res.sandboxes[19].exec("echo twenty").text == "twenty\n"
        listed = live(client.list_sandboxes(labels={"batch": uid}))
        assert listed == sorted(ids)
    finally:
        out = client.delete_sandboxes(labels={"batch": uid})
    assert sorted(i.id for i in out) == sorted(ids)
    assert all(i.ok and i.error is None for i in out), out
    assert live(client.list_sandboxes(labels={"batch": uid})) == []
    assert not sandbox_exists(client, ids[0])


def test_batch_delete_by_ids(client: dsec.Client, uid: str) -> None:
    res = client.create_sandboxes(3, labels={"bdi": uid})
    assert len(res) == 3
    out = client.delete_sandboxes(res.ids[:2])
    assert [i.ok for i in out] == [True, True]
    assert live(client.list_sandboxes(labels={"bdi": uid})) == [res.ids[2]]
    out = client.delete_sandboxes([res.ids[2], "sb-00000000deadbeef"])
    by_id = {i.id: i for i in out}
    assert by_id[res.ids[2]].ok
    bad = by_id["sb-00000000deadbeef"]
    assert not bad.ok and isinstance(bad.error, dsec.SandboxNotFound)


def test_list_filters_by_labels_and_paginates(client: dsec.Client, uid: str) -> None:
    a = client.create_sandboxes(5, labels={"grp": uid})
    b = client.create_sandboxes(3, labels={"grp": uid, "sub": "x"})
    try:
        assert len(a) == 5 and len(b) == 3
        all_ids = sorted(a.ids + b.ids)
        assert live(client.list_sandboxes(labels={"grp": uid})) == all_ids
        # labels AND together
        assert live(client.list_sandboxes(labels={"grp": uid, "sub": "x"})) == sorted(b.ids)
        assert live(client.list_sandboxes(labels={"grp": uid, "sub": "nope"})) == []
        # page by page, with a small page size: every sandbox exactly once
        seen = [s.id for s in client.list_sandboxes(labels={"grp": uid}, page_size=3)]
        assert sorted(seen) == all_ids, "pagination lost or repeated sandboxes"
        # the raw API really pages
        page = client.request_json("GET", "/v1/sandboxes", params=[("limit", 3), ("label", f"grp={uid}")])
        assert len(page["items"]) == 3 and page["next_cursor"]
        # state filter
        assert live(client.list_sandboxes(state="running", labels={"grp": uid})) == all_ids
        assert live(client.list_sandboxes(state="stopped", labels={"grp": uid})) == []
    finally:
        client.delete_sandboxes(labels={"grp": uid})
