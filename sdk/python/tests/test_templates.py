"""Templates: import a root filesystem tarball, run in it, delete it; template and pool shapes."""

from __future__ import annotations

import uuid

import pytest

import dsec

from _util import rootfs_tar


def _tiny_rootfs() -> bytes:
    """A root filesystem tarball with the host's dash and the libraries it links."""
    return rootfs_tar(
        ("bin", "etc", "tmp", "lib", "lib64", "lib/x86_64-linux-gnu", "proc", "dev"),
        (),
        ("/bin/sh",),
        {"etc/marker": b"tiny-rootfs\n"},
    )


def test_import_rootfs_template_and_run(client: dsec.Client) -> None:
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    t = client.upload_template(name, _tiny_rootfs())
    assert t.name == name
    assert name in [x.name for x in client.list_templates()]
    try:
        with dsec.Sandbox.create(client, template=name) as sb:
            assert sb.template == name
            r = sb.exec(["/bin/sh", "-c", "read x < /etc/marker; echo $x; echo ok > /tmp/w; read y < /tmp/w; echo $y"])
            assert r.ok, r
            assert r.text == "tiny-rootfs\nok\n"
            # nothing of the host's root is there
            assert not sb.files.exists("/usr/bin/python3")
            with pytest.raises(dsec.InvalidTransition):
                client.delete_template(name)
    finally:
        try:
            client.delete_template(name)
        except dsec.InvalidTransition:
            pass
    with pytest.raises(dsec.TemplateNotFound):
        client.get_template(name)


def test_import_template_is_admin_only(server) -> None:
    t = server.new_tenant()
    with pytest.raises(dsec.Forbidden):
        t.upload_template(f"nope-{uuid.uuid4().hex[:6]}", _tiny_rootfs())


def test_import_garbage_is_rejected(client: dsec.Client) -> None:
    with pytest.raises((dsec.TemplateInvalid, dsec.InvalidRequest)):
        client.upload_template(f"bad-{uuid.uuid4().hex[:6]}", b"this is not a tar archive" * 40)


def test_template_fields(client: dsec.Client) -> None:
    t = client.get_template("host")
    assert {"name", "layers", "env", "workdir", "source"} <= set(t.raw), t.raw


def test_pool_fields(client: dsec.Client) -> None:
    p = client.get_pool("host")
    want = {"template", "min", "max", "target", "ready", "creating", "hits", "misses", "hit_rate",
            "acquire_rate", "refill_ms", "peak"}
    assert want <= set(p.raw), p.raw


def test_languages_are_probed_per_template(client: dsec.Client) -> None:
    host = {l["name"] for l in client.languages()}
    assert {"python", "bash", "c", "cpp"} <= host
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    client.upload_template(name, _tiny_rootfs())
    try:
        tiny = {l["name"] for l in client.languages(name)}
        # only /bin/sh is there: no compiler, no bash
        assert not {"c", "cpp", "bash"} & tiny, tiny
        with pytest.raises(dsec.InvalidRequest):
            client.run_code("int main(){return 0;}", "c", template=name)
    finally:
        client.delete_template(name)
    with pytest.raises(dsec.TemplateNotFound):
        client.languages(name)


@pytest.mark.parametrize("substrate", ["microvm", "vm"])
def test_imported_template_in_a_vm(client: dsec.Client, substrate: str) -> None:
    """An imported template's layers become the VM's root image."""
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    client.upload_template(name, _tiny_rootfs())
    try:
        with dsec.Sandbox.create(client, template=name, substrate=substrate) as sb:
            r = sb.exec(["/bin/sh", "-c", "read x < /etc/marker; echo $x; echo ok > /tmp/w; read y < /tmp/w; echo $y"])
            assert r.ok and r.text == "tiny-rootfs\nok\n", r
            assert not sb.files.exists("/usr/bin/python3")
    finally:
        client.delete_template(name)
