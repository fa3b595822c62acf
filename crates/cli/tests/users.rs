//! Users of a container sandbox, through a real `dsec server`: a command names its user (docs/api.md,
//! *Exec*), the agent keeps exactly the four capabilities it needs for that and no command holds
//! any (threat model G-27), file permissions apply to a user's command.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests.
    struct Daemon
);

impl Daemon {
    fn fresh(test: &str) -> Self {
        let (data, run) = testkit::dirs("dus", test);
        let base = data.parent().expect("a base").to_owned();
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
            .remove_on_drop(&base)
            .args(&["--pool-max", "0"])
            .start()
            .expect("start dsec server");
        Self(d)
    }

    fn create(&self, spec: Value) -> String {
        let (s, v) = self.req("POST", "/v1/sandboxes", Some(&spec));
        assert_eq!(s, 201, "{v}");
        v["id"].as_str().expect("id").to_owned()
    }

    /// The exec result of `sh -c shell` as `user` (`None`: the default user).
    fn exec(&self, id: &str, shell: &str, user: Option<&str>) -> (u16, Value) {
        let mut body = json!({"shell": shell});
        if let Some(u) = user {
            body["user"] = json!(u);
        }
        self.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body))
    }

    fn out(&self, id: &str, shell: &str, user: Option<&str>) -> String {
        let (s, v) = self.exec(id, shell, user);
        assert_eq!((s, &v["exit_code"]), (200, &json!(0)), "{shell}: {v}");
        v["stdout"]["data"].as_str().unwrap_or_default().to_owned()
    }
}

/// The capability sets of a `/proc/<pid>/status`, in order Inh, Prm, Eff, Bnd, Amb.
fn caps(status: &str) -> Vec<String> {
    ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
        .iter()
        .map(|k| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap_or("?")
                .trim()
                .to_owned()
        })
        .collect()
}

#[test]
fn the_agent_keeps_four_capabilities_and_commands_none() {
    let d = Daemon::fresh("caps");
    let id = d.create(json!({}));
    // The agent (PID 1): CHOWN (0), KILL (5), SETGID (6), SETUID (7); an empty bounding set.
    let agent = caps(&d.out(&id, "cat /proc/1/status", None));
    assert_eq!(
        agent,
        [
            "00000000000000e1",
            "00000000000000e1",
            "00000000000000e1",
            "0000000000000000",
            "00000000000000e1"
        ],
        "the agent's capability sets"
    );
    // A command, as root or as another user: nothing in any set.
    for user in [None, Some("root"), Some("nobody"), Some("1000")] {
        let own = caps(&d.out(&id, "cat /proc/self/status", user));
        assert!(
            own.iter().all(|c| c == "0000000000000000"),
            "{user:?}: {own:?}"
        );
    }
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200);
}

#[test]
fn a_command_runs_as_the_user_it_names() {
    let d = Daemon::fresh("names");
    let id = d.create(json!({"writable_root": true}));
    assert_eq!(d.out(&id, "id -u; id -g", None), "0\n0\n");
    assert_eq!(
        d.out(&id, "id -un; echo $HOME $USER $LOGNAME", Some("nobody")),
        "nobody\n/nonexistent nobody nobody\n"
    );
    assert_eq!(d.out(&id, "id -u", Some("4242")), "4242\n");
    // The request's environment wins over the user's.
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"shell": "echo $HOME", "user": "nobody", "env": {"HOME": "/tmp"}})),
    );
    assert_eq!(
        (s, v["stdout"]["data"].as_str()),
        (200, Some("/tmp\n")),
        "{v}"
    );
    // A user's command meets the file permissions root's would not: it cannot write a file of
    // root's, nor make one in a directory of root's.
    let (_, v) = d.exec(&id, "echo x >> /etc/passwd", Some("nobody"));
    assert_ne!(v["exit_code"], json!(0), "{v}");
    assert!(
        v["stderr"]["data"]
            .as_str()
            .unwrap_or_default()
            .contains("Permission denied"),
        "{v}"
    );
    d.out(&id, "touch /tmp/by-nobody", Some("nobody"));
    assert_eq!(d.out(&id, "stat -c %U /tmp/by-nobody", None), "nobody\n");
    // Unknown and malformed users are refused before anything runs.
    for bad in ["no-such-user", "-x", "a b", ""] {
        let (s, v) = d.exec(&id, "true", Some(bad));
        assert_eq!(
            (s, v["code"].as_str()),
            (400, Some("invalid_request")),
            "{bad:?}: {v}"
        );
    }
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200);
}
