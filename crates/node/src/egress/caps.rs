//! Per-sandbox caps of a path out, in the kernel on the host's side, out of the sandbox's
//! reach: a chain of the sandbox's own in the node's table, reached through the `caps`
//! verdict map by everything it sends, counts its open connections (`ct count`,
//! `max_connections`) and polices what it sends (`limit rate … bytes/second`,
//! `bandwidth_bps`); a `tbf` queue on its veth paces what it receives. Only sandboxes that ask
//! for a cap pay for one (`nft`/`tc` runs, a few ms).

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use super::rules::nft_script;

/// The chain of sandbox `addr`'s caps.
fn chain(addr: Ipv4Addr) -> String {
    format!("caps_{:08x}", u32::from(addr))
}

/// Sets sandbox `addr`'s chain of caps in table `table` (replacing the one it had): at most
/// `conns` open connections, `bps` bytes per second sent; neither removes the chain.
pub fn set_chain(
    table: &str,
    addr: Ipv4Addr,
    conns: Option<u32>,
    bps: Option<u64>,
) -> std::io::Result<()> {
    let c = chain(addr);
    // Made empty first so that the delete below always has something to delete.
    let mut s = format!(
        "add chain inet {table} {c}\n\
         add element inet {table} caps {{ {addr} : jump {c} }}\n\
         delete element inet {table} caps {{ {addr} }}\n\
         flush chain inet {table} {c}\n\
         delete chain inet {table} {c}\n"
    );
    if conns.is_some() || bps.is_some() {
        s.push_str(&format!("add chain inet {table} {c}\n"));
        if let Some(n) = conns {
            s.push_str(&format!(
                "add rule inet {table} {c} ct state new ct count over {n} counter reject\n"
            ));
        }
        if let Some(b) = bps {
            s.push_str(&format!(
                "add rule inet {table} {c} limit rate over {b} bytes/second burst {} bytes counter drop\n",
                burst(b)
            ));
        }
        s.push_str(&format!(
            "add element inet {table} caps {{ {addr} : jump {c} }}\n"
        ));
    }
    nft_script(&s)
}

/// A burst of at least a few full-size packets, and ~20 ms of the rate.
fn burst(bps: u64) -> u64 {
    (bps / 50).max(16 * 1024)
}

fn tc(args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("tc")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| std::io::Error::new(e.kind(), format!("tc (package iproute2): {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Paces what `veth` sends into its sandbox to `bps` bytes per second (`None`: no cap).
pub fn set_bandwidth(veth: &str, bps: Option<u64>) -> std::io::Result<()> {
    // Whatever was there goes (an error: there was nothing).
    let _ = tc(&["qdisc", "del", "dev", veth, "root"]);
    let Some(bps) = bps else {
        return Ok(());
    };
    let rate = format!("{}bit", bps.saturating_mul(8));
    let burst = burst(bps).to_string();
    tc(&[
        "qdisc", "add", "dev", veth, "root", "tbf", "rate", &rate, "burst", &burst, "latency",
        "50ms",
    ])
}
