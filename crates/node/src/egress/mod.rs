//! Network egress: a sandbox's path out of its network namespace, enforced by the kernel
//! (a veth, nftables sets) and by the node's DNS, which resolves only allowed names and pins
//! their answers.
//!
//! A sandbox with `egress` other than `none` gets a veth: `eth0` inside with an address of the
//! node's subnet (`/32`, default route on-link to the gateway), `dsv<k>-<n>` outside with the
//! gateway address. Everything it sends passes the node's table `inet dsec_<k>` (see
//! [`rules`]): its source must be its own address, DNS goes to the node, nothing reaches the
//! node or another sandbox, and a destination is reached only through its policy's sets.
//! Sandboxes without egress have no veth and cost nothing.

pub mod caps;
pub mod dns;
pub mod policy;
pub mod proxy;
pub mod rules;
pub mod wire;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dsec_api::network::Egress as Policy;
use dsec_sys::netlink::nft::{concat, ipv4, Element, Nft};
use dsec_sys::netlink::route::Route;

use self::rules::{Table, ALL, ALLOW, BIND, DENY, NAMED, OPEN};

/// Where sandboxes' subnets come from: the `k`-th `/19` of `10.224.0.0/11` for the `k`-th
/// node on a host.
const POOL: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 224, 0, 0), 11);
/// A node's subnet size.
const SUBNET_LEN: u8 = 19;
/// The host's IPv4 forwarding switch (needed for any routed path out).
const FORWARDING: &str = "/proc/sys/net/ipv4/ip_forward";
/// An empty table, present while forwarding was turned on by nodes' egress (it was off).
const FORWARDING_MARK: &str = "dsec_forwarding";

/// How long a pinned DNS answer lets a sandbox open new connections to its address.
const PIN_MS: u64 = 3_600_000;

/// How a node's egress is set up.
#[derive(Debug, Clone, Default)]
pub struct EgressConfig {
    /// The resolver allowed names are resolved with (the host's first `nameserver` when
    /// absent).
    pub resolver: Option<SocketAddr>,
    /// The sandboxes' subnet (a free `/19` of `10.224.0.0/11` when absent).
    pub subnet: Option<(Ipv4Addr, u8)>,
    /// Networks no sandbox may reach besides the built-in ones (the cluster's etcd and
    /// gateways).
    pub never: Vec<(Ipv4Addr, u8)>,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    /// DNS queries from sandboxes.
    pub dns_queries: AtomicU64,
    /// Names and answers refused.
    pub denied: AtomicU64,
    /// Queries dropped for lack of room.
    pub dns_dropped: AtomicU64,
    /// Answers pinned.
    pub pinned: AtomicU64,
}

/// Port ranges (inclusive, sorted, disjoint).
type Ports = Vec<(u16, u16)>;
/// Addresses pinned for a name, each with its ports.
type Pins = Vec<(Ipv4Addr, Ports)>;

/// One sandbox's path out.
#[derive(Debug)]
struct Attached {
    addr: Ipv4Addr,
    veth: String,
    policy: Policy,
    /// Its elements in the static sets.
    statics: policy::Statics,
    /// Names resolved for it: name → (address, port ranges) pinned.
    pins: HashMap<String, Pins>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, Attached>,
    by_addr: HashMap<Ipv4Addr, String>,
    /// The next address index tried (round robin: a freed address is reused last).
    next: u32,
    /// When each (sandbox, name) was last pinned (a lookup of the same answer within half
    /// the pin's lifetime changes nothing in the kernel).
    pinned_at: HashMap<(String, String), std::time::Instant>,
}

/// What an `egress_denied` goes to: (sandbox, the name or address).
pub type DeniedSink = Box<dyn Fn(&str, &str) + Send + Sync>;

/// A VM sandbox's path out: a tap on the host (named like a container's veth, so the table
/// treats both alike) plugged into the hub of the guest's NIC; the guest gives its `eth0` the
/// address and a default route on-link through the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPath {
    /// The tap's name (`dsv<k>-<n>`).
    pub tap: String,
    /// The guest's address.
    pub addr: Ipv4Addr,
    /// The host's end (the gateway address).
    pub gateway: Ipv4Addr,
    /// The policy's bandwidth cap (a queue on the tap).
    pub bandwidth_bps: Option<u64>,
    /// Whether the policy lets anything out: a VM whose policy became `none` keeps its tap
    /// (re-plugging a running QEMU's NIC leaves the guest's link dead), its guest's `eth0`
    /// down or unconfigured, and the table drops all it sends.
    pub open: bool,
}

/// Makes the tap of `path` and its host side (the gateway address, up, a `/32` route to the
/// guest, the bandwidth cap): each QEMU of the sandbox gets a fresh one (the tap goes when the
/// QEMU holding it ends). Answers the descriptor to hand to QEMU.
pub fn open_tap(path: &VmPath) -> std::io::Result<std::os::fd::OwnedFd> {
    let fd = dsec_sys::net::open_tap(&path.tap)?;
    let mut r = Route::open()?;
    r.add_addr4(&path.tap, path.gateway, 32)?;
    r.set_up(&path.tap)?;
    r.add_route4(path.addr, 32, None, &path.tap, false)?;
    if path.bandwidth_bps.is_some() {
        caps::set_bandwidth(&path.tap, path.bandwidth_bps)?;
    }
    Ok(fd)
}

/// The node's egress: its subnet, table, DNS and the sandboxes attached.
pub struct Egress {
    table: Table,
    /// [`Table::never_nets`], and the networks added since ([`Egress::add_never`]).
    never: std::sync::RwLock<Arc<Vec<(Ipv4Addr, u8)>>>,
    upstream: SocketAddr,
    inner: Mutex<Inner>,
    nft: Mutex<Nft>,
    route: Mutex<Route>,
    on_denied: DeniedSink,
    /// Counters.
    pub stats: Stats,
    /// Links of detached sandboxes to remove (see [`Egress::detach`]).
    unlink: Mutex<std::sync::mpsc::Sender<(String, Ipv4Addr)>>,
    /// Set by [`Egress::teardown`]: the NFLOG reader stops.
    stopping: std::sync::atomic::AtomicBool,
    /// Its DNS servers (stopped by [`Egress::teardown`]).
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Holds the node's subnet index on this host (an abstract socket: gone with the node).
    _claim: UnixListener,
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("table", &self.table.name)
            .finish_non_exhaustive()
    }
}

/// An egress failure.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The host cannot give sandboxes egress (no `nft`, no free subnet…).
    #[error("egress is unavailable on this node: {0}")]
    Unavailable(String),
    /// The subnet is full.
    #[error("no free egress address on this node")]
    Full,
    /// Setting up or changing a sandbox's path failed.
    #[error("egress: {0}")]
    Io(#[from] std::io::Error),
}

/// The first `nameserver` of `/etc/resolv.conf`.
fn host_resolver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .map(|a| SocketAddr::from((a, 53)))
}

/// Claims subnet index `k` on this host (an abstract socket name; released when the node
/// exits, however it exits).
fn claim(k: u32) -> Option<UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr =
        std::os::unix::net::SocketAddr::from_abstract_name(format!("dsec-egress-{k}")).ok()?;
    UnixListener::bind_addr(&addr).ok()
}

/// Where a node remembers its subnet index (its egress was started, and a restart takes the
/// same subnet back).
pub fn index_file(data_dir: &Path) -> PathBuf {
    data_dir.join("egress-index")
}

impl Egress {
    /// Sets up the node's egress: claims a subnet (the one it had before a restart if it is
    /// free), loads its table (keeping nothing: [`Egress::adopt`] puts adopted sandboxes
    /// back), turns on IPv4 forwarding and starts its DNS on `rt`.
    pub fn start(
        cfg: EgressConfig,
        data_dir: &Path,
        rt: &tokio::runtime::Handle,
        on_denied: DeniedSink,
    ) -> Result<Arc<Egress>, EgressError> {
        let unavailable = |e: String| EgressError::Unavailable(e);
        let upstream = cfg
            .resolver
            .or_else(host_resolver)
            .ok_or_else(|| unavailable("no resolver (--egress-resolver)".into()))?;
        let count = 1u32 << (SUBNET_LEN - POOL.1);
        let before: Option<u32> = std::fs::read_to_string(index_file(data_dir))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .filter(|k| *k < count);
        let order = before
            .into_iter()
            .chain((0..count).filter(|k| Some(*k) != before));
        let (k, claim) = order
            .filter_map(|k| claim(k).map(|c| (k, c)))
            .next()
            .ok_or_else(|| unavailable("every egress subnet of this host is taken".into()))?;
        let _ = std::fs::write(index_file(data_dir), k.to_string());
        let subnet = cfg.subnet.unwrap_or_else(|| {
            let base = u32::from(POOL.0) + (k << (32 - u32::from(SUBNET_LEN)));
            (Ipv4Addr::from(base), SUBNET_LEN)
        });
        let table = Table {
            name: format!("dsec_{k}"),
            if_prefix: format!("dsv{k}-"),
            subnet,
            gateway: Ipv4Addr::from(u32::from(subnet.0) + 1),
            dns_port: 53,
            proxy_port: 3128,
            log_group: 7000 + k as u16,
            never: cfg.never.clone(),
        };
        // The table first, then forwarding: a node that turns forwarding back off at its
        // teardown looks for other nodes' tables (see `teardown`).
        table.load().map_err(|e| unavailable(e.to_string()))?;
        let forwarding = std::fs::read_to_string(FORWARDING).unwrap_or_default();
        if forwarding.trim() != "1" {
            std::fs::write(FORWARDING, "1").map_err(|e| {
                let _ = table.delete();
                unavailable(format!("IPv4 forwarding: {e}"))
            })?;
            // Remembered in the kernel, for whichever node of the host is the last to go:
            // an empty table says that forwarding was off before the nodes' egress.
            let _ = rules::nft_script(&format!("add table inet {FORWARDING_MARK}\n"));
        }
        let fail = |e: std::io::Error| {
            let _ = table.delete();
            unavailable(e.to_string())
        };
        let nft = Nft::open().map_err(&fail)?;
        let route = Route::open().map_err(&fail)?;
        let gw = SocketAddr::from((table.gateway, table.dns_port));
        let udp = dsec_sys::net::bind_freebind_udp(gw).map_err(&fail)?;
        let tcp = dsec_sys::net::bind_freebind_tcp(gw).map_err(&fail)?;
        let relay =
            dsec_sys::net::bind_freebind_tcp(SocketAddr::from((table.gateway, table.proxy_port)))
                .map_err(&fail)?;
        let (unlink_tx, unlink_rx) = std::sync::mpsc::channel();
        let eg = Arc::new(Egress {
            never: std::sync::RwLock::new(Arc::new(table.never_nets())),
            table,
            upstream,
            inner: Mutex::new(Inner {
                next: 2,
                ..Inner::default()
            }),
            nft: Mutex::new(nft),
            route: Mutex::new(route),
            on_denied,
            stats: Stats::default(),
            tasks: Mutex::new(Vec::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            unlink: Mutex::new(unlink_tx),
            _claim: claim,
        });
        eg.start_unlinker(unlink_rx);
        eg.read_refusals();
        let _guard = rt.enter();
        let udp = tokio::net::UdpSocket::from_std(udp).map_err(EgressError::Io)?;
        let tcp = tokio::net::TcpListener::from_std(tcp).map_err(EgressError::Io)?;
        let relay = tokio::net::TcpListener::from_std(relay).map_err(EgressError::Io)?;
        let tasks = vec![
            rt.spawn(dns::serve_udp(Arc::clone(&eg), udp)),
            rt.spawn(dns::serve_tcp(Arc::clone(&eg), tcp)),
            rt.spawn(proxy::serve(Arc::clone(&eg), relay)),
        ];
        *eg.tasks.lock().unwrap_or_else(|p| p.into_inner()) = tasks;
        tracing::info!(
            table = %eg.table.name,
            subnet = %format!("{}/{}", subnet.0, subnet.1),
            resolver = %upstream,
            "egress ready"
        );
        Ok(eg)
    }

    /// Reports what the kernel refused sandboxes (the table's `refuse` chain logs to the
    /// node's NFLOG group, at most 50 packets a second): an `egress_denied` of the sandbox with
    /// the destination. A thread of its own, ended by [`Egress::teardown`].
    fn read_refusals(self: &Arc<Self>) {
        let mut log = match dsec_sys::netlink::log::Log::bind(self.table.log_group) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(group = %self.table.log_group, error = %e, "egress: refusals will not be reported");
                return;
            }
        };
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("egress-refusals".into())
            .spawn(move || loop {
                let got = log.receive();
                let Some(eg) = weak.upgrade() else { return };
                if eg.stopping.load(Ordering::Relaxed) {
                    return;
                }
                match got {
                    Ok(packets) => {
                        for p in packets {
                            if let Some((id, _)) = eg.policy_of(p.src) {
                                let port = p.dport.map(|d| format!(":{d}")).unwrap_or_default();
                                eg.denied(&id, &format!("{}{port}", p.dst));
                            }
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => std::thread::sleep(std::time::Duration::from_secs(1)),
                }
            });
    }

    /// Every network no sandbox reaches (every DNS answer is checked against it).
    pub fn never_nets(&self) -> Arc<Vec<(Ipv4Addr, u8)>> {
        Arc::clone(&self.never.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Adds `nets` to the networks no sandbox reaches, from now on and for connections open
    /// now (every outbound packet is checked against `never4`): the cluster's gateways, as
    /// they appear. Networks never go out of the set while the node runs.
    pub fn add_never(&self, nets: &[(Ipv4Addr, u8)]) -> std::io::Result<()> {
        let mut never = self.never.write().unwrap_or_else(|p| p.into_inner());
        let new: Vec<(Ipv4Addr, u8)> = nets
            .iter()
            .copied()
            .filter(|&(a, l)| l != 32 || !policy::in_nets(&never, a))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        rules::add_never(&self.table.name, &new)?;
        let mut all = (**never).clone();
        all.extend(new);
        *never = Arc::new(all);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandbox that has `addr`, and its policy.
    pub fn policy_of(&self, addr: Ipv4Addr) -> Option<(String, Policy)> {
        let inner = self.lock();
        let id = inner.by_addr.get(&addr)?;
        let a = inner.by_id.get(id)?;
        Some((id.clone(), a.policy.clone()))
    }

    /// Reports a refused name or address of sandbox `id`.
    pub fn denied(&self, id: &str, what: &str) {
        self.stats.denied.fetch_add(1, Ordering::Relaxed);
        (self.on_denied)(id, what);
    }

    fn bind_element(veth: &str, addr: Ipv4Addr) -> Element {
        let mut name = [0u8; 16];
        let n = veth.len().min(15);
        name[..n].copy_from_slice(&veth.as_bytes()[..n]);
        Element {
            key: concat(&[&name, &ipv4(addr)]),
            key_end: None,
            timeout_ms: None,
        }
    }

    fn all_element(addr: Ipv4Addr) -> Element {
        Element {
            key: ipv4(addr).to_vec(),
            key_end: None,
            timeout_ms: None,
        }
    }

    /// Adds (or, `add == false`, removes) a sandbox's static elements.
    fn apply_statics(&self, a: &Attached, add: bool) -> std::io::Result<()> {
        let t = &self.table.name;
        let mut nft = self.nft.lock().unwrap_or_else(|p| p.into_inner());
        let policy::Statics {
            allow,
            deny,
            open,
            all,
        } = &a.statics;
        let bind = [Self::bind_element(&a.veth, a.addr)];
        let all = if *all {
            vec![Self::all_element(a.addr)]
        } else {
            Vec::new()
        };
        // One transaction (the deny list first, the binding that lets traffic through last,
        // should it take more than one batch).
        let sets = [
            (DENY, &deny[..]),
            (ALLOW, &allow[..]),
            (ALL, &all[..]),
            (OPEN, &open[..]),
            (BIND, &bind[..]),
        ];
        if add {
            nft.add_to_sets(t, &sets)
        } else {
            nft.del_from_sets(t, &sets)
        }
    }

    /// A policy's caps: (bytes per second, connections).
    fn caps_of(policy: &Policy) -> (Option<u64>, Option<u32>) {
        match policy {
            Policy::Allow(l) => (l.bandwidth_bps, l.max_connections),
            _ => (None, None),
        }
    }

    /// Sets sandbox `addr`'s caps (on `veth`) from `new` where they differ from `old`.
    fn apply_caps(
        &self,
        veth: &str,
        addr: Ipv4Addr,
        old: &Policy,
        new: &Policy,
    ) -> std::io::Result<()> {
        let (ob, oc) = Self::caps_of(old);
        let (nb, nc) = Self::caps_of(new);
        if (ob, oc) != (nb, nc) {
            caps::set_chain(&self.table.name, addr, nc, nb)?;
        }
        if ob != nb {
            caps::set_bandwidth(veth, nb)?;
        }
        Ok(())
    }

    fn pin_elements(addr: Ipv4Addr, pins: &[(Ipv4Addr, Vec<(u16, u16)>)]) -> Vec<Element> {
        pins.iter()
            .flat_map(|(a, ports)| {
                ports
                    .iter()
                    .map(move |p| policy::element(addr, *a, 32, *p, Some(PIN_MS)))
            })
            .collect()
    }

    /// Gives sandbox `id` (its init is `pid`) a path out under `policy`; answers its address.
    pub fn attach(&self, id: &str, pid: i32, policy: &Policy) -> Result<Ipv4Addr, EgressError> {
        let (addr, veth) = self.allocate(id, policy)?;
        let made = self.plumb(&veth, addr, pid);
        let a = {
            let inner = self.lock();
            inner
                .by_id
                .get(id)
                .map(|a| (a.addr, a.veth.clone(), a.statics.clone()))
        };
        let statics = made.and_then(|()| {
            let Some((addr, veth, statics)) = a else {
                return Err(std::io::Error::other("detached while attached"));
            };
            let probe = Attached {
                addr,
                veth,
                policy: policy.clone(),
                statics,
                pins: HashMap::new(),
            };
            self.apply_statics(&probe, true)?;
            self.apply_caps(&probe.veth, addr, &Policy::None, policy)
        });
        if let Err(e) = statics {
            self.detach(id);
            return Err(EgressError::Io(e));
        }
        Ok(addr)
    }

    /// Gives VM sandbox `id` a path out under `policy`: its address and elements, and the tap
    /// its QEMU gets plugged in (made by [`open_tap`] each time a QEMU of it starts). The
    /// guest configures its own side.
    pub fn attach_vm(&self, id: &str, policy: &Policy) -> Result<VmPath, EgressError> {
        let (addr, tap) = self.allocate(id, policy)?;
        let probe = Attached {
            addr,
            veth: tap.clone(),
            policy: policy.clone(),
            statics: policy::static_elements(addr, policy),
            pins: HashMap::new(),
        };
        let (bps, conns) = Self::caps_of(policy);
        let done = self.apply_statics(&probe, true).and_then(|()| {
            if (bps, conns) != (None, None) {
                caps::set_chain(&self.table.name, addr, conns, bps)?;
            }
            Ok(())
        });
        if let Err(e) = done {
            self.detach(id);
            return Err(EgressError::Io(e));
        }
        Ok(VmPath {
            tap,
            addr,
            gateway: self.table.gateway,
            bandwidth_bps: bps,
            open: *policy != Policy::None,
        })
    }

    /// VM sandbox `id`'s path out as it is now (its tap, address, bandwidth cap).
    pub fn vm_path(&self, id: &str) -> Option<VmPath> {
        let inner = self.lock();
        let a = inner.by_id.get(id)?;
        Some(VmPath {
            tap: a.veth.clone(),
            addr: a.addr,
            gateway: self.table.gateway,
            bandwidth_bps: Self::caps_of(&a.policy).0,
            open: a.policy != Policy::None,
        })
    }

    /// Records sandbox `id` at a free address.
    fn allocate(&self, id: &str, policy: &Policy) -> Result<(Ipv4Addr, String), EgressError> {
        let (net, len) = self.table.subnet;
        let size = 1u32 << (32 - u32::from(len));
        let mut inner = self.lock();
        if let Some(a) = inner.by_id.get(id) {
            return Ok((a.addr, a.veth.clone()));
        }
        let start = inner.next.clamp(2, size - 2);
        let free = (0..size - 3)
            .map(|i| 2 + (start - 2 + i) % (size - 3))
            .find(|i| {
                !inner
                    .by_addr
                    .contains_key(&Ipv4Addr::from(u32::from(net) + i))
            })
            .ok_or(EgressError::Full)?;
        inner.next = free + 1;
        let addr = Ipv4Addr::from(u32::from(net) + free);
        let veth = format!("{}{free:x}", self.table.if_prefix);
        inner.by_addr.insert(addr, id.to_owned());
        inner.by_id.insert(
            id.to_owned(),
            Attached {
                addr,
                veth: veth.clone(),
                policy: policy.clone(),
                statics: policy::static_elements(addr, policy),
                pins: HashMap::new(),
            },
        );
        Ok((addr, veth))
    }

    /// The veth and its addresses and routes, both sides.
    fn plumb(&self, veth: &str, addr: Ipv4Addr, pid: i32) -> std::io::Result<()> {
        let gw = self.table.gateway;
        let peer = {
            let mut r = self.route.lock().unwrap_or_else(|p| p.into_inner());
            // (A link left by a node that died is replaced.)
            let peer = match r.add_veth(veth, "eth0", pid) {
                Err(e) if dsec_sys::netlink::errno(&e) == Some(libc::EEXIST) => {
                    r.del_link(veth)?;
                    r.add_veth(veth, "eth0", pid)?
                }
                made => made?,
            };
            r.add_addr4(veth, gw, 32)?;
            r.set_up(veth)?;
            r.add_route4(addr, 32, None, veth, false)?;
            peer
        };
        let mut inside = Route::open_in(pid)?;
        if let Some(i) = peer {
            inside.remember("eth0", i);
        }
        inside.add_addr4("eth0", addr, 32)?;
        inside.set_up("eth0")?;
        inside.add_route4(Ipv4Addr::UNSPECIFIED, 0, Some(gw), "eth0", true)?;
        Ok(())
    }

    /// Takes a sandbox that kept its path across a restart of the node back (its veth is
    /// still there when its namespace is): its address and policy as recorded.
    pub fn adopt(&self, id: &str, addr: Ipv4Addr, policy: &Policy) -> Result<(), EgressError> {
        let (net, len) = self.table.subnet;
        if policy::in_nets(&[(net, len)], addr) {
            let veth = format!(
                "{}{:x}",
                self.table.if_prefix,
                u32::from(addr) - u32::from(net)
            );
            let a = Attached {
                addr,
                veth,
                policy: policy.clone(),
                statics: policy::static_elements(addr, policy),
                pins: HashMap::new(),
            };
            self.apply_statics(&a, true)?;
            // (The table was made anew: a connection cap is put back; a bandwidth cap lives
            // on the veth, which kept it.)
            let (bps, conns) = Self::caps_of(policy);
            caps::set_chain(&self.table.name, addr, conns, bps)?;
            let mut inner = self.lock();
            inner.by_addr.insert(addr, id.to_owned());
            inner.by_id.insert(id.to_owned(), a);
            Ok(())
        } else {
            Err(EgressError::Unavailable(format!(
                "{addr} is outside this node's egress subnet"
            )))
        }
    }

    /// Replaces sandbox `id`'s policy: its sets change at once; names it resolved stay pinned
    /// only as far as the new policy still allows them.
    pub fn set_policy(&self, id: &str, new: &Policy) -> Result<(), EgressError> {
        let mut inner = self.lock();
        let Some(a) = inner.by_id.get_mut(id) else {
            return Err(EgressError::Unavailable(format!("{id} has no path out")));
        };
        let old_pins: Vec<_> = a.pins.values().flatten().cloned().collect();
        let next = Attached {
            addr: a.addr,
            veth: a.veth.clone(),
            policy: new.clone(),
            statics: policy::static_elements(a.addr, new),
            pins: HashMap::new(),
        };
        self.apply_statics(a, false)?;
        {
            let mut nft = self.nft.lock().unwrap_or_else(|p| p.into_inner());
            nft.del_elements(
                &self.table.name,
                NAMED,
                &Self::pin_elements(a.addr, &old_pins),
            )?;
        }
        let kept: Vec<(String, Pins)> = a
            .pins
            .iter()
            .filter_map(|(name, pins)| match policy::name_verdict(new, name) {
                policy::NameVerdict::Pin(ports) => Some((
                    name.clone(),
                    pins.iter().map(|(ip, _)| (*ip, ports.clone())).collect(),
                )),
                _ => None,
            })
            .collect();
        let old_policy = std::mem::replace(a, next).policy;
        self.apply_statics(a, true)?;
        self.apply_caps(&a.veth.clone(), a.addr, &old_policy, new)?;
        let addr = a.addr;
        for (name, pins) in kept {
            a.pins.insert(name, pins);
        }
        let all: Vec<_> = a.pins.values().flatten().cloned().collect();
        drop(inner);
        let mut nft = self.nft.lock().unwrap_or_else(|p| p.into_inner());
        nft.add_elements(&self.table.name, NAMED, &Self::pin_elements(addr, &all))?;
        Ok(())
    }

    /// Pins `addrs` (answers for `name`) for sandbox `id`, ports `ports`.
    pub fn pin(
        &self,
        id: &str,
        name: &str,
        addrs: &[Ipv4Addr],
        ports: &[(u16, u16)],
    ) -> std::io::Result<()> {
        let mut inner = self.lock();
        let key = (id.to_owned(), name.to_owned());
        let same: Pins = addrs.iter().map(|ip| (*ip, ports.to_vec())).collect();
        let fresh = inner
            .pinned_at
            .get(&key)
            .is_some_and(|t| t.elapsed() < std::time::Duration::from_millis(PIN_MS / 2));
        let Some(a) = inner.by_id.get_mut(id) else {
            return Ok(());
        };
        if fresh && a.pins.get(name) == Some(&same) {
            return Ok(());
        }
        // Every pin of an address merged into one list of ranges (the kernel refuses
        // overlapping elements): what was there is replaced.
        let mut old: Vec<(Ipv4Addr, Vec<(u16, u16)>)> = Vec::new();
        let mut new: Vec<(Ipv4Addr, Vec<(u16, u16)>)> = Vec::new();
        for ip in addrs {
            let mut ranges = ports.to_vec();
            for pins in a.pins.values() {
                for (p, r) in pins {
                    if p == ip {
                        old.push((*p, r.clone()));
                        ranges.extend(r.iter().copied());
                    }
                }
            }
            new.push((*ip, policy::union(ranges)));
        }
        let addr = a.addr;
        a.pins.insert(name.to_owned(), same);
        inner.pinned_at.insert(key, std::time::Instant::now());
        drop(inner);
        let mut nft = self.nft.lock().unwrap_or_else(|p| p.into_inner());
        nft.del_elements(&self.table.name, NAMED, &Self::pin_elements(addr, &old))?;
        nft.add_elements(&self.table.name, NAMED, &Self::pin_elements(addr, &new))?;
        self.stats
            .pinned
            .fetch_add(addrs.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Removes sandbox `id`'s path (its elements, its veth; the veth is gone anyway once its
    /// namespace is).
    pub fn detach(&self, id: &str) {
        let a = {
            let mut inner = self.lock();
            let Some(a) = inner.by_id.remove(id) else {
                return;
            };
            // The address stays taken (by no sandbox) until its link is gone.
            inner.by_addr.insert(a.addr, String::new());
            inner.pinned_at.retain(|(sb, _), _| sb != id);
            a
        };
        let pins: Vec<_> = a.pins.values().flatten().cloned().collect();
        if Self::caps_of(&a.policy) != (None, None) {
            let _ = caps::set_chain(&self.table.name, a.addr, None, None);
        }
        if let Err(e) = self.apply_statics(&a, false) {
            tracing::warn!(sandbox = %id, error = %e, "egress: elements not removed");
        }
        {
            let mut nft = self.nft.lock().unwrap_or_else(|p| p.into_inner());
            let _ = nft.del_elements(&self.table.name, NAMED, &Self::pin_elements(a.addr, &pins));
        }
        // Removing a link waits for the kernel (~15–25 ms): done off the caller's path (a
        // destroy's namespace takes its veth along anyway), then the address is free again.
        let _ = self
            .unlink
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((a.veth, a.addr));
    }

    /// The thread that removes detached sandboxes' links, one at a time, and frees their
    /// addresses.
    fn start_unlinker(self: &Arc<Self>, rx: std::sync::mpsc::Receiver<(String, Ipv4Addr)>) {
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("egress-unlink".into())
            .spawn(move || {
                let Ok(mut r) = Route::open() else { return };
                while let Ok((veth, addr)) = rx.recv() {
                    let _ = r.del_link(&veth);
                    let Some(eg) = weak.upgrade() else { return };
                    let mut inner = eg.lock();
                    if inner.by_addr.get(&addr).is_some_and(String::is_empty) {
                        inner.by_addr.remove(&addr);
                    }
                }
            });
    }

    /// The egress series of `/metrics`: DNS counters, sandboxes with a path, and each one's
    /// bytes out and in (its veth's counters; a blocking netlink dump per sandbox).
    pub fn metrics_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let s = &self.stats;
        for (name, help, v) in [
            (
                "dsec_egress_dns_queries_total",
                "DNS queries from sandboxes with egress",
                &s.dns_queries,
            ),
            (
                "dsec_egress_dns_dropped_total",
                "DNS queries dropped for lack of room",
                &s.dns_dropped,
            ),
            (
                "dsec_egress_pinned_total",
                "Addresses pinned from DNS answers",
                &s.pinned,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let veths: Vec<(String, String)> = {
            let inner = self.lock();
            inner
                .by_id
                .iter()
                .map(|(id, a)| (id.clone(), a.veth.clone()))
                .collect()
        };
        let _ = writeln!(
            out,
            "# HELP dsec_egress_sandboxes Sandboxes with a path out\n# TYPE dsec_egress_sandboxes gauge\ndsec_egress_sandboxes {}",
            veths.len()
        );
        // One dump on a socket of its own: a scrape neither waits for attaches nor holds them
        // up, however many sandboxes.
        let stats = Route::open()
            .and_then(|mut r| r.links_stats(&self.table.if_prefix))
            .unwrap_or_default();
        let bytes: Vec<(String, u64, u64)> = veths
            .into_iter()
            .filter_map(|(id, veth)| {
                // The host side's receive is what the sandbox sent.
                stats.get(&veth).map(|&(rx, tx)| (id, rx, tx))
            })
            .collect();
        for (name, dir, pick) in [
            ("dsec_sandbox_egress_bytes_total", "out", 0usize),
            ("dsec_sandbox_egress_bytes_total", "in", 1),
        ] {
            if dir == "out" {
                let _ = writeln!(
                    out,
                    "# HELP {name} Bytes through a sandbox's path out, by direction\n# TYPE {name} counter"
                );
            }
            for (id, rx, tx) in &bytes {
                let v = if pick == 0 { rx } else { tx };
                let _ = writeln!(out, "{name}{{sandbox=\"{id}\",direction=\"{dir}\"}} {v}");
            }
        }
        out
    }

    /// How many sandboxes have a path out.
    pub fn attached(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Removes the node's table and every veth of its prefix (the node stops with no sandbox
    /// left that has egress).
    pub fn teardown(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        let prefix = self.table.if_prefix.clone();
        let mut r = self.route.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(links) = r.links() {
            for l in links.iter().filter(|l| l.starts_with(&prefix)) {
                let _ = r.del_link(l);
            }
        }
        if let Err(e) = self.table.delete() {
            tracing::warn!(error = %e, "egress: table not removed");
        }
    }

    /// Turns IPv4 forwarding off again when nodes' egress turned it on (the mark table is
    /// there) and no node's table is left on the host: the machine as the first node found it.
    pub fn restore_forwarding() {
        let Ok(out) = std::process::Command::new("nft")
            .args(["list", "tables"])
            .output()
        else {
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let tables: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("table inet "))
            .collect();
        let marked = tables.contains(&FORWARDING_MARK);
        let nodes = tables.iter().any(|t| {
            t.strip_prefix("dsec_")
                .is_some_and(|k| k.bytes().all(|b| b.is_ascii_digit()))
        });
        if marked && !nodes {
            let _ = std::fs::write(FORWARDING, "0");
            let _ = rules::nft_script(&format!("delete table inet {FORWARDING_MARK}\n"));
        }
    }
}
