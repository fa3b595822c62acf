//! The cluster's fixtures: etcd members (the `etcd-server` package's `etcd`, on free ports) and
//! `dsec gateway` processes, killed (and waited for) on drop. Shared by the cluster tests and
//! `dsec bench cluster`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::{free_port, Http};

/// A child process killed (and waited for) on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `cond` every 50 ms until it holds or `limit` passes; answers the last answer.
pub fn wait(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// How to start one etcd member of a cluster on this machine.
#[derive(Clone, Debug)]
pub struct EtcdMember {
    /// Its name.
    pub name: String,
    /// Its data dir.
    pub data: PathBuf,
    /// Its client URL.
    pub client: String,
    peer: String,
    initial: String,
}

impl EtcdMember {
    /// Starts it (again: a member keeps its data dir).
    pub fn start(&self) -> Proc {
        let child = Command::new("etcd")
            .args(["--name", &self.name])
            .args(["--data-dir", &self.data.display().to_string()])
            .args(["--listen-client-urls", &self.client])
            .args(["--advertise-client-urls", &self.client])
            .args(["--listen-peer-urls", &self.peer])
            .args(["--initial-advertise-peer-urls", &self.peer])
            .args(["--initial-cluster", &self.initial])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd on the PATH (the etcd-server package)");
        Proc(child)
    }
}

/// An etcd of `n` members on free ports, their data under `dir`: the members, their processes
/// and the client URLs (comma-separated). Waits until each member takes a write.
pub fn etcd_cluster(dir: &Path, n: usize) -> (Vec<EtcdMember>, Vec<Proc>, String) {
    let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
    let initial = ports
        .iter()
        .enumerate()
        .map(|(i, (_, p))| format!("e{i}=http://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    let members: Vec<EtcdMember> = ports
        .iter()
        .enumerate()
        .map(|(i, (c, p))| EtcdMember {
            name: format!("e{i}"),
            data: dir.join(format!("etcd{i}")),
            client: format!("http://127.0.0.1:{c}"),
            peer: format!("http://127.0.0.1:{p}"),
            initial: initial.clone(),
        })
        .collect();
    let procs = members.iter().map(EtcdMember::start).collect();
    let urls = members
        .iter()
        .map(|m| m.client.clone())
        .collect::<Vec<_>>()
        .join(",");
    for m in &members {
        let h = Http::new(&m.client, None, Some(Duration::from_secs(2)));
        let put = json!({"key": "eA==", "value": "eQ=="});
        assert!(
            wait(Duration::from_secs(30), || h
                .call("POST", "/v3/kv/put", Some(&put))
                .is_ok_and(|(s, _)| s == 200)),
            "etcd member {} did not start",
            m.name
        );
    }
    (members, procs, urls)
}

/// A one-member etcd on free ports, its data in `dir`: its process and client URL.
pub fn etcd(dir: &Path) -> (Vec<Proc>, String) {
    let (_, procs, url) = etcd_cluster(dir, 1);
    (procs, url)
}

/// Starts `exe gateway --etcd etcd --listen 127.0.0.1:0`: its process, a client of it with
/// `key`, and its URL.
pub fn gateway(exe: impl AsRef<Path>, etcd: &str, key: Option<&str>) -> (Proc, Http, String) {
    let mut child = Command::new(exe.as_ref())
        .args(["gateway", "--etcd", etcd, "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the gateway");
    let out = child.stdout.take().expect("stdout");
    let url =
        crate::address_line(out, "dsec gateway listening on ").expect("the gateway's address");
    let h = Http::new(&url, key, Some(Duration::from_secs(120)));
    (Proc(child), h, url)
}
