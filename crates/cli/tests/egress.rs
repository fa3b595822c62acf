//! Network egress through a real `dsec server` against a fake internet in a network namespace
//! of its own (`testkit::fakenet`: DNS, HTTP, HTTPS, a package index): nothing here contacts a
//! real outside address. Default deny; allow by name, wildcard, CIDR and port; no DNS
//! rebinding; never the node, link-local metadata or another sandbox; a policy changed on a
//! running sandbox; tenants' ceilings; the kernel keeps enforcing while the daemon is dead
//! and a restart adopts the paths; `pip install` from the fake index.
//!
//! Needs root (namespaces, veths, nftables); CI runs as root.

use std::net::Ipv4Addr;

use dsec_testkit as testkit;
use serde_json::{json, Value};
use testkit::fakenet::FakeNet;

testkit::daemon_type!(
    /// A daemon of these tests.
    struct Daemon
);

impl Daemon {
    fn fresh(test: &str, net: &FakeNet) -> Self {
        Self::fresh_with(test, net, &[])
    }

    /// A fresh daemon with `extra` flags.
    fn fresh_with(test: &str, net: &FakeNet, extra: &[&str]) -> Self {
        let (data, run) = testkit::dirs("deg", test);
        let base = data.parent().expect("a base").to_owned();
        Self::on(&data, &run, Some(&base), net, extra)
    }

    /// A daemon on these state dirs (removed with it when `owned` names their base).
    fn on(
        data: &std::path::Path,
        run: &std::path::Path,
        owned: Option<&std::path::Path>,
        net: &FakeNet,
        extra: &[&str],
    ) -> Self {
        // (A VM's first create boots its template under TCG: minutes on a busy machine.)
        let mut s = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run)
            .timeout(std::time::Duration::from_secs(600));
        if let Some(base) = owned {
            s = s.remove_on_drop(base);
        }
        let d = s
            .args(&[
                "--pool-max",
                "0",
                "--egress-resolver",
                &net.dns().to_string(),
            ])
            .args(extra)
            .start()
            .expect("start dsec server");
        Self(d)
    }

    fn create(&self, spec: Value) -> String {
        let (s, v) = self.req("POST", "/v1/sandboxes", Some(&spec));
        assert_eq!(s, 201, "{v}");
        v["id"].as_str().expect("id").to_owned()
    }

    /// `(exit code, stdout + stderr)` of `sh -c shell`.
    fn sh(&self, id: &str, shell: &str) -> (i64, String) {
        let body = json!({"shell": shell, "timeout_ms": 20000});
        let (s, v) = self.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body));
        assert_eq!(s, 200, "{shell}: {v}");
        let text = |k: &str| v[k]["data"].as_str().unwrap_or_default().to_owned();
        (
            v["exit_code"].as_i64().unwrap_or(-1),
            format!("{}{}", text("stdout"), text("stderr")),
        )
    }

    /// Whether an HTTP GET of `url` from the sandbox succeeds (curl, 3 s to connect).
    fn get(&self, id: &str, url: &str, extra: &str) -> (bool, String) {
        let (code, out) = self.sh(
            id,
            &format!("curl -sS --max-time 5 --connect-timeout 3 {extra} {url}"),
        );
        (code == 0, out)
    }

    fn resolves(&self, id: &str, name: &str) -> Option<String> {
        let (code, out) = self.sh(id, &format!("getent ahostsv4 {name} | head -1"));
        (code == 0 && !out.trim().is_empty())
            .then(|| out.split_whitespace().next().unwrap_or_default().to_owned())
    }

    fn set_network(&self, id: &str, net: Value) -> (u16, Value) {
        self.req("PUT", &format!("/v1/sandboxes/{id}/network"), Some(&net))
    }

    /// Bytes per second of a 3 MB download from `web` in sandbox `id`.
    fn download_speed(&self, id: &str, web: Ipv4Addr) -> f64 {
        let (code, out) = self.sh(
            id,
            &format!("curl -sS -o /dev/null --max-time 15 -w '%{{speed_download}}' http://{web}/bytes/3000000"),
        );
        assert_eq!(code, 0, "{out}");
        out.trim().parse().expect("speed")
    }

    /// Opens three connections to `web`:80 from sandbox `id` and holds them: the output says
    /// how many opened (`open N`) and why the others did not.
    fn hold_three_connections(&self, id: &str, web: Ipv4Addr) -> String {
        let (code, out) = self.sh(
            id,
            &format!(
                "python3 -c \"
import socket
held, ok = [], 0
for i in range(3):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect(('{web}', 80)); held.append(s); ok += 1
    except OSError as e:
        print('refused', e)
print('open', ok)
\""
            ),
        );
        assert_eq!(code, 0, "{out}");
        out
    }
}

fn allow(rules: &[&str]) -> Value {
    json!({"network": {"egress": {"allow": rules}}})
}

/// The host's links whose names start with `prefix`.
fn links(prefix: &str) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Whether the links of `prefix` are gone within 5 s (the node removes a destroyed sandbox's
/// link off the destroy's path).
fn links_gone(prefix: &str) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !links(prefix).is_empty() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}

fn table_exists(name: &str) -> bool {
    std::process::Command::new("nft")
        .args(["list", "table", "inet", name])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn default_deny_and_allow_by_name() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("names", &net);
    let (web, other) = (net.web(), net.other());
    // No policy: only loopback, exactly as before.
    let closed = d.create(json!({}));
    assert!(!d.get(&closed, &format!("http://{web}/whoami"), "").0);
    let (_, v) = d.req("GET", &format!("/v1/sandboxes/{closed}"), None);
    assert!(v.get("network").is_none(), "{v}");

    let id = d.create(allow(&["pypi.test"]));
    let (_, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(v["network"]["egress"]["allow"], json!(["pypi.test"]), "{v}");
    assert_eq!(d.resolves(&id, "pypi.test"), Some(web.to_string()));
    let (ok, out) = d.get(&id, "http://pypi.test/whoami", "");
    assert!(ok, "{out}");
    let who: Value = serde_json::from_str(&out).expect("whoami json");
    assert_eq!(who["host"], "pypi.test");
    // A name not allowed resolves to nothing; its address is not reachable either, nor is an
    // address no allowed name resolved to.
    assert_eq!(d.resolves(&id, "github.test"), None);
    assert!(!d.get(&id, &format!("http://{other}/whoami"), "").0);
    assert!(
        !d.get(
            &id,
            "http://github.test/whoami",
            &format!("--resolve github.test:80:{other}")
        )
        .0
    );
    // Never: link-local metadata, the node's own addresses and API.
    assert!(!d.get(&id, "http://169.254.169.254/", "").0);
    let port = d
        .url
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_owned();
    let (_, out) = d.sh(&id, "ip -4 -o route show default");
    let gw = out.split_whitespace().nth(2).unwrap_or_default().to_owned();
    assert!(!gw.is_empty(), "a default route: {out}");
    assert!(!d.get(&id, &format!("http://{gw}:{port}/v1/health"), "").0);
    for host_addr in host_addrs() {
        assert!(
            !d.get(&id, &format!("http://{host_addr}:{port}/v1/health"), "")
                .0,
            "the node at {host_addr}"
        );
    }
    // A refused name is counted.
    let m = d.http().text("/metrics");
    let denied = m
        .lines()
        .find_map(|l| l.strip_prefix("dsec_egress_denied_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(denied >= 1.0, "dsec_egress_denied_total {denied}");
    let out = format!("dsec_sandbox_egress_bytes_total{{sandbox=\"{id}\",direction=\"out\"}} ");
    let sent = m
        .lines()
        .find_map(|l| l.strip_prefix(out.as_str()))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(sent > 0, "bytes out of {id}: {m}");
}

/// The value of series `name` (a whole line's prefix, labels included) in `/metrics`.
fn metric(d: &Daemon, name: &str) -> f64 {
    let prefix = format!("{name} ");
    d.http()
        .text("/metrics")
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

#[test]
fn a_sandbox_launched_in_a_pre_built_shell_gets_its_path_while_it_launches() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("early", &net);
    assert!(
        testkit::cluster::wait(std::time::Duration::from_secs(30), || metric(
            &d,
            "dsec_idle_shells"
        ) >= 1.0),
        "no pre-built shell"
    );
    let before = metric(&d, "dsec_egress_attach_early_total");
    let id = d.create(allow(&["pypi.test"]));
    assert_eq!(
        metric(&d, "dsec_egress_attach_early_total"),
        before + 1.0,
        "made while it launched"
    );
    let (_, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(v["network"]["egress"]["allow"], json!(["pypi.test"]), "{v}");
    let (ok, out) = d.get(&id, "http://pypi.test/whoami", "");
    assert!(ok, "{out}");
    assert!(!d.get(&id, &format!("http://{}/whoami", net.other()), "").0);
    // A sandbox without a policy from the next shell has loopback only.
    let closed = d.create(json!({}));
    let (_, out) = d.sh(&closed, "ip -o link show | cut -d: -f2");
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["lo"], "{out}");
    // Destroyed, its link goes (the next node start would find none).
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204, "{s}");
    let (_, v) = d.req("GET", "/v1/sandboxes", None);
    assert!(v.to_string().contains(&closed), "{v}");
}

/// Removes a host link when dropped.
struct LinkGuard(String);

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .status();
    }
}

#[test]
fn a_link_left_under_the_next_name_is_replaced() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("leftlink", &net);
    let first = d.create(allow(&["pypi.test"]));
    // Its host side: the link whose index the sandbox's eth0 names (`eth0@if<index>`).
    let (_, out) = d.sh(&first, "ip -o link show eth0");
    let index = out
        .split("@if")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .expect("eth0@if<index>")
        .to_owned();
    let out = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .expect("ip link");
    let host = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with(&format!("{index}: ")))
        .and_then(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .expect("the host side");
    // Addresses go round robin: the next sandbox gets the next name. A link a dead node left
    // under it is replaced, not a failed create.
    let (prefix, n) = host.rsplit_once('-').expect("dsv<k>-<n>");
    let n = u32::from_str_radix(n, 16).expect("hex");
    let next = format!("{prefix}-{:x}", n + 1);
    let _guard = LinkGuard(next.clone());
    let peer = format!("dstl{:x}", std::process::id());
    let made = std::process::Command::new("ip")
        .args(["link", "add", &next, "type", "veth", "peer", "name", &peer])
        .status()
        .expect("ip link add");
    assert!(made.success(), "a veth {next} on the host");
    let second = d.create(allow(&["pypi.test"]));
    let (ok, out) = d.get(&second, "http://pypi.test/whoami", "");
    assert!(ok, "{out}");
    // Its peer is in the sandbox's namespace now, not on the host.
    let out = std::process::Command::new("ip")
        .args(["-o", "link", "show", &next])
        .output()
        .expect("ip link show");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("link-netns"),
        "{next} is the sandbox's veth now: {shown}"
    );
    assert!(links(&peer).is_empty(), "the old pair went whole");
}

/// The host's own IPv4 addresses (not loopback).
fn host_addrs() -> Vec<Ipv4Addr> {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next()?.parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback())
        .take(3)
        .collect()
}

#[test]
fn wildcards_cidrs_ports_and_tls_by_name() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("cidr", &net);
    let other = net.other();
    let ca = std::fs::read_to_string(net.ca_pem()).expect("ca");
    let id = d.create(allow(&["*.pythonhosted.test", &format!("{other}:443")]));
    d.sh(&id, &format!("cat > /tmp/ca.pem <<'EOF'\n{ca}EOF"));
    assert_eq!(
        d.resolves(&id, "files.pythonhosted.test"),
        Some(net.web().to_string())
    );
    assert!(d.get(&id, "http://files.pythonhosted.test/whoami", "").0);
    // The wildcard is strictly below its suffix.
    assert_eq!(d.resolves(&id, "pythonhosted.test"), None);
    // The CIDR rule: port 443 only.
    let (ok, out) = d.get(
        &id,
        "https://other.test/whoami",
        &format!("--cacert /tmp/ca.pem --resolve other.test:443:{other}"),
    );
    assert!(ok, "{out}");
    assert!(!d.get(&id, &format!("http://{other}/whoami"), "").0);
}

#[test]
fn no_dns_rebinding_onto_private_or_metadata_addresses() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("rebind", &net);
    let id = d.create(allow(&["rebind.test"]));
    assert_eq!(d.resolves(&id, "rebind.test"), Some(net.web().to_string()));
    for bad in [
        Ipv4Addr::new(10, 0, 0, 1),
        Ipv4Addr::new(169, 254, 169, 254),
        Ipv4Addr::new(127, 0, 0, 1),
    ] {
        net.set_name("rebind.test", &[bad]).expect("zone");
        assert_eq!(d.resolves(&id, "rebind.test"), None, "rebinding to {bad}");
    }
}

#[test]
fn a_running_sandboxs_policy_changes_and_sandboxes_never_reach_each_other() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("change", &net);
    let web = net.web();
    let id = d.create(json!({}));
    assert!(!d.get(&id, &format!("http://{web}/whoami"), "").0);
    // Open for an install, then closed for the episode.
    let (s, v) = d.set_network(&id, json!({"egress": {"allow": [format!("{web}/32")]}}));
    assert_eq!(s, 200, "{v}");
    assert!(v["network_address"].is_string(), "{v}");
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0);
    let (s, v) = d.set_network(&id, json!({"egress": {"allow": ["pypi.test"]}}));
    assert_eq!(s, 200, "{v}");
    assert!(
        !d.get(&id, &format!("http://{web}/whoami"), "").0,
        "the CIDR rule is gone"
    );
    assert!(d.get(&id, "http://pypi.test/whoami", "").0);
    let (s, v) = d.set_network(&id, json!({"egress": "none"}));
    assert_eq!(s, 200, "{v}");
    assert!(v.get("network_address").is_none(), "{v}");
    assert!(!d.get(&id, &format!("http://{web}/whoami"), "").0);
    assert_eq!(d.resolves(&id, "pypi.test"), None);

    // Two sandboxes with the whole internet: neither reaches the other.
    let a = d.create(json!({"network": {"egress": "all"}}));
    let b = d.create(json!({"network": {"egress": "all"}}));
    assert!(
        d.get(&a, &format!("http://{web}/whoami"), "").0,
        "all reaches the internet"
    );
    let (_, va) = d.req("GET", &format!("/v1/sandboxes/{a}"), None);
    let addr_a = va["network_address"].as_str().expect("address").to_owned();
    d.sh(
        &a,
        "nohup python3 -m http.server 8000 >/dev/null 2>&1 & sleep 1",
    );
    assert!(d.get(&a, "http://127.0.0.1:8000/", "").0, "a serves itself");
    assert!(
        !d.get(&b, &format!("http://{addr_a}:8000/"), "").0,
        "b reaches a"
    );
    // Spoofing another source address gets nothing through (the agent cannot even set one).
    let (code, _) = d.sh(&b, &format!("ip addr add {addr_a}/32 dev eth0"));
    assert_ne!(code, 0, "a command changed its sandbox's addresses");

    // A fork keeps its sandbox's policy, on a path of its own.
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{b}/fork"),
        Some(&json!({"count": 1})),
    );
    assert_eq!(s, 201, "{v}");
    let fork = &v["sandboxes"][0];
    assert_eq!(fork["network"]["egress"], "all", "{v}");
    let (fork, addr) = (
        fork["id"].as_str().expect("id"),
        fork["network_address"].as_str().expect("its own address"),
    );
    assert_ne!(addr, addr_a);
    assert!(d.get(fork, &format!("http://{web}/whoami"), "").0);
    let snapshot = v["snapshot"]["id"].as_str().expect("snapshot").to_owned();
    for sb in [&a, &b, fork] {
        let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{sb}"), None);
        assert_eq!(s, 200, "{v}");
    }
    let (s, v) = d.req("DELETE", &format!("/v1/snapshots/{snapshot}"), None);
    assert!(s == 200 || s == 204, "{v}");
}

#[test]
fn tenants_get_no_more_than_their_ceiling() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("ceiling", &net);
    let mk = |name: &str, ceiling: Option<Value>| {
        let mut body = json!({"name": name});
        if let Some(c) = ceiling {
            body["egress_ceiling"] = c;
        }
        let (s, v) = d.req("POST", "/v1/tenants", Some(&body));
        assert_eq!(s, 201, "{v}");
        testkit::Http::new(&d.url, v["api_key"].as_str(), None)
    };
    let post = |c: &testkit::Http, body: &Value| c.req("POST", "/v1/sandboxes", Some(body));
    let plain = mk("plain", None);
    let (s, v) = post(&plain, &allow(&["pypi.test"]));
    assert_eq!((s, v["code"].as_str()), (403, Some("forbidden")), "{v}");
    let (s, _) = post(&plain, &json!({}));
    assert_eq!(s, 201);
    let some = mk(
        "some",
        Some(json!({"allow": ["*.test"], "max_connections": 50})),
    );
    let (s, v) = post(&some, &json!({"network": {"egress": "all"}}));
    assert_eq!((s, v["code"].as_str()), (403, Some("forbidden")), "{v}");
    let (s, v) = post(&some, &allow(&["pypi.test"]));
    assert_eq!(s, 201, "{v}");
    let (s, v) = post(&some, &allow(&["10.0.0.0/8"]));
    assert_eq!((s, v["code"].as_str()), (403, Some("forbidden")), "{v}");
    let (s, v) = d.req("POST", "/v1/sandboxes", Some(&allow(&["::1"])));
    assert_eq!(
        (s, v["code"].as_str()),
        (400, Some("invalid_request")),
        "{v}"
    );
}

/// What the operator keeps out (`--egress-never`) no `allow` rule reaches, nor a name that
/// resolves into it; a `reserved` rule does, given by the admin tenant, or by a tenant whose
/// ceiling's own `reserved` covers it.
#[test]
fn reserved_networks_are_reached_only_as_an_admin_allows() {
    let net = FakeNet::start().expect("fake internet");
    let web = net.web();
    let never = format!("{web}/32");
    let d = Daemon::fresh_with("reserved", &net, &["--egress-never", &never]);
    let kept_out = d.create(allow(&[&never, "pypi.test"]));
    assert!(!d.get(&kept_out, &format!("http://{web}/whoami"), "").0);
    assert_eq!(
        d.resolves(&kept_out, "pypi.test"),
        None,
        "no answer into it"
    );
    let admin = d.create(json!({"network": {"egress": {
        "allow": ["pypi.test"], "reserved": [format!("{web}/32:80")],
    }}}));
    let (ok, out) = d.get(&admin, &format!("http://{web}/whoami"), "");
    assert!(ok, "{out}");
    assert!(
        d.get(&admin, "http://pypi.test/whoami", "").0,
        "and by name"
    );
    assert!(
        !d.get(&admin, &format!("https://{web}/whoami"), "-k").0,
        "only the reserved rule's port"
    );
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"network": {"egress": {"allow": [], "reserved": ["web.test"]}}})),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (400, Some("invalid_request")),
        "{v}"
    );
    let mk = |name: &str, ceiling: Value| {
        let body = json!({"name": name, "egress_ceiling": ceiling});
        let (s, v) = d.req("POST", "/v1/tenants", Some(&body));
        assert_eq!(s, 201, "{v}");
        testkit::Http::new(&d.url, v["api_key"].as_str(), None)
    };
    let spec = json!({"network": {"egress": {"allow": [], "reserved": [format!("{web}/32:80")]}}});
    let wide = mk("wide", json!("all"));
    let (s, v) = wide.req("POST", "/v1/sandboxes", Some(&spec));
    assert_eq!((s, v["code"].as_str()), (403, Some("forbidden")), "{v}");
    let granted = mk("granted", json!({"allow": [], "reserved": [never]}));
    let (s, v) = granted.req("POST", "/v1/sandboxes", Some(&spec));
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id");
    let (s, v) = granted.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"shell": format!("curl -sS --max-time 5 http://{web}/whoami")})),
    );
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
}

#[test]
fn the_kernel_enforces_while_the_daemon_is_dead_and_a_restart_adopts() {
    let net = FakeNet::start().expect("fake internet");
    let (data, run, _base) = testkit::dirs_removed_on_drop("deg", "kill9");
    let mut d = Daemon::on(&data, &run, None, &net, &[]);
    let (web, other) = (net.web(), net.other());
    let id = d.create(allow(&[&format!("{web}/32")]));
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0);
    let (_, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None);
    let init = v["init_pid"].as_i64().expect("init pid (admin view)");
    let k = std::fs::read_to_string(d.data.join("egress-index")).expect("egress index");
    let (table, prefix) = (format!("dsec_{}", k.trim()), format!("dsv{}-", k.trim()));
    d.kill9();
    assert!(table_exists(&table), "the rules outlive the daemon");
    assert_eq!(links(&prefix).len(), 1);
    // From inside the sandbox's network namespace, with no daemon: allowed, and not.
    let curl = |url: &str| {
        std::process::Command::new("nsenter")
            .args([
                "-t",
                &init.to_string(),
                "-n",
                "curl",
                "-sS",
                "--max-time",
                "3",
                url,
            ])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    assert!(curl(&format!("http://{web}/whoami")));
    assert!(!curl(&format!("http://{other}/whoami")));
    let mut d = Daemon::on(&data, &run, None, &net, &[]);
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0, "adopted");
    assert!(!d.get(&id, &format!("http://{other}/whoami"), "").0);
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200);
    assert!(links_gone(&prefix), "the veth is gone with its sandbox");
    d.stop();
    assert!(
        !table_exists(&table),
        "a node with no path left removes its table"
    );
}

#[test]
fn pip_installs_from_the_fake_index() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("pip", &net);
    let id = d.create(json!({
        "writable_root": true,
        "network": {"egress": {"allow": ["pypi.test"]}},
    }));
    let (code, out) = d.sh(
        &id,
        "PIP_CONFIG_FILE=/dev/null /usr/bin/python3 -m pip install --isolated --no-cache-dir \
         --disable-pip-version-check --index-url http://pypi.test/simple/ \
         --trusted-host pypi.test --target /tmp/site dsecprobe 2>&1 && \
         PYTHONPATH=/tmp/site /usr/bin/python3 -c 'import dsecprobe; print(dsecprobe.VALUE)'",
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.trim_end().ends_with("42"), "{out}");
}

#[test]
fn bandwidth_and_connection_caps_hold() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("caps", &net);
    let web = net.web();
    let cap = 1_000_000u64;
    let id = d.create(json!({"network": {"egress": {
        "allow": [format!("{web}/32")], "bandwidth_bps": cap, "max_connections": 2,
    }}}));
    let speed = d.download_speed(&id, web);
    assert!(
        speed < cap as f64 * 1.3,
        "{speed} B/s through a cap of {cap} B/s"
    );
    // Two connections held open, the third refused.
    let out = d.hold_three_connections(&id, web);
    assert!(out.contains("open 2"), "{out}");
    // Without caps the same download is not held back.
    let (s, v) = d.set_network(&id, json!({"egress": {"allow": [format!("{web}/32")]}}));
    assert_eq!(s, 200, "{v}");
    let free = d.download_speed(&id, web);
    assert!(free > cap as f64 * 2.0, "{free} B/s with no cap");
}

#[test]
fn tls_sni_and_http_host_must_name_an_allowed_name() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("sni", &net);
    let web = net.web();
    let ca = std::fs::read_to_string(net.ca_pem()).expect("ca");
    let id = d.create(allow(&["pypi.test"]));
    d.sh(&id, &format!("cat > /tmp/ca.pem <<'EOF'\n{ca}EOF"));
    assert_eq!(d.resolves(&id, "pypi.test"), Some(web.to_string()));
    let (ok, out) = d.get(&id, "https://pypi.test/whoami", "--cacert /tmp/ca.pem");
    assert!(ok, "{out}");
    assert!(d.get(&id, "http://pypi.test/whoami", "").0);
    // The allowed name's address, another name in SNI or Host: refused.
    let (ok, out) = d.get(
        &id,
        "https://evil.test/whoami",
        &format!("--cacert /tmp/ca.pem --resolve evil.test:443:{web}"),
    );
    assert!(!ok, "domain fronting through SNI: {out}");
    let (ok, out) = d.get(&id, &format!("http://{web}/whoami"), "-H 'Host: evil.test'");
    assert!(!ok, "domain fronting through Host: {out}");
    // No name at all (an address in the URL: curl sends it as Host, which is no allowed name).
    assert!(!d.get(&id, &format!("https://{web}/whoami"), "-k").0);
}

/// `GET /v1/events` lines of `sandbox` with `"event": "egress_denied"`, read for `within`.
fn denied_events(d: &Daemon, sandbox: &str, within: std::time::Duration) -> Vec<String> {
    use std::io::{BufRead, BufReader, Read, Write};
    let addr = d
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(within)).expect("timeout");
    write!(
        s,
        "GET /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\r\n",
        d.key
    )
    .expect("write");
    let mut out = Vec::new();
    let reader = BufReader::new(s.take(1 << 20));
    for line in reader.lines() {
        let Ok(line) = line else { break };
        if line.contains("egress_denied") && line.contains(sandbox) {
            out.push(line);
        }
    }
    out
}

#[test]
fn refusals_are_reported_with_their_destination() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("events", &net);
    let other = net.other();
    let id = d.create(allow(&["pypi.test"]));
    let trigger = {
        let (url, key, id) = (d.url.clone(), d.key.clone(), id.clone());
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let h = testkit::Http::new(&url, Some(&key), None);
            let body = json!({"shell": format!("curl -s --max-time 2 http://{other}/ ; getent hosts github.test"), "timeout_ms": 10000});
            h.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body))
        })
    };
    let events = denied_events(&d, &id, std::time::Duration::from_secs(4));
    let _ = trigger.join();
    let all = events.join("\n");
    assert!(
        all.contains(&format!("{other}:80")),
        "the address refused: {all}"
    );
    assert!(all.contains("github.test"), "the name refused: {all}");
}

#[test]
fn a_logged_steps_observation_lists_its_refusals() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("traj", &net);
    let other = net.other();
    let id = d.create(allow(&["pypi.test"]));
    let body = json!({
        "shell": format!("curl -s --max-time 2 http://{other}/; sleep 0.2"),
        "trajectory": "egress-traj",
        "step": 1,
    });
    let (s, v) = d.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body));
    assert_eq!(s, 200, "{v}");
    let refused = v["egress_denied"].to_string();
    assert!(refused.contains(&format!("{other}:80")), "{v}");
    // Replayed from the log, the same observation.
    let (s, again) = d.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body));
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["egress_denied"], v["egress_denied"]);
}

/// A microVM's path out is a container's: a tap into the node's table plugged into its NIC,
/// `eth0` configured by its agent; a reset keeps it; a `vm` gets the same; the in-band check
/// holds; a microVM without
/// a policy has no way out until its policy opens one, and `none` closes it again (the tap
/// stays, the guest's link goes down); caps hold on a VM's tap.
#[test]
fn a_microvm_gets_the_same_path_out() {
    let net = FakeNet::start().expect("fake internet");
    let d = Daemon::fresh("vm", &net);
    let (web, other) = (net.web(), net.other());
    let id = d.create(json!({
        "substrate": "microvm",
        "network": {"egress": {"allow": ["pypi.test"]}},
    }));
    let check = |id: &str| {
        assert_eq!(d.resolves(id, "pypi.test"), Some(web.to_string()));
        let (ok, out) = d.get(id, "http://pypi.test/whoami", "");
        assert!(ok, "{out}");
        let who: Value = serde_json::from_str(&out).expect("whoami json");
        assert_eq!(who["host"], "pypi.test");
        assert_eq!(d.resolves(id, "github.test"), None);
        assert!(!d.get(id, &format!("http://{other}/whoami"), "").0);
        assert!(!d.get(id, "http://169.254.169.254/", "").0);
    };
    check(&id);
    // The in-band check: the allowed name's address under another name in SNI or Host.
    assert!(d.get(&id, "https://pypi.test/whoami", "-k").0);
    let (ok, out) = d.get(
        &id,
        "https://evil.test/whoami",
        &format!("-k --resolve evil.test:443:{web}"),
    );
    assert!(!ok, "domain fronting through SNI from a VM: {out}");
    let (ok, out) = d.get(&id, &format!("http://{web}/whoami"), "-H 'Host: evil.test'");
    assert!(!ok, "domain fronting through Host from a VM: {out}");
    let (s, v) = d.req("POST", &format!("/v1/sandboxes/{id}/reset"), None);
    assert_eq!(s, 200, "{v}");
    check(&id);
    // The full machine (`vm`: q35, a virtio-net PCI device) takes the same path.
    let full = d.create(json!({
        "substrate": "vm",
        "network": {"egress": {"allow": ["pypi.test"]}},
    }));
    check(&full);
    let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{full}"), None);
    assert_eq!(s, 200, "{v}");

    // No policy: the NIC is on a hub with nothing else, no address, no route.
    let closed = d.create(json!({"substrate": "microvm"}));
    let no_route = |id: &str| {
        let (_, routes) = d.sh(id, "cat /proc/net/route");
        assert_eq!(routes.lines().count(), 1, "{routes}");
        let (ok, out) = d.get(id, &format!("http://{web}/whoami"), "");
        assert!(!ok, "{out}");
    };
    no_route(&closed);
    // A running VM's policy opens a path (a tap plugged into its QEMU)...
    let (s, v) = d.set_network(&closed, json!({"egress": {"allow": ["pypi.test"]}}));
    assert_eq!(s, 200, "{v}");
    check(&closed);
    let (_, gateway) = d.sh(&closed, "ip route show default | cut -d' ' -f3");
    let gateway = gateway.trim().to_owned();
    assert!(gateway.parse::<Ipv4Addr>().is_ok(), "{gateway}");
    // ... closes it (the tap stays, the guest's eth0 goes down, the table drops all)...
    let (s, v) = d.set_network(&closed, json!({"egress": "none"}));
    assert_eq!(s, 200, "{v}");
    assert!(
        v["network"].is_null(),
        "none, the default, is not shown: {v}"
    );
    assert!(v["network_address"].is_string(), "the link stays: {v}");
    no_route(&closed);
    let (code, out) = d.sh(
        &closed,
        &format!("ip link set eth0 up && ip route add default via {gateway} dev eth0 onlink"),
    );
    assert_eq!(code, 0, "the guest's root takes its link back: {out}");
    assert!(
        !d.get(&closed, &format!("http://{web}/whoami"), "").0,
        "a guest that brings its link back up still reaches nothing"
    );
    assert_eq!(d.resolves(&closed, "pypi.test"), None);
    // ... and opens it again, now with caps on the tap.
    let cap = 1_000_000u64;
    let (s, v) = d.set_network(
        &closed,
        json!({"egress": {"allow": [format!("{web}/32")], "bandwidth_bps": cap, "max_connections": 2}}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(d.get(&closed, &format!("http://{web}/whoami"), "").0);
    let speed = d.download_speed(&closed, web);
    assert!(
        speed < cap as f64 * 1.3,
        "{speed} B/s through a cap of {cap} B/s"
    );
    let out = d.hold_three_connections(&closed, web);
    assert!(out.contains("open 2"), "{out}");
    for id in [&id, &closed] {
        let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(s, 200, "{v}");
    }
}

/// A microVM's QEMU keeps its tap while the daemon is dead; a restart adopts the path, and a
/// reset after it plugs a fresh tap into the new QEMU; a destroy leaves no tap.
#[test]
fn a_restart_adopts_a_microvms_path_and_a_reset_after_it_keeps_it() {
    let net = FakeNet::start().expect("fake internet");
    let (data, run, _base) = testkit::dirs_removed_on_drop("deg", "vmkill9");
    let mut d = Daemon::on(&data, &run, None, &net, &[]);
    let (web, other) = (net.web(), net.other());
    let id = d.create(json!({
        "substrate": "microvm",
        "network": {"egress": {"allow": [format!("{web}/32")]}},
    }));
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0);
    let k = std::fs::read_to_string(d.data.join("egress-index")).expect("egress index");
    let (table, prefix) = (format!("dsec_{}", k.trim()), format!("dsv{}-", k.trim()));
    d.kill9();
    assert_eq!(links(&prefix).len(), 1, "its QEMU keeps its tap");
    let mut d = Daemon::on(&data, &run, None, &net, &[]);
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0, "adopted");
    assert!(!d.get(&id, &format!("http://{other}/whoami"), "").0);
    let (s, v) = d.req("POST", &format!("/v1/sandboxes/{id}/reset"), None);
    assert_eq!(s, 200, "{v}");
    assert!(d.get(&id, &format!("http://{web}/whoami"), "").0, "reset");
    assert!(!d.get(&id, &format!("http://{other}/whoami"), "").0);
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200);
    assert!(links_gone(&prefix), "the tap is gone with its VM");
    d.stop();
    assert!(!table_exists(&table));
}
