//! Integration tests of the template and layer store: hostile tarballs, OCI layouts,
//! `docker save` tarballs, dedup and gc, and the host mask mounted for real with overlayfs
//! (these run as root; they are never skipped).

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};
use dsec_api::ErrorCode;
use dsec_node::template::{detect_archive, detect_dir, ImageFormat};
use dsec_node::template::{
    shares_filesystem_with_root, stage_layer, unpack_layer, Digest, ImportLimits, LayerRef,
    OciSource, Template, TemplateError, TemplateSource, TemplateStore,
};
use flate2::write::GzEncoder;
#[path = "common/oci.rs"]
mod oci;
use oci::sha_hex;

use tar::EntryType::{Block, Char, Directory, Fifo, Link, Regular, Symlink};
use tar::{Builder, EntryType, Header};

// ---------------------------------------------------------------------------------------------
// tar helpers

/// Appends an entry with a raw (unvalidated) name and link name.
fn raw(
    b: &mut Builder<Vec<u8>>,
    name: &[u8],
    kind: EntryType,
    link: &[u8],
    mode: u32,
    data: &[u8],
) {
    let mut h = Header::new_gnu();
    {
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name);
        old.linkname[..link.len()].copy_from_slice(link);
    }
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(data.len() as u64);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    b.append(&h, data).expect("append");
}

fn file(b: &mut Builder<Vec<u8>>, name: &str, data: &[u8]) {
    raw(b, name.as_bytes(), EntryType::Regular, b"", 0o644, data);
}

fn dir(b: &mut Builder<Vec<u8>>, name: &str) {
    raw(b, name.as_bytes(), EntryType::Directory, b"", 0o755, b"");
}

/// A tarball member for [`raw_members`]: (name, type, link name, mode, data).
type Member<'a> = (&'a str, EntryType, &'a str, u32, &'a [u8]);

/// Appends each of `members` with [`raw`].
fn raw_members(b: &mut Builder<Vec<u8>>, members: &[Member]) {
    for &(name, kind, link, mode, data) in members {
        raw(b, name.as_bytes(), kind, link.as_bytes(), mode, data);
    }
}

/// A tarball of members written `<kind> <name> [<link or data>]`, the kind one of `f` (a file,
/// with its data), `d` (a directory), `s` (a symlink), `h` (a hard link), `c`, `b`, `p` (a
/// character or block device, a fifo).
fn tar_spec(members: &[&str]) -> Vec<u8> {
    tar_of(|b| {
        for m in members {
            let mut f = m.splitn(3, ' ');
            let kind = f.next().expect("kind");
            let name = f.next().expect("name");
            let extra = f.next().unwrap_or("");
            let (kind, mode, link, data) = match kind {
                "f" => (Regular, 0o644, "", extra),
                "d" => (Directory, 0o755, "", ""),
                "s" => (Symlink, 0o777, extra, ""),
                "h" => (Link, 0o644, extra, ""),
                "c" => (Char, 0o600, "", ""),
                "b" => (Block, 0o600, "", ""),
                "p" => (Fifo, 0o600, "", ""),
                other => panic!("unknown member kind {other}"),
            };
            raw(
                b,
                name.as_bytes(),
                kind,
                link.as_bytes(),
                mode,
                data.as_bytes(),
            );
        }
    })
}

fn tar_of(f: impl FnOnce(&mut Builder<Vec<u8>>)) -> Vec<u8> {
    let mut b = Builder::new(Vec::new());
    f(&mut b);
    b.into_inner().expect("finish tar")
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).expect("gzip");
    e.finish().expect("gzip")
}

fn limits() -> ImportLimits {
    ImportLimits::default()
}

fn open_store() -> Result<(tempfile::TempDir, TemplateStore)> {
    let dir = tempfile::tempdir()?;
    let store = TemplateStore::open(&dir.path().join("data"))?;
    Ok((dir, store))
}

/// A fresh store holding templates `one` and `two` (the same one-file layer, imported plain and
/// gzipped) and `third` (imported from the tarball `own`); returns them in that order.
fn store_sharing_a_layer(
    third: &str,
    own: &[u8],
) -> Result<(tempfile::TempDir, TemplateStore, [Template; 3])> {
    let (d, store) = open_store()?;
    let shared = tar_of(|b| file(b, "a", b"shared"));
    let t1 = store.import_rootfs_tar("one", &shared[..], &limits())?;
    let t2 = store.import_rootfs_tar("two", &gzip(&shared)[..], &limits())?;
    let t3 = store.import_rootfs_tar(third, own, &limits())?;
    Ok((d, store, [t1, t2, t3]))
}

/// Imports the OCI layout at `layout` into a fresh store, which must refuse it; returns the
/// store and the error.
fn refused_oci(layout: &Path) -> Result<(tempfile::TempDir, TemplateStore, TemplateError)> {
    let (d, store) = open_store()?;
    let err = store
        .import_oci("x", OciSource::Dir(layout), &limits())
        .err()
        .context("ok")?;
    Ok((d, store, err))
}

fn dir_is_empty(p: &Path) -> Result<bool> {
    Ok(fs::read_dir(p)?.next().is_none())
}

/// Asserts a failed import left nothing behind.
fn assert_clean(store: &TemplateStore) -> Result<()> {
    let d = store.data_dir();
    ensure!(dir_is_empty(&d.join("layers"))?, "layers left behind");
    ensure!(dir_is_empty(&d.join("tmp"))?, "tmp left behind");
    let records = fs::read_dir(d.join("templates"))?.count();
    ensure!(records == 0, "template record left behind");
    Ok(())
}

/// Imports `tar` as a rootfs under `limits`, which must refuse it for exceeding the limit
/// `what` and leave nothing behind; returns the error.
fn limit_refusal(
    store: &TemplateStore,
    tar: impl Read,
    limits: ImportLimits,
    what: &str,
) -> Result<TemplateError> {
    let err = store
        .import_rootfs_tar("t", tar, &limits)
        .err()
        .context("accepted")?;
    assert!(
        matches!(&err, TemplateError::LimitExceeded { what: w, .. } if *w == what),
        "{err:?}"
    );
    assert_clean(store)?;
    Ok(err)
}

/// Runs a shell script in a private mount namespace; returns stdout.
fn in_mount_ns(script: &str) -> Result<String> {
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-ec", script])
        .output()
        .context("run unshare")?;
    ensure!(
        out.status.success(),
        "script failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        script
    );
    Ok(String::from_utf8(out.stdout)?)
}

fn not_mounted_anywhere(p: &Path) -> Result<()> {
    let info = fs::read_to_string("/proc/self/mountinfo")?;
    ensure!(
        !info.contains(&*p.to_string_lossy()),
        "{} still mounted in the host namespace",
        p.display()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rootfs tarballs

#[test]
fn rootfs_import_basic() -> Result<()> {
    let (_d, store) = open_store()?;
    let tar = tar_of(|b| {
        dir(b, "./");
        dir(b, "./etc/");
        file(b, "./etc/hostname", b"box\n");
        raw_members(
            b,
            &[
                ("usr/bin/tool", Regular, "", 0o4755, b"#!/bin/sh\n"),
                ("tmp", Directory, "", 0o1777, b""),
                ("usr/bin/sg", Regular, "", 0o2711, b"x"),
                ("usr/bin/link", Symlink, "tool", 0o777, b""),
                ("usr/bin/hard", Link, "usr/bin/tool", 0o755, b""),
                ("/abs/file", Regular, "", 0o600, b"abs"),
                ("ro", Directory, "", 0o555, b""),
            ],
        );
        file(b, "ro/inside", b"x");
    });
    let t = store.import_rootfs_tar("base", &gzip(&tar)[..], &limits())?;
    assert_eq!(t.source, TemplateSource::RootfsTar);
    let [LayerRef::Stored { digest }] = &t.layers[..] else {
        anyhow::bail!("expected one stored layer: {:?}", t.layers);
    };
    // The digest is the sha256 of the *uncompressed* stream.
    assert_eq!(digest.hex(), sha_hex(&tar));
    let l = store.layers().path(digest);
    assert_eq!(store.lowerdirs(&t), vec![l.clone()]);
    assert_eq!(fs::read(l.join("etc/hostname"))?, b"box\n");
    let mode = |p: &str| -> Result<u32> { Ok(fs::symlink_metadata(l.join(p))?.mode() & 0o7777) };
    assert_eq!(mode("usr/bin/tool")?, 0o755, "setuid dropped");
    assert_eq!(mode("usr/bin/sg")?, 0o711, "setgid dropped");
    assert_eq!(mode("tmp")?, 0o1777, "sticky kept on dirs");
    assert_eq!(mode("ro")?, 0o555);
    assert_eq!(mode(".")?, 0o755);
    assert_eq!(
        fs::read_link(l.join("usr/bin/link"))?,
        PathBuf::from("tool")
    );
    assert_eq!(
        fs::metadata(l.join("usr/bin/hard"))?.ino(),
        fs::metadata(l.join("usr/bin/tool"))?.ino()
    );
    // Leading "/" is stripped: the entry lands inside the layer.
    assert_eq!(fs::read(l.join("abs/file"))?, b"abs");
    assert_eq!(fs::metadata(l.join("etc/hostname"))?.mtime(), 1_700_000_000);

    // Persisted, listed, retrievable.
    assert_eq!(store.get("base")?, t);
    let names: Vec<String> = store.list()?.into_iter().map(|t| t.name).collect();
    assert_eq!(names, ["host", "base"]);
    let reopened = TemplateStore::open(store.data_dir())?;
    assert_eq!(reopened.get("base")?, t);
    // Names are unique and validated.
    let again = store.import_rootfs_tar("base", &tar[..], &limits());
    assert!(matches!(again, Err(TemplateError::AlreadyExists { .. })));
    let bad = store.import_rootfs_tar("Bad/Name", &tar[..], &limits());
    assert!(matches!(bad, Err(TemplateError::InvalidName { .. })));
    Ok(())
}

/// Each hostile archive fails with the expected error and leaves nothing behind.
#[test]
fn hostile_tarballs_are_refused() -> Result<()> {
    type Case = (&'static str, Vec<u8>, fn(&TemplateError) -> bool);
    let path_escape: fn(&TemplateError) -> bool = |e| matches!(e, TemplateError::PathEscape { .. });
    let unpack: fn(&TemplateError) -> bool = |e| matches!(e, TemplateError::Unpack { .. });
    let escapes: [(&str, &[&str]); 10] = [
        ("dotdot", &["f ../x x"]),
        ("inner dotdot", &["f a/../../x x"]),
        ("dotdot dir", &["d a/.."]),
        ("symlink escape", &["s a /", "f a/etc/x x"]),
        ("relative symlink escape", &["s a ../../../..", "d a/etc"]),
        ("hardlink outside", &["h x /etc/passwd"]),
        ("hardlink dotdot", &["h x ../../../etc/passwd"]),
        ("hardlink through symlink", &["s a /etc", "h x a/passwd"]),
        ("hardlink to symlink", &["s a /etc/passwd", "h x a"]),
        ("hardlink to later entry", &["h x y", "f y y"]),
    ];
    let unpacks: [(&str, &[&str]); 5] = [
        ("char device", &["c dev/mem"]),
        ("block device", &["b dev/sda"]),
        ("fifo", &["p p"]),
        ("file under a file", &["f f", "f f/g"]),
        ("bad whiteout", &["f a/.wh."]),
    ];
    let mut cases: Vec<Case> = Vec::new();
    for (table, expect) in [(&escapes[..], path_escape), (&unpacks[..], unpack)] {
        cases.extend(
            table
                .iter()
                .map(|&(what, spec)| (what, tar_spec(spec), expect)),
        );
    }
    cases.push((
        "truncated",
        tar_of(|b| file(b, "f", &[1u8; 4096]))[..1024].to_vec(),
        |e| matches!(e, TemplateError::ReadArchive { .. }),
    ));
    for (what, tar, expect) in cases {
        let (_d, store) = open_store()?;
        for data in [tar.clone(), gzip(&tar)] {
            let err = store
                .import_rootfs_tar("evil", &data[..], &limits())
                .err()
                .with_context(|| format!("{what}: accepted"))?;
            ensure!(expect(&err), "{what}: unexpected error {err:?}");
            assert_eq!(err.code(), ErrorCode::TemplateInvalid, "{what}");
            assert_clean(&store).with_context(|| what)?;
        }
    }
    Ok(())
}

#[test]
fn limits_are_enforced_while_streaming() -> Result<()> {
    let (_d, store) = open_store()?;

    // Too many entries.
    let many = tar_of(|b| (0..50).for_each(|i| file(b, &format!("f{i}"), b"")));
    let l = ImportLimits {
        max_entries: 10,
        ..limits()
    };
    let err = limit_refusal(&store, &many[..], l, "entries")?;
    assert!(
        matches!(err, TemplateError::LimitExceeded { limit: 10, .. }),
        "{err:?}"
    );
    assert_eq!(err.code(), ErrorCode::ResourceExhausted);

    // A single file too large (refused from its header, before reading it).
    let big = tar_of(|b| file(b, "big", &[0u8; 10_000]));
    let l = ImportLimits {
        max_file_bytes: 1000,
        ..limits()
    };
    limit_refusal(&store, &big[..], l, "file size")?;

    // Path too long.
    let long = tar_of(|b| file(b, &"d/".repeat(40), b""));
    let l = ImportLimits {
        max_path_len: 50,
        ..limits()
    };
    limit_refusal(&store, &long[..], l, "path length")?;

    // A gzip bomb: 512 MiB of zeros compress to ~0.5 MiB; with max_bytes = 1 MiB unpacking
    // must stop after reading a small prefix of the compressed stream.
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::best());
    let mut h = Header::new_gnu();
    h.set_path("bomb")?;
    h.set_size(512 << 20);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    enc.write_all(h.as_bytes())?;
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..512 {
        enc.write_all(&zeros)?;
    }
    let bomb = enc.finish()?;
    struct Counting<'a>(&'a [u8], usize);
    impl Read for Counting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(buf)?;
            self.1 += n;
            Ok(n)
        }
    }
    let mut reader = Counting(&bomb, 0);
    let l = ImportLimits {
        max_bytes: 1 << 20,
        ..limits()
    };
    limit_refusal(&store, &mut reader, l, "total bytes")?;
    assert!(
        reader.1 < bomb.len() / 4,
        "read {} of {} compressed bytes",
        reader.1,
        bomb.len()
    );

    // Zstd is refused, not misparsed.
    let zstd = [0x28u8, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0];
    let err = store
        .import_rootfs_tar("t", &zstd[..], &limits())
        .err()
        .context("accepted")?;
    assert!(matches!(err, TemplateError::Unsupported { .. }), "{err:?}");
    assert_clean(&store)?;
    Ok(())
}

#[test]
fn dedup_delete_and_gc() -> Result<()> {
    let other = tar_of(|b| file(b, "b", b"other"));
    let (_d, store, [t1, t2, t3]) = store_sharing_a_layer("three", &other)?;
    assert_eq!(t1.layers, t2.layers, "identical layers dedup");
    assert_eq!(store.layers().list()?.len(), 2);

    assert!(matches!(
        store.delete("host"),
        Err(TemplateError::Builtin { .. })
    ));
    let err = store.get("nope").err().context("found")?;
    assert!(matches!(err, TemplateError::NotFound { .. }));
    assert_eq!(err.code(), ErrorCode::TemplateNotFound);
    assert_eq!(
        store.delete("nope").err().map(|e| e.code()),
        Some(ErrorCode::TemplateNotFound)
    );

    store.delete("one")?;
    assert!(store.gc_layers()?.is_empty(), "layer still used by 'two'");
    store.delete("two")?;
    store.delete("three")?;
    let mut removed = store.gc_layers()?;
    removed.sort();
    let mut expected: Vec<Digest> = [&t1, &t3]
        .iter()
        .filter_map(|t| match &t.layers[0] {
            LayerRef::Stored { digest } => Some(digest.clone()),
            _ => None,
        })
        .collect();
    expected.sort();
    assert_eq!(removed, expected);
    assert_clean(&store)?;
    Ok(())
}

/// A plain root filesystem (even one holding a `manifest.json` below the top) is told apart
/// from an image; zstd is refused; the entry bound holds while headers are read.
#[test]
fn archive_formats_are_detected() -> Result<()> {
    let rootfs = tar_of(|b| {
        dir(b, "./");
        dir(b, "./etc/");
        file(b, "./etc/manifest.json", b"{}");
        file(b, "./etc/motd", b"hi");
    });
    assert_eq!(detect_archive(&rootfs[..], &limits())?, ImageFormat::Rootfs);
    assert_eq!(
        detect_archive(&gzip(&rootfs)[..], &limits())?,
        ImageFormat::Rootfs
    );
    let few = ImportLimits {
        max_entries: 2,
        ..limits()
    };
    assert!(matches!(
        detect_archive(&rootfs[..], &few),
        Err(TemplateError::LimitExceeded {
            what: "entries",
            ..
        })
    ));
    let zstd = [0x28u8, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0];
    assert!(matches!(
        detect_archive(&zstd[..], &limits()),
        Err(TemplateError::Unsupported { .. })
    ));
    let oci = tar_of(|b| file(b, "./oci-layout", b"{}"));
    assert_eq!(detect_archive(&oci[..], &limits())?, ImageFormat::OciLayout);
    let plain = tempfile::tempdir()?;
    assert_eq!(detect_dir(plain.path()), ImageFormat::Rootfs);
    Ok(())
}

/// `remove` deletes a template and its unshared layers, refuses one a sandbox uses, and keeps
/// the layers of a sandbox whose create read the template just before the delete.
#[test]
fn remove_frees_unshared_layers_and_spares_those_in_use() -> Result<()> {
    use std::collections::BTreeSet;
    let own = tar_of(|b| file(b, "b", b"own"));
    let (_d, store, [_, _, solo]) = store_sharing_a_layer("solo", &own)?;
    let none = || BTreeSet::new();
    let solo_in_use = || BTreeSet::from(["solo".to_owned()]);
    assert!(matches!(
        store.remove("solo", &solo_in_use),
        Err(TemplateError::InUse { .. })
    ));
    assert_eq!(
        store.remove("solo", &solo_in_use).err().map(|e| e.code()),
        Some(ErrorCode::InvalidTransition)
    );
    assert!(matches!(
        store.remove("host", &none),
        Err(TemplateError::Builtin { .. })
    ));
    assert!(matches!(
        store.remove("nope", &none),
        Err(TemplateError::NotFound { .. })
    ));
    assert!(
        store.remove("one", &none)?.is_empty(),
        "`two` shares the layer"
    );
    assert_eq!(store.layers().list()?.len(), 2);

    // A create that read `solo` before the delete shows up only after it: its layer stays,
    // and while that sandbox lives no later removal collects layers.
    let calls = std::cell::Cell::new(0);
    let raced = || {
        calls.set(calls.get() + 1);
        if calls.get() == 1 {
            BTreeSet::new()
        } else {
            BTreeSet::from(["solo".to_owned()])
        }
    };
    assert!(store.remove("solo", &raced)?.is_empty());
    assert!(matches!(
        store.get("solo"),
        Err(TemplateError::NotFound { .. })
    ));
    assert!(
        store.remove("two", &solo_in_use)?.is_empty(),
        "solo's sandbox lives on"
    );
    assert_eq!(store.layers().list()?.len(), 2);
    store.import_rootfs_tar("again", &own[..], &limits())?;
    let removed = store.remove("again", &none)?;
    assert_eq!(
        removed.len(),
        2,
        "both layers go once nothing uses them: {removed:?}"
    );
    assert!(matches!(&solo.layers[0], LayerRef::Stored { digest } if removed.contains(digest)));
    assert_clean(&store)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// OCI layouts and docker save

struct Image {
    layers: Vec<Vec<u8>>, // uncompressed tars
    gzip: Vec<bool>,
}

fn test_image() -> Image {
    let l1 = tar_of(|b| {
        dir(b, "etc/");
        file(b, "etc/keep", b"keep");
        file(b, "etc/gone", b"gone");
        dir(b, "opt/");
        dir(b, "opt/d/");
        file(b, "opt/d/a", b"a");
        file(b, "opt/d/b", b"b");
        dir(b, "srv/");
        file(b, "srv/x", b"x");
    });
    let l2 = tar_of(|b| {
        dir(b, "etc/");
        file(b, "etc/.wh.gone", b"");
        dir(b, "opt/d/");
        file(b, "opt/d/.wh..wh..opq", b"");
        file(b, "opt/d/c", b"c");
        file(b, ".wh.srv", b"");
        file(b, ".wh..wh.plnk", b"");
    });
    Image {
        layers: vec![l1, l2],
        gzip: vec![false, true],
    }
}

fn config_json(img: &Image) -> Vec<u8> {
    oci::config_json(
        &img.layers,
        serde_json::json!({"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "WorkingDir": "/app", "User": "1000"}),
    )
}

/// Writes an OCI image layout into `dir`; returns the manifest digest.
fn write_oci_layout(dir: &Path, img: &Image, config: &[u8]) -> Result<String> {
    let layers: Vec<(Vec<u8>, &str)> = img
        .layers
        .iter()
        .zip(&img.gzip)
        .map(|(l, gz)| {
            if *gz {
                (gzip(l), "application/vnd.oci.image.layer.v1.tar+gzip")
            } else {
                (l.clone(), "application/vnd.oci.image.layer.v1.tar")
            }
        })
        .collect();
    Ok(oci::write_layout(dir, config, &layers, true))
}

/// Tars a directory (paths relative to it).
fn tar_dir(dir: &Path) -> Result<Vec<u8>> {
    let mut b = Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir)?;
    Ok(b.into_inner()?)
}

fn check_image_template(store: &TemplateStore, t: &Template) -> Result<()> {
    assert_eq!(
        t.env,
        vec![
            ("PATH".to_owned(), "/usr/bin:/bin".to_owned()),
            ("LANG".to_owned(), "C.UTF-8".to_owned())
        ]
    );
    assert_eq!(t.workdir, "/app");
    assert_eq!(t.user.as_deref(), Some("1000"));
    assert_eq!(t.layers.len(), 2);
    let lower = store.lowerdirs(t);
    // Topmost first.
    let top = &lower[0];
    assert!(fs::symlink_metadata(top.join("etc/gone"))?
        .file_type()
        .is_char_device());
    assert_eq!(fs::symlink_metadata(top.join("etc/gone"))?.rdev(), 0);
    assert!(fs::symlink_metadata(top.join("srv"))?
        .file_type()
        .is_char_device());
    assert!(fs::symlink_metadata(top.join(".wh..wh.plnk")).is_err());
    let mut buf = [0u8; 4];
    let n = rustix::fs::lgetxattr(top.join("opt/d"), "trusted.overlay.opaque", &mut buf[..])?;
    assert_eq!(&buf[..n], b"y");
    assert!(lower[1].join("etc/gone").is_file());

    // The merged view hides exactly what the whiteouts say.
    let tmp = tempfile::tempdir()?;
    let mnt = tmp.path().join("m");
    fs::create_dir(&mnt)?;
    let lowerdir: Vec<String> = lower.iter().map(|p| p.display().to_string()).collect();
    let out = in_mount_ns(&format!(
        "mount -t overlay overlay -o ro,lowerdir={} {m}; cd {m}; ls -A etc; echo --; ls -A opt/d; echo --; ls -A",
        lowerdir.join(":"),
        m = mnt.display()
    ))?;
    assert_eq!(out, "keep\n--\nc\n--\netc\nopt\n", "merged view");
    not_mounted_anywhere(&mnt)?;
    Ok(())
}

#[test]
fn oci_layout_dir_and_tar() -> Result<()> {
    let (_d, store) = open_store()?;
    let img = test_image();
    let layout = tempfile::tempdir()?;
    let mh = write_oci_layout(layout.path(), &img, &config_json(&img))?;
    let t = store.import_oci("img", OciSource::Dir(layout.path()), &limits())?;
    assert_eq!(
        t.source,
        TemplateSource::Oci {
            manifest: Digest::from_hex(&mh).context("digest")?
        }
    );
    let digests: Vec<String> = t
        .layers
        .iter()
        .filter_map(|l| match l {
            LayerRef::Stored { digest } => Some(digest.hex().to_owned()),
            _ => None,
        })
        .collect();
    let want: Vec<String> = img.layers.iter().map(|l| sha_hex(l)).collect();
    assert_eq!(digests, want, "digests are diff_ids, bottom to top");
    check_image_template(&store, &t)?;

    // The same layout as a (gzip'd) tar stream: same layers, deduplicated.
    let tarred = gzip(&tar_dir(layout.path())?);
    assert_eq!(
        detect_archive(&tarred[..], &limits())?,
        ImageFormat::OciLayout
    );
    assert_eq!(detect_dir(layout.path()), ImageFormat::OciLayout);
    let t2 = store.import_oci("img2", OciSource::Tar(&mut &tarred[..]), &limits())?;
    assert_eq!(t2.layers, t.layers);
    assert_eq!(store.layers().list()?.len(), 2);
    assert!(dir_is_empty(&store.data_dir().join("tmp"))?);

    // Too many layers.
    let l = ImportLimits {
        max_layers: 1,
        ..limits()
    };
    let err = store
        .import_oci("img3", OciSource::Dir(layout.path()), &l)
        .err()
        .context("ok")?;
    assert!(
        matches!(err, TemplateError::LimitExceeded { what: "layers", .. }),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn docker_save_tarball() -> Result<()> {
    let (_d, store) = open_store()?;
    let img = test_image();
    let config = config_json(&img);
    let ch = sha_hex(&config);
    let tar = tar_of(|b| {
        file(b, &format!("{ch}.json"), &config);
        let mut layers = Vec::new();
        for (i, l) in img.layers.iter().enumerate() {
            let id = format!("{i:064x}");
            dir(b, &format!("{id}/"));
            let data = if img.gzip[i] { gzip(l) } else { l.clone() };
            file(b, &format!("{id}/layer.tar"), &data);
            layers.push(format!("{id}/layer.tar"));
        }
        let manifest = serde_json::to_vec(&serde_json::json!([
            {"Config": format!("{ch}.json"), "RepoTags": ["x:latest"], "Layers": layers}
        ]))
        .expect("json");
        file(b, "manifest.json", &manifest);
    });
    assert_eq!(
        detect_archive(&tar[..], &limits())?,
        ImageFormat::DockerSave
    );
    let t = store.import_oci("saved", OciSource::Tar(&mut &tar[..]), &limits())?;
    assert_eq!(t.source, TemplateSource::DockerSave);
    check_image_template(&store, &t)?;
    Ok(())
}

#[test]
fn digest_mismatches_are_refused() -> Result<()> {
    let img = test_image();

    // A layer blob whose content does not match its descriptor.
    let layout = tempfile::tempdir()?;
    write_oci_layout(layout.path(), &img, &config_json(&img))?;
    let victim = layout
        .path()
        .join("blobs/sha256")
        .join(sha_hex(&img.layers[0]));
    let mut tampered = img.layers[0].clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 1; // in the end-of-archive padding: parses fine, hashes differently
    fs::write(&victim, &tampered)?;
    let (_d, store, err) = refused_oci(layout.path())?;
    assert!(
        matches!(err, TemplateError::DigestMismatch { .. }),
        "{err:?}"
    );
    assert_eq!(err.code(), ErrorCode::TemplateInvalid);
    assert_clean(&store)?;

    // A config whose diff_ids do not match the layers.
    let layout = tempfile::tempdir()?;
    let mut other = test_image();
    other.layers[1] = tar_of(|b| file(b, "z", b"z"));
    let bad_config = config_json(&other);
    write_oci_layout(layout.path(), &img, &bad_config)?;
    let (_d, store, err) = refused_oci(layout.path())?;
    assert!(
        matches!(err, TemplateError::DigestMismatch { .. }),
        "{err:?}"
    );
    // The first (valid) layer may stay in the store, but no template refers to it and gc
    // removes it.
    assert!(matches!(
        store.get("x"),
        Err(TemplateError::NotFound { .. })
    ));
    store.gc_layers()?;
    assert_clean(&store)?;

    // Not an image at all.
    let empty = tempfile::tempdir()?;
    let (_d, _, err) = refused_oci(empty.path())?;
    assert!(matches!(err, TemplateError::InvalidImage { .. }), "{err:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The host template

#[test]
fn host_template_masks_secrets_under_overlayfs() -> Result<()> {
    let (_d, store) = open_store()?;
    let host = store.get("host")?;
    assert_eq!(host.source, TemplateSource::Host);
    let lower = store.lowerdirs(&host);
    assert_eq!(lower.len(), 2);
    assert_eq!(lower[1], PathBuf::from("/"));
    let mask = &lower[0];
    assert!(store.delete("host").is_err());

    // overlayfs refuses a lowerdir nested in another on the same filesystem; the runtime
    // stages the mask on its tmpfs. /dev/shm is a tmpfs the test can use without mounting.
    let shm = tempfile::tempdir_in("/dev/shm")?;
    let staged = shm.path().join("mask");
    let mask_dir = if shares_filesystem_with_root(mask)? {
        stage_layer(mask, &staged)?;
        staged
    } else {
        mask.clone()
    };
    let (u, w, m) = (
        shm.path().join("u"),
        shm.path().join("w"),
        shm.path().join("m"),
    );
    for d in [&u, &w, &m] {
        fs::create_dir(d)?;
    }
    let script = format!(
        "mount -t overlay overlay -o lowerdir={mask}:/,upperdir={u},workdir={w} {m}
         echo root:$(ls -A {m}/root | wc -l)
         echo work:$(ls -A {m}/work | wc -l)
         echo tmp:$(ls -A {m}/tmp | wc -l):$(stat -c %a {m}/tmp)
         test -e {m}/etc/shadow && echo shadow:present || echo shadow:absent
         test -e {m}/etc/passwd && echo passwd:present || echo passwd:absent
         test -x {m}/usr/bin/python3 && echo python:present || echo python:absent
         ls {m}/etc/ssh/ssh_host_* 2>/dev/null | wc -l | sed s/^/hostkeys:/
         test -e {m}/{data} && echo data:visible || echo data:hidden",
        mask = mask_dir.display(),
        u = u.display(),
        w = w.display(),
        m = m.display(),
        data = store.data_dir().display(),
    );
    let out = in_mount_ns(&script)?;
    for want in [
        "root:0",
        "work:0",
        "tmp:0:1777",
        "shadow:absent",
        "passwd:present",
        "python:present",
        "hostkeys:0",
        "data:hidden",
    ] {
        ensure!(out.lines().any(|l| l == want), "missing {want:?} in\n{out}");
    }
    not_mounted_anywhere(&m)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Fuzz-style property tests of the unpacker

mod prop {
    use super::*;
    use proptest::prelude::*;

    fn component() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(b"..".to_vec()),
            Just(b".".to_vec()),
            Just(b"".to_vec()),
            Just(b"a".to_vec()),
            Just(b"b".to_vec()),
            Just(b".wh.a".to_vec()),
            Just(b".wh..wh..opq".to_vec()),
            proptest::collection::vec(any::<u8>(), 1..6),
        ]
    }

    fn name() -> impl Strategy<Value = Vec<u8>> {
        (any::<bool>(), proptest::collection::vec(component(), 1..4)).prop_map(|(abs, comps)| {
            let mut n = if abs { b"/".to_vec() } else { Vec::new() };
            n.extend(comps.join(&b'/'));
            n.truncate(99);
            n
        })
    }

    fn kind() -> impl Strategy<Value = EntryType> {
        prop_oneof![
            Just(EntryType::Regular),
            Just(EntryType::Directory),
            Just(EntryType::Symlink),
            Just(EntryType::Link),
            Just(EntryType::Char),
            Just(EntryType::Fifo),
            any::<u8>().prop_map(EntryType::new),
        ]
    }

    /// Unpacks `data` into `<parent>/dest` and checks nothing exists outside `dest`.
    fn check_contained(data: &[u8]) -> Result<(), TestCaseError> {
        let parent = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let dest = parent.path().join("dest");
        fs::create_dir(&dest).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let _ = unpack_layer(
            data,
            &dest,
            &ImportLimits {
                max_bytes: 1 << 20,
                ..limits()
            },
        );
        let outside: Vec<_> = fs::read_dir(parent.path())
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        prop_assert_eq!(outside, vec![std::ffi::OsString::from("dest")]);
        let real_dest = dest
            .canonicalize()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut stack = vec![dest.clone()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).map_err(|e| TestCaseError::fail(e.to_string()))? {
                let p = e.map_err(|e| TestCaseError::fail(e.to_string()))?.path();
                let m = fs::symlink_metadata(&p).map_err(|e| TestCaseError::fail(e.to_string()))?;
                // Every real (non-symlink) entry resolves inside the destination.
                if !m.file_type().is_symlink() {
                    let real = p
                        .canonicalize()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(real.starts_with(&real_dest), "{} outside", real.display());
                    prop_assert!(
                        m.mode() & 0o6000 == 0,
                        "setuid/setgid kept on {}",
                        p.display()
                    );
                    let ft = m.file_type();
                    if ft.is_char_device() {
                        prop_assert_eq!(m.rdev(), 0, "only whiteouts");
                    }
                    prop_assert!(!ft.is_block_device() && !ft.is_fifo() && !ft.is_socket());
                }
                if m.is_dir() {
                    stack.push(p);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_escape(data in proptest::collection::vec(any::<u8>(), 0..4096)) {
            check_contained(&data)?;
            check_contained(&gzip(&data))?;
        }

        #[test]
        fn arbitrary_entries_never_escape(
            entries in proptest::collection::vec(
                (name(), kind(), name(), any::<u32>(), proptest::collection::vec(any::<u8>(), 0..8)),
                1..12,
            )
        ) {
            let tar = tar_of(|b| {
                for (n, k, link, mode, data) in &entries {
                    raw(b, n, *k, link, mode & 0o7777, data);
                }
            });
            check_contained(&tar)?;
        }
    }
}

/// A cluster node keeps each layer's blob (the bytes its digest is of); a layer fetched from
/// elsewhere must hash to its digest, and a template is adopted only once all its layers are
/// here.
#[test]
fn kept_blobs_verify_fetches_and_adoption() -> Result<()> {
    let (_d1, origin) = open_store()?;
    origin.layers().keep_blobs()?;
    let tar = tar_of(|b| file(b, "etc/motd", b"kept\n"));
    let t = origin.import_rootfs_tar("kept", gzip(&tar).as_slice(), &limits())?;
    let LayerRef::Stored { digest } = &t.layers[0] else {
        anyhow::bail!("a stored layer: {t:?}");
    };
    let blob = origin.layers().blob(digest).context("the blob is kept")?;
    // The blob is the uncompressed tar: it hashes to the layer's digest.
    ensure!(
        fs::read(&blob)? == tar,
        "the blob is the uncompressed stream"
    );
    ensure!(format!("sha256:{}", sha_hex(&tar)) == digest.to_string());

    let (_d2, node) = open_store()?;
    // A template whose layers are not here is not adopted.
    ensure!(node.adopt(&t).is_err(), "adopted without its layers");
    // A copy that does not hash to the digest is refused, and leaves nothing.
    let other = tar_of(|b| file(b, "etc/motd", b"tampered\n"));
    let refused = node.fetch_layer(other.as_slice(), digest, &limits());
    ensure!(
        matches!(refused, Err(TemplateError::DigestMismatch { .. })),
        "{refused:?}"
    );
    ensure!(!node.layers().contains(digest));
    assert_clean(&node)?;
    let bytes = node.fetch_layer(fs::File::open(&blob)?, digest, &limits())?;
    ensure!(
        bytes == tar.len() as u64,
        "{bytes} bytes read of {}",
        tar.len()
    );
    ensure!(node.fetch_layer(fs::File::open(&blob)?, digest, &limits())? == 0);
    node.adopt(&t)?;
    ensure!(node.get("kept")? == t);
    // Without keep_blobs, no blob.
    ensure!(node.layers().blob(digest).is_none());
    Ok(())
}
