//! What every system test of `dsec server` needs: short state dirs and a daemon started on a
//! free port, with its URL and admin key. Each test binary keeps its own request helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A fresh pair of short state dirs, `/tmp/<prefix>-<tag>-<pid>/{d,r}` (unix socket paths are
/// length-limited).
pub fn dirs(prefix: &str, tag: &str) -> (PathBuf, PathBuf) {
    let base = PathBuf::from(format!("/tmp/{prefix}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("create test dir");
    (base.join("d"), base.join("r"))
}

/// A started daemon.
pub struct Started {
    /// The `dsec server` process.
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The admin API key.
    pub key: String,
}

/// Starts `dsec --data-dir DATA --run-dir RUN server --listen 127.0.0.1:0 ARGS...` with two
/// pre-built shells and `env`, waits for its address line and reads its admin key. Its stderr
/// is shown when `DSEC_TEST_LOG` is set.
pub fn start_server(data: &Path, run: &Path, env: &[(&str, &str)], args: &[&str]) -> Started {
    start(data, run, env, args, None)
}

/// [`start_server`] with the daemon's stderr (its log) written to `log`.
pub fn start_server_logged(
    data: &Path,
    run: &Path,
    env: &[(&str, &str)],
    args: &[&str],
    log: &Path,
) -> Started {
    start(data, run, env, args, Some(log))
}

fn start(
    data: &Path,
    run: &Path,
    env: &[(&str, &str)],
    args: &[&str],
    log: Option<&Path>,
) -> Started {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dsec"));
    cmd.arg("--data-dir")
        .arg(data)
        .arg("--run-dir")
        .arg(run)
        .args(["server", "--listen", "127.0.0.1:0"])
        .args(args)
        .env("DSEC_SPAWNER_SHELLS", "2")
        .stdout(Stdio::piped())
        .stderr(match log {
            Some(p) => Stdio::from(std::fs::File::create(p).expect("create the server log")),
            None if std::env::var_os("DSEC_TEST_LOG").is_some() => Stdio::inherit(),
            None => Stdio::null(),
        });
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn dsec server");
    let out = child.stdout.take().expect("stdout");
    let url = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("dsec server listening on ")
                .map(str::to_owned)
        })
        .expect("the server printed its address");
    let key = std::fs::read_to_string(data.join("admin.key"))
        .expect("admin.key")
        .trim()
        .to_owned();
    Started { child, url, key }
}

/// Removes a test's state dirs when dropped, also after a failed assertion. Declare it before
/// the daemon that uses them, so that it is dropped after the daemon stopped. Nothing is
/// removed while something is mounted below the dir.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let prefix = format!("{}/", self.0.display());
        let mounted = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .any(|m| m.starts_with(&prefix));
        if mounted {
            eprintln!(
                "{}: left in place, something is mounted below",
                self.0.display()
            );
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// [`dirs`], removed again when the returned guard drops.
pub fn dirs_removed_on_drop(prefix: &str, tag: &str) -> (PathBuf, PathBuf, RemoveOnDrop) {
    let (data, run) = dirs(prefix, tag);
    let base = data
        .parent()
        .expect("invariant: dirs are below a base")
        .to_owned();
    (data, run, RemoveOnDrop(base))
}

/// A root filesystem tarball holding `/etc/motd` = `motd`, written under `base` as `<name>.tar`.
pub fn rootfs_tarball(base: &Path, name: &str, motd: &str) -> PathBuf {
    let src = base.join(format!("{name}-root"));
    std::fs::create_dir_all(src.join("etc")).expect("rootfs");
    std::fs::write(src.join("etc/motd"), motd).expect("motd");
    let tarball = base.join(format!("{name}.tar"));
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&tarball)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success());
    tarball
}

/// The sandboxes whose runtime dirs are on the machine under a node's run dir.
pub fn sandbox_run_dirs(run: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(run.join("sandboxes"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}
