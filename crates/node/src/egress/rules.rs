//! The node's nftables table: one per node, `inet dsec_<k>`, loaded whole and atomically with
//! `nft -f` (at start, and again on a restart: the adopted sandboxes' elements are then put
//! back over netlink), edited afterwards one set element at a time over netlink.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use super::policy::{NEVER, PRIVATE};

/// Names of the table's sets.
pub const ALLOW: &str = "allow4";
/// Taken out of `allow4` (checked first).
pub const DENY: &str = "deny4";
/// Addresses pinned from DNS answers (checked in-band on ports 80 and 443).
pub const NAMED: &str = "named4";
/// Sandboxes whose policy is `"all"`.
pub const ALL: &str = "all4";
/// Each sandbox's host-side interface and the one address it may send from.
pub const BIND: &str = "bind4";
/// Never-reached destinations a sandbox's policy reaches anyway (its `reserved` rules, allowed
/// by an admin): they skip the `never4` check and are in `allow4` too.
pub const OPEN: &str = "open4";

/// What the table is made for.
#[derive(Debug, Clone)]
pub struct Table {
    /// `dsec_<k>`.
    pub name: String,
    /// Host-side interfaces of sandboxes start with this (`dsv<k>-`).
    pub if_prefix: String,
    /// The sandboxes' subnet.
    pub subnet: (Ipv4Addr, u8),
    /// The sandboxes' gateway (the node's DNS listens here).
    pub gateway: Ipv4Addr,
    /// The node's DNS port on the gateway.
    pub dns_port: u16,
    /// The node's in-band check (`proxy.rs`) on the gateway.
    pub proxy_port: u16,
    /// The NFLOG group refused packets are logged to (the node reports them).
    pub log_group: u16,
    /// Networks never reached besides [`NEVER`] and the subnet: the node's own addresses,
    /// its cluster's.
    pub never: Vec<(Ipv4Addr, u8)>,
}

fn nets(list: &[(Ipv4Addr, u8)]) -> String {
    list.iter()
        .map(|(a, l)| format!("{a}/{l}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Adds `list` to table `table`'s `never4` set.
pub fn add_never(table: &str, list: &[(Ipv4Addr, u8)]) -> std::io::Result<()> {
    nft_script(&format!(
        "add element inet {table} never4 {{ {} }}\n",
        nets(list)
    ))
}

impl Table {
    /// Every network no sandbox reaches, whatever its rules.
    pub fn never_nets(&self) -> Vec<(Ipv4Addr, u8)> {
        let mut v: Vec<(Ipv4Addr, u8)> = NEVER.to_vec();
        v.push(self.subnet);
        v.extend(self.never.iter().copied());
        v
    }

    /// The whole table as `nft -f` input: the table is deleted and made again in one
    /// transaction (no moment without rules), its sets empty.
    pub fn script(&self) -> String {
        let (t, p, gw) = (&self.name, &self.if_prefix, self.gateway);
        let never = nets(&self.never_nets());
        let private = nets(&PRIVATE);
        format!(
            "table inet {t} {{}}\ndelete table inet {t}\n\
table inet {t} {{\n\
  set {ALLOW} {{ type ipv4_addr . ipv4_addr . inet_service; flags interval, timeout; }}\n\
  set {NAMED} {{ type ipv4_addr . ipv4_addr . inet_service; flags interval, timeout; }}\n\
  set {DENY} {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}\n\
  set {ALL} {{ type ipv4_addr; }}\n\
  set {BIND} {{ type ifname . ipv4_addr; }}\n\
  set {OPEN} {{ type ipv4_addr . ipv4_addr . inet_service; flags interval; }}\n\
  map caps {{ type ipv4_addr : verdict; }}\n\
  set never4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {never} }}; }}\n\
  set private4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {private} }}; }}\n\
  chain guard {{ type filter hook prerouting priority raw; policy accept;\n\
    iifname \"{p}*\" meta nfproto ipv6 drop\n\
    iifname \"{p}*\" iifname . ip saddr != @{BIND} counter drop\n\
  }}\n\
  chain dns {{ type nat hook prerouting priority dstnat; policy accept;\n\
    iifname \"{p}*\" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gw}:{dns}\n\
    iifname \"{p}*\" tcp dport {{ 80, 443 }} ip saddr . ip daddr . tcp dport @{NAMED} redirect to :{proxy}\n\
  }}\n\
  chain refuse {{\n\
    limit rate 50/second burst 50 packets log group {group}\n\
    counter reject with icmpx admin-prohibited\n\
  }}\n\
  chain to_node {{ type filter hook input priority filter; policy accept;\n\
    iifname \"{p}*\" ct state established,related accept\n\
    iifname \"{p}*\" ip daddr {gw} meta l4proto {{ tcp, udp }} th dport {dns} accept\n\
    iifname \"{p}*\" ip daddr {gw} tcp dport {proxy} accept\n\
    iifname \"{p}*\" jump refuse\n\
  }}\n\
  chain out {{ type filter hook forward priority filter; policy accept;\n\
    oifname \"{p}*\" ct state established,related accept\n\
    oifname \"{p}*\" counter drop\n\
    iifname != \"{p}*\" accept\n\
    ip daddr @never4 ip saddr . ip daddr . th dport != @{OPEN} jump refuse\n\
    meta l4proto != {{ tcp, udp }} counter drop\n\
    ip saddr . ip daddr . th dport @{DENY} jump refuse\n\
    ip saddr vmap @caps\n\
    ip saddr . ip daddr . th dport @{ALLOW} accept\n\
    ip saddr . ip daddr . th dport @{NAMED} accept\n\
    ip saddr @{ALL} ip daddr != @private4 accept\n\
    jump refuse\n\
  }}\n\
  chain masq {{ type nat hook postrouting priority srcnat; policy accept;\n\
    ip saddr {sub} oifname != \"{p}*\" masquerade\n\
  }}\n\
}}\n",
            dns = self.dns_port,
            proxy = self.proxy_port,
            group = self.log_group,
            sub = nets(&[self.subnet]),
        )
    }

    /// Loads [`Table::script`] with `nft -f -`.
    pub fn load(&self) -> std::io::Result<()> {
        nft_script(&self.script())
    }

    /// Deletes the table (nothing if there is none).
    pub fn delete(&self) -> std::io::Result<()> {
        nft_script(&format!(
            "table inet {t} {{}}\ndelete table inet {t}\n",
            t = self.name
        ))
    }
}

/// Runs `nft -f -` on `script`.
pub fn nft_script(script: &str) -> std::io::Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("nft (package nftables): {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "nft -f: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        Table {
            name: format!("dsec_t{}", std::process::id()),
            if_prefix: "dsvt-".into(),
            subnet: (Ipv4Addr::new(10, 239, 224, 0), 19),
            gateway: Ipv4Addr::new(10, 239, 224, 1),
            dns_port: 53,
            proxy_port: 3128,
            log_group: 7999,
            never: vec![(Ipv4Addr::new(192, 0, 2, 2), 32)],
        }
    }

    /// The script is accepted by the kernel (as root: CI is), loads twice (a restart: the
    /// table made anew, its elements gone), and is gone after `delete`.
    #[test]
    fn loads_reloads_and_deletes() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root (CI runs as root)");
        }
        let t = table();
        let list = || {
            let out = Command::new("nft")
                .args(["list", "set", "inet", &t.name, ALL])
                .output()
                .expect("nft list");
            String::from_utf8_lossy(&out.stdout).to_string()
        };
        t.load().expect("load");
        nft_script(&format!(
            "add element inet {} {ALL} {{ 10.239.224.9 }}\n",
            t.name
        ))
        .expect("an element");
        let before = list();
        t.load().expect("reload");
        let after = list();
        t.delete().expect("delete");
        t.delete().expect("delete again");
        assert!(before.contains("10.239.224.9"), "{before}");
        assert!(!after.contains("10.239.224.9"), "{after}");
        let out = Command::new("nft")
            .args(["list", "table", "inet", &t.name])
            .output()
            .expect("nft list");
        assert!(!out.status.success());
    }
}
