//! End-to-end tests of imported templates: a minimal root filesystem built from host binaries
//! (`sh`, `echo`, `cat` and their shared libraries) is imported as a rootfs tarball and as a
//! two-layer OCI layout, and sandboxes are created from it for real. Run as root, never skipped.
//!
//! Every test holds [`SERIAL`] and compares the [`LeakSnapshot`](common::LeakSnapshot) taken
//! at its start with the one at its end.

mod common;
#[path = "common/oci.rs"]
mod oci;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use common::{create_spec, rt, stderr, stdout, SbGuard};
use dsec_api::exec::ExecStatus;
use dsec_api::ErrorCode;
use dsec_node::sandbox::SandboxSpec;
use dsec_node::substrate::RuntimeError;
use dsec_node::template::{ImportLimits, LayerRef, OciSource, Template};
use tar::{Builder, EntryType, Header};

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs a test's `body` alone, checking it leaves nothing behind.
fn isolated(body: impl FnOnce()) {
    common::leak_checked(&SERIAL, SETTLE, body);
}

const SETTLE: Duration = Duration::from_secs(10);

const HELLO: &[u8] = b"hello from the mini template\n";

// ---------------------------------------------------------------------------------------------
// building the minimal root filesystem

/// A template name unique to this process and call.
fn unique_name(prefix: &str) -> String {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{nanos:08x}-{n}", std::process::id())
}

/// Shared libraries `ldd` reports for `bin` (absolute paths as the loader looks them up).
fn needed_libs(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .unwrap_or_else(|e| panic!("run ldd {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "ldd {} failed: {out:?}",
        bin.display()
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`; `linux-vdso.so.1 (0x...)` has no file.
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    assert!(
        !libs.is_empty(),
        "ldd found no libraries for {}: {text}",
        bin.display()
    );
    libs
}

/// Appends a directory entry.
fn tar_dir_entry(b: &mut Builder<Vec<u8>>, name: &str, mode: u32) {
    let mut h = Header::new_gnu();
    h.set_entry_type(EntryType::Directory);
    h.set_mode(mode);
    h.set_size(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    b.append_data(&mut h, format!("{}/", name.trim_end_matches('/')), &[][..])
        .unwrap_or_else(|e| panic!("append dir {name}: {e}"));
}

/// Appends a regular file entry.
fn tar_file_entry(b: &mut Builder<Vec<u8>>, name: &str, mode: u32, data: &[u8]) {
    let mut h = Header::new_gnu();
    h.set_entry_type(EntryType::Regular);
    h.set_mode(mode);
    h.set_size(data.len() as u64);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    b.append_data(&mut h, name, data)
        .unwrap_or_else(|e| panic!("append file {name}: {e}"));
}

/// The files of the minimal rootfs: tar path → (mode, contents). Every host path is resolved
/// (symlinks followed) and stored as a regular file at the path it is looked up by.
fn mini_rootfs_files() -> BTreeMap<String, (u32, Vec<u8>)> {
    let echo = ["/usr/bin/echo", "/bin/echo"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .expect("an echo binary on the host");
    let bins: [(&str, &Path); 3] = [
        ("bin/sh", Path::new("/bin/sh")),
        ("bin/echo", echo),
        ("bin/cat", Path::new("/bin/cat")),
    ];
    let mut files = BTreeMap::new();
    let mut libs = BTreeSet::new();
    for (dest, src) in bins {
        let real = src
            .canonicalize()
            .unwrap_or_else(|e| panic!("resolve {}: {e}", src.display()));
        let data = fs::read(&real).unwrap_or_else(|e| panic!("read {}: {e}", real.display()));
        files.insert(dest.to_owned(), (0o755, data));
        libs.extend(needed_libs(&real));
    }
    for lib in libs {
        let real = lib
            .canonicalize()
            .unwrap_or_else(|e| panic!("resolve {}: {e}", lib.display()));
        let data = fs::read(&real).unwrap_or_else(|e| panic!("read {}: {e}", real.display()));
        let dest = lib
            .to_str()
            .expect("utf-8 library path")
            .trim_start_matches('/')
            .to_owned();
        files.insert(dest, (0o755, data));
    }
    files.insert("etc/hello".to_owned(), (0o644, HELLO.to_vec()));
    files
}

/// A root filesystem tarball: the files of [`mini_rootfs_files`], every parent directory, and
/// the empty directories `tmp` (1777), `root`, `home`, `etc`.
fn mini_rootfs_tar() -> Vec<u8> {
    let files = mini_rootfs_files();
    let mut dirs: BTreeMap<String, u32> = BTreeMap::new();
    for (d, mode) in [
        ("tmp", 0o1777),
        ("root", 0o700),
        ("home", 0o755),
        ("etc", 0o755),
    ] {
        dirs.insert(d.to_owned(), mode);
    }
    for path in files.keys() {
        let mut p = Path::new(path).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.entry(d.to_str().expect("utf-8").to_owned())
                .or_insert(0o755);
            p = d.parent();
        }
    }
    let mut b = Builder::new(Vec::new());
    // BTreeMap order puts every parent before its children.
    for (d, mode) in &dirs {
        tar_dir_entry(&mut b, d, *mode);
    }
    for (path, (mode, data)) in &files {
        tar_file_entry(&mut b, path, *mode, data);
    }
    b.into_inner().expect("finish tar")
}

/// The second layer of the OCI image: deletes `etc/hello` (whiteout) and adds `etc/added`.
///
/// It also adds an empty `var/`: the runtime cannot create its `/var/tmp` scratch directory on
/// a read-only root without it (see `template_e2e_rootfs_tar_runs_isolated_from_the_host`), and
/// this test is about the whiteout.
fn whiteout_layer_tar() -> Vec<u8> {
    let mut b = Builder::new(Vec::new());
    tar_dir_entry(&mut b, "var", 0o755);
    tar_dir_entry(&mut b, "etc", 0o755);
    tar_file_entry(&mut b, "etc/.wh.hello", 0o644, b"");
    tar_file_entry(&mut b, "etc/added", 0o644, b"from layer two\n");
    b.into_inner().expect("finish tar")
}

/// Writes an OCI image layout with `layers` (uncompressed tars, bottom first) into `dir`.
fn write_oci_layout(dir: &Path, layers: &[Vec<u8>]) {
    let config = oci::config_json(
        layers,
        serde_json::json!({"Env": ["PATH=/usr/bin:/bin", "FROM_IMAGE=yes"]}),
    );
    let layers: Vec<(Vec<u8>, &str)> = layers
        .iter()
        .map(|l| (l.clone(), "application/vnd.oci.image.layer.v1.tar"))
        .collect();
    oci::write_layout(dir, &config, &layers, false);
}

/// Deletes a template record when dropped (its layers stay: no gc while other tests run).
struct TemplateGuard(String);

impl Drop for TemplateGuard {
    fn drop(&mut self) {
        let _ = rt().templates().delete(&self.0);
    }
}

fn import_mini() -> (Template, TemplateGuard) {
    let name = unique_name("mini");
    let tar = mini_rootfs_tar();
    let t = rt()
        .templates()
        .import_rootfs_tar(&name, &tar[..], &ImportLimits::default())
        .expect("import the mini rootfs");
    assert_eq!(t.layers.len(), 1);
    (t, TemplateGuard(name))
}

/// Names, sizes, modes and mtimes of everything under `dir` (recursively).
fn tree_listing(dir: &Path) -> BTreeMap<PathBuf, (u64, u32, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap_or_else(|e| panic!("read {}: {e}", d.display())) {
            let e = e.expect("dir entry");
            let md = fs::symlink_metadata(e.path()).expect("metadata");
            if md.is_dir() {
                stack.push(e.path());
            }
            let rel = e.path().strip_prefix(dir).expect("under dir").to_path_buf();
            out.insert(rel, (md.len(), md.mode(), md.mtime()));
        }
    }
    out
}

fn stored_layer_dir(t: &Template, i: usize) -> PathBuf {
    match &t.layers[i] {
        LayerRef::Stored { digest } => rt().templates().layers().path(digest),
        other => panic!("layer {i} of {} is not stored: {other:?}", t.name),
    }
}

/// Runs a shell script, asserts it exited 0, returns its stdout.
fn sh_ok(sb: &mut SbGuard, script: &str) -> String {
    let r = sb.sh(script, 10_000);
    assert_eq!(
        r.status,
        ExecStatus::Ok,
        "`{script}` in {}: stdout {:?} stderr {:?}",
        sb.id(),
        stdout(&r),
        stderr(&r)
    );
    stdout(&r)
}

fn exists_in(sb: &mut SbGuard, path: &str) -> bool {
    let out = sh_ok(
        sb,
        &format!("if test -e {path}; then echo yes; else echo no; fi"),
    );
    match out.as_str() {
        "yes\n" => true,
        "no\n" => false,
        other => panic!("test -e {path}: {other:?}"),
    }
}

/// Destroys the sandbox and asserts its cgroup and run dir are gone.
fn destroy_and_assert_gone(sb: SbGuard) {
    let id = sb.id().to_owned();
    sb.destroy().expect("destroy");
    assert_gone(&id);
}

/// Asserts the sandbox's cgroup and run dir are gone.
fn assert_gone(id: &str) {
    assert!(rt().cgroups().open(id).is_none(), "cgroup of {id} left");
    let run = common::fixture().run_dir.join("sandboxes").join(id);
    assert!(!run.exists(), "{} left", run.display());
}

// ---------------------------------------------------------------------------------------------
// tests

/// The rootfs has no `/var`: a read-only-root sandbox must still start (the runtime's scratch
/// directories, e.g. `/var/tmp`, are its business, not the template author's).
#[test]
fn template_e2e_rootfs_tar_runs_isolated_from_the_host() {
    isolated(|| {
        let (t, _tg) = import_mini();
        let mut sb = create_spec(&SandboxSpec {
            template: t.name.clone(),
            ..Default::default()
        });

        let out = sh_ok(&mut sb, "cat /etc/hello; echo ok > /tmp/x; cat /tmp/x");
        assert_eq!(out.as_bytes(), [HELLO, b"ok\n"].concat());

        // Only what the template holds is there.
        assert!(exists_in(&mut sb, "/bin/cat"));
        assert!(
            !exists_in(&mut sb, "/usr/bin/python3"),
            "host python visible"
        );
        let host_passwd = fs::read("/etc/passwd").expect("host /etc/passwd");
        let r = sb.sh("cat /etc/passwd", 10_000);
        assert_ne!(
            r.stdout.data, host_passwd,
            "the host's /etc/passwd is visible"
        );
        assert!(!exists_in(&mut sb, "/etc/passwd"), "/etc/passwd exists");
        assert!(
            !exists_in(&mut sb, "/usr/bin/dash"),
            "host /usr/bin visible"
        );

        // Read-only root: writes to /etc fail, and nothing reaches the layer store.
        let layer_etc = stored_layer_dir(&t, 0).join("etc");
        let before = tree_listing(&layer_etc);
        let r = sb.sh("echo x > /etc/new", 10_000);
        assert_ne!(r.status, ExecStatus::Ok, "write to /etc succeeded: {r:?}");
        assert!(!exists_in(&mut sb, "/etc/new"));
        let r = sb.sh("echo x >> /etc/hello", 10_000);
        assert_ne!(
            r.status,
            ExecStatus::Ok,
            "append to /etc/hello succeeded: {r:?}"
        );
        assert_eq!(sh_ok(&mut sb, "cat /etc/hello").as_bytes(), HELLO);
        assert_eq!(tree_listing(&layer_etc), before, "the layer changed");

        destroy_and_assert_gone(sb);
    });
}

#[test]
fn template_e2e_writable_root_stays_private_and_reset_drops_it() {
    isolated(|| {
        let (t, _tg) = import_mini();
        let layer = stored_layer_dir(&t, 0);
        let before = tree_listing(&layer);
        let hello_before = fs::read(layer.join("etc/hello")).expect("layer etc/hello");
        let mut sb = create_spec(&SandboxSpec {
            template: t.name.clone(),
            writable_root: true,
            ..Default::default()
        });
        sb.mark_acquired().expect("mark acquired");

        let out = sh_ok(
            &mut sb,
            "echo new > /etc/new; echo more >> /etc/hello; echo tmp > /tmp/x; cat /etc/new /tmp/x",
        );
        assert_eq!(out, "new\ntmp\n");
        assert_eq!(
            sh_ok(&mut sb, "cat /etc/hello").as_bytes(),
            [HELLO, b"more\n"].concat()
        );
        // The writes landed in the sandbox's private upper layer, not in the shared layer.
        assert_eq!(tree_listing(&layer), before, "the stored layer changed");
        assert_eq!(
            fs::read(layer.join("etc/hello")).expect("layer etc/hello"),
            hello_before
        );
        assert!(!layer.join("etc/new").exists());

        // A reset gives a fresh writable layer.
        sb.reset().expect("reset");
        sb.mark_acquired().expect("mark acquired again");
        assert!(!exists_in(&mut sb, "/tmp/x"), "/tmp survived the reset");
        assert!(
            !exists_in(&mut sb, "/etc/new"),
            "/etc/new survived the reset"
        );
        assert_eq!(sh_ok(&mut sb, "cat /etc/hello").as_bytes(), HELLO);
        assert_eq!(
            sh_ok(&mut sb, "echo again > /etc/new; cat /etc/new"),
            "again\n"
        );

        destroy_and_assert_gone(sb);
        assert_eq!(tree_listing(&layer), before, "the stored layer changed");
    });
}

#[test]
fn template_e2e_oci_layout_whiteout_hides_the_file() {
    isolated(|| {
        let img = tempfile::tempdir().expect("tempdir");
        write_oci_layout(img.path(), &[mini_rootfs_tar(), whiteout_layer_tar()]);

        // From the directory.
        let name = unique_name("mini-oci");
        let _tg = TemplateGuard(name.clone());
        let t = rt()
            .templates()
            .import_oci(&name, OciSource::Dir(img.path()), &ImportLimits::default())
            .expect("import the OCI layout");
        assert_eq!(t.layers.len(), 2);
        assert!(
            stored_layer_dir(&t, 0).join("etc/hello").is_file(),
            "the bottom layer still has the file"
        );

        // And from a tar stream of the same layout.
        let mut b = Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all(".", img.path()).expect("tar the layout");
        let layout_tar = b.into_inner().expect("finish tar");
        let name2 = unique_name("mini-oci-tar");
        let _tg2 = TemplateGuard(name2.clone());
        let t2 = rt()
            .templates()
            .import_oci(
                &name2,
                OciSource::Tar(&mut &layout_tar[..]),
                &ImportLimits::default(),
            )
            .expect("import the OCI layout tar");
        assert_eq!(t2.layers, t.layers, "same layers, deduplicated");

        for tmpl in [&name, &name2] {
            let mut sb = create_spec(&SandboxSpec {
                template: tmpl.clone(),
                ..Default::default()
            });
            assert!(
                !exists_in(&mut sb, "/etc/hello"),
                "whiteout ignored in {tmpl}"
            );
            let r = sb.sh("cat /etc/hello", 10_000);
            assert_ne!(r.status, ExecStatus::Ok, "{r:?}");
            assert_eq!(sh_ok(&mut sb, "cat /etc/added"), "from layer two\n");
            assert_eq!(sh_ok(&mut sb, "echo $FROM_IMAGE"), "yes\n", "image env");
            assert_eq!(sh_ok(&mut sb, "echo ok > /tmp/y; cat /tmp/y"), "ok\n");
            destroy_and_assert_gone(sb);
        }
    });
}

#[test]
fn template_e2e_unknown_template_is_template_not_found() {
    isolated(|| {
        let name = unique_name("no-such-template");
        let err = rt()
            .create(&SandboxSpec {
                template: name,
                ..Default::default()
            })
            .expect_err("create from an unknown template");
        assert!(matches!(err, RuntimeError::Template(_)), "{err:?}");
        assert_eq!(err.code(), ErrorCode::TemplateNotFound);
    });
}
