"""File operations and tar transfer."""

from __future__ import annotations

import io
import tarfile

import pytest

import dsec


def test_write_read_binary_roundtrip(sandbox: dsec.Sandbox) -> None:
    blob = bytes(range(256)) * 64 + b"\x00\xff\xfe"
    sandbox.files.write("/tmp/blob.bin", blob)
    assert sandbox.files.read("/tmp/blob.bin") == blob
    # the file is really there for processes in the sandbox
    r = sandbox.exec(["/usr/bin/python3", "-c", "print(len(open('/tmp/blob.bin','rb').read()))"])
    assert r.text == f"{len(blob)}\n"
    st = sandbox.files.stat("/tmp/blob.bin")
    assert st.is_file and st.size == len(blob)
    # docs/api.md says "one entry" without saying whether `name` is the base name (as in a
    # listing) or the path asked for; the server answers the path
    assert st.name in ("blob.bin", "/tmp/blob.bin")


def test_write_text_mode_and_parents(sandbox: dsec.Sandbox) -> None:
    sandbox.files.write("/tmp/a/b/c.sh", "#!/bin/sh\necho from-script\n", mode=0o755)
    st = sandbox.files.stat("/tmp/a/b/c.sh")
    assert st.mode & 0o777 == 0o755
    assert sandbox.exec(["/tmp/a/b/c.sh"]).text == "from-script\n"
    assert sandbox.files.read_text("/tmp/a/b/c.sh").startswith("#!/bin/sh")


def test_read_max_bytes(sandbox: dsec.Sandbox) -> None:
    sandbox.files.write("/tmp/long.txt", b"0123456789" * 10)
    assert sandbox.files.read("/tmp/long.txt", max_bytes=5) == b"01234"


def test_file_written_by_exec_is_readable(sandbox: dsec.Sandbox) -> None:
    assert sandbox.exec("printf 'made\\000inside' > /tmp/made").ok
    assert sandbox.files.read("/tmp/made") == b"made\x00inside"


def test_list_mkdir_stat_remove(sandbox: dsec.Sandbox) -> None:
    sandbox.files.mkdir("/tmp/d1/d2", parents=True)
    sandbox.files.write("/tmp/d1/f.txt", b"abc")
    assert sandbox.files.stat("/tmp/d1/d2").is_dir
    names = {e.name: e for e in sandbox.files.list("/tmp/d1")}
    assert set(names) == {"d2", "f.txt"}
    assert names["d2"].is_dir and names["f.txt"].is_file and names["f.txt"].size == 3
    sandbox.files.remove("/tmp/d1/f.txt")
    assert not sandbox.files.exists("/tmp/d1/f.txt")
    sandbox.files.remove("/tmp/d1", recursive=True)
    assert not sandbox.files.exists("/tmp/d1")


def test_missing_file_is_not_found(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.NotFound) as ei:
        sandbox.files.read("/tmp/definitely-missing")
    assert ei.value.status == 404


def test_read_directory_is_wrong_file_type(sandbox: dsec.Sandbox) -> None:
    with pytest.raises(dsec.WrongFileType):
        sandbox.files.read("/tmp")


def test_tar_upload_and_download(sandbox: dsec.Sandbox) -> None:
    files = {"a.txt": b"hello\n", "sub/b.bin": bytes(range(256)), "sub/deeper/c": b""}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    sandbox.files.mkdir("/tmp/up", parents=True)
    sandbox.files.upload_tar("/tmp/up", buf.getvalue())
    for name, data in files.items():
        assert sandbox.files.read(f"/tmp/up/{name}") == data
    assert sandbox.exec("cat /tmp/up/a.txt").text == "hello\n"

    sandbox.files.write("/tmp/up/made-later", b"later")
    raw = sandbox.files.download_tar("/tmp/up")
    got = {}
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r") as tf:
        for m in tf.getmembers():
            if m.isfile():
                f = tf.extractfile(m)
                assert f is not None
                got[m.name.lstrip("./")] = f.read()
    for name, data in files.items():
        assert got.get(name) == data, (name, sorted(got))
    assert got.get("made-later") == b"later"


def test_upload_and_download_dir(sandbox: dsec.Sandbox, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "main.py").write_text("from pkg.mod import X\nprint(X)\n")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "mod.py").write_text("X = 'imported'\n")
    sandbox.files.mkdir("/workspace/proj", parents=True)
    sandbox.files.upload_dir(src, "/workspace/proj")
    r = sandbox.exec(["/usr/bin/python3", "main.py"], cwd="/workspace/proj")
    assert r.ok and r.text == "imported\n", r
    assert sandbox.exec("echo out > /workspace/proj/result.txt").ok
    dst = tmp_path / "dst"
    sandbox.files.download_dir("/workspace/proj", dst)
    assert (dst / "result.txt").read_text() == "out\n"
    assert (dst / "pkg" / "mod.py").read_text() == "X = 'imported'\n"
