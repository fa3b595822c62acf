//! `dsec server` with VM sandboxes (`microvm`): what the daemon's own process table and the VM
//! cache look like after VMs come and go. Slow under TCG (the first run builds the VM cache:
//! kernel, initramfs, root image, template snapshot).
//!
//! Needs root (cgroups, QEMU); CI runs as root.

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use serde_json::{json, Value};

mod common;

struct Daemon {
    child: Child,
    url: String,
    key: String,
    agent: ureq::Agent,
    base: std::path::PathBuf,
}

impl Daemon {
    fn start(tag: &str) -> Self {
        let (data, run) = common::dirs("dvm", tag);
        let common::Started { child, url, key } =
            common::start_server(&data, &run, &[], &["--pool-max", "0"]);
        Self {
            child,
            url,
            key,
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(600)))
                .build()
                .into(),
            base: data.parent().map(Path::to_owned).unwrap_or_default(),
        }
    }

    fn req(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let url = format!("{}{path}", self.url);
        let r = match method {
            "GET" => self.agent.get(&url).header("X-API-Key", &self.key).call(),
            "DELETE" => self
                .agent
                .delete(&url)
                .header("X-API-Key", &self.key)
                .call(),
            _ => self
                .agent
                .post(&url)
                .header("X-API-Key", &self.key)
                .send(body.unwrap_or(Value::Null).to_string()),
        };
        match r {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                let bytes = resp.body_mut().read_to_vec().unwrap_or_default();
                (
                    status,
                    serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                )
            }
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }

    fn stop(mut self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("pid");
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
        let st = self.child.wait().expect("wait");
        assert!(st.success(), "exit after SIGTERM: {st:?}");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// The children of `pid` (every thread's) that are zombies: exited, not yet waited for.
fn zombie_children(pid: u32) -> Vec<String> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .flatten()
    {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace() {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                continue;
            };
            if stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'))
            {
                out.push(stat.trim().to_owned());
            }
        }
    }
    out
}

/// Every QEMU the daemon starts is reaped: the template boot's, each sandbox's, the one a reset
/// replaces. After N creates, resets and destroys the daemon has no zombie child (each used to
/// stay `[qemu-system-x86] <defunct>` until the daemon exited).
#[test]
fn vm_creates_resets_and_destroys_leave_no_zombie_children() {
    let d = Daemon::start("zombies");
    const N: usize = 3;
    for i in 0..N {
        let (s, v) = d.req(
            "POST",
            "/v1/sandboxes",
            Some(json!({"substrate": "microvm"})),
        );
        assert_eq!(s, 201, "create {i}: {v}");
        let id = v["id"].as_str().expect("id").to_owned();
        let (s, v) = d.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "echo ok"})),
        );
        assert_eq!(
            (s, v["stdout"]["data"].as_str()),
            (200, Some("ok\n")),
            "{v}"
        );
        let (s, v) = d.req("POST", &format!("/v1/sandboxes/{id}/reset"), None);
        assert_eq!(s, 200, "reset {i}: {v}");
        let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(s, 200, "delete {i}: {v}");
    }
    let zombies = zombie_children(d.child.id());
    assert!(
        zombies.is_empty(),
        "zombie children of the daemon: {zombies:#?}"
    );
    d.stop();
}
