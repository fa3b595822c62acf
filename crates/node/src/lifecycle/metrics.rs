//! The node's metrics, resolved once (updates never touch the registry lock).

use crate::metrics::{Counter, Gauge, Histogram, Registry};

/// The node's metrics, resolved once (updates never touch the registry lock).
#[derive(Debug)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Sandboxes created by the runtime (pool fills included).
    pub created: Counter,
    /// Sandboxes destroyed.
    pub destroyed: Counter,
    /// Runtime creates that failed.
    pub create_failed: Counter,
    /// Commands run (exec API).
    pub execs: Counter,
    /// Sandboxes destroyed by TTL or lease expiry.
    pub expired: Counter,
    /// Sandboxes found dead (supervisor or init gone).
    pub died: Counter,
    /// Commands killed by the seccomp filter (SIGSYS).
    pub seccomp_kills: Counter,
    /// Commands that ended `oom`.
    pub oom_kills: Counter,
    /// Sandboxes moved to the batch CPU weight for using their whole share.
    pub cpu_demotions: Counter,
    /// Sandboxes in the batch CPU class now.
    pub cpu_batch: Gauge,
    /// How long each tick of the CPU-share governor took (its cost on the node's CPUs).
    pub cpu_tick: Histogram,
    /// API create latency, pool hits.
    pub acquire_hit: Histogram,
    /// API create latency, created on demand.
    pub acquire_miss: Histogram,
    /// Runtime create phases.
    pub phase_launch: Histogram,
    /// Runtime create phases.
    pub phase_hello: Histogram,
    /// Runtime create phases.
    pub phase_cgroup: Histogram,
    /// Runtime create phases.
    pub phase_clone_exec: Histogram,
    /// Exec latency (whole command).
    pub exec: Histogram,
    /// Reset latency.
    pub reset: Histogram,
    /// Snapshot latency (the copy of the writable layer).
    pub snapshot: Histogram,
    /// Restore (rollback to a snapshot) latency.
    pub restore: Histogram,
    /// Destroy latency.
    pub destroy: Histogram,
    /// VM sandboxes created (snapshot restores), microvm.
    pub vm_created_microvm: Counter,
    /// VM sandboxes created (snapshot restores), vm.
    pub vm_created_vm: Counter,
    /// Create latency of VM sandboxes (restore to identified guest).
    pub vm_restore: Histogram,
    /// Names and DNS answers refused to sandboxes (`egress_denied` events).
    pub egress_denied: Counter,
    /// Giving a sandbox its path out (veth, addresses, set elements).
    pub egress_attach: Histogram,
    /// Paths out made while their sandbox launched (in a pre-built shell's namespaces).
    pub egress_attach_early: Counter,
}

impl Metrics {
    pub(super) fn new() -> Self {
        let registry = Registry::new();
        let c = |n: &str, h: &str| registry.counter(n, h, &[]).unwrap_or_default();
        let h = |n: &str, help: &str, labels: &[(&str, &str)]| {
            registry.histogram(n, help, labels).unwrap_or_default()
        };
        let phase = |p: &str| {
            h(
                "dsec_create_phase_seconds",
                "Runtime create latency by phase (launch: request to supervisor answer; hello: to agent ready)",
                &[("phase", p)],
            )
        };
        let vm_created = |k: &str| {
            registry
                .counter(
                    "dsec_vm_sandboxes_created_total",
                    "VM sandboxes created by restoring their template's snapshot",
                    &[("substrate", k)],
                )
                .unwrap_or_default()
        };
        Self {
            vm_created_microvm: vm_created("microvm"),
            vm_created_vm: vm_created("vm"),
            vm_restore: h(
                "dsec_vm_restore_seconds",
                "VM create latency: QEMU start, snapshot restore, guest identity",
                &[],
            ),
            created: c(
                "dsec_sandboxes_created_total",
                "Sandboxes created by the runtime",
            ),
            destroyed: c("dsec_sandboxes_destroyed_total", "Sandboxes destroyed"),
            create_failed: c(
                "dsec_sandbox_create_failures_total",
                "Runtime creates that failed",
            ),
            execs: c("dsec_execs_total", "Commands run through the exec API"),
            expired: c(
                "dsec_sandboxes_expired_total",
                "Sandboxes destroyed by TTL or lease expiry",
            ),
            died: c(
                "dsec_sandboxes_died_total",
                "Sandboxes found dead (supervisor or init gone)",
            ),
            seccomp_kills: c(
                "dsec_seccomp_kills_total",
                "Commands killed by the seccomp filter",
            ),
            oom_kills: c("dsec_oom_kills_total", "Commands that ended out of memory"),
            cpu_batch: registry
                .gauge(
                    "dsec_cpu_batch_sandboxes",
                    "Sandboxes in the batch CPU class now (they never sleep, or hold a long run)",
                    &[],
                )
                .unwrap_or_default(),
            cpu_tick: h(
                "dsec_cpu_governor_tick_seconds",
                "How long each tick of the CPU-share governor took (sampling and decisions)",
                &[],
            ),
            cpu_demotions: c(
                "dsec_cpu_demotions_total",
                "Sandboxes moved to the batch CPU weight for using their whole fair share",
            ),
            acquire_hit: h(
                "dsec_acquire_seconds",
                "API create latency",
                &[("pool", "hit")],
            ),
            acquire_miss: h(
                "dsec_acquire_seconds",
                "API create latency",
                &[("pool", "miss")],
            ),
            phase_launch: phase("launch"),
            phase_hello: phase("hello"),
            phase_cgroup: phase("cgroup"),
            phase_clone_exec: phase("clone_exec"),
            exec: h("dsec_exec_seconds", "Exec latency", &[]),
            reset: h("dsec_reset_seconds", "Reset latency", &[]),
            snapshot: h(
                "dsec_snapshot_seconds",
                "Snapshot latency (the writable layer's copy)",
                &[],
            ),
            restore: h(
                "dsec_restore_seconds",
                "Restore (rollback to a snapshot) latency",
                &[],
            ),
            destroy: h("dsec_destroy_seconds", "Destroy latency", &[]),
            egress_denied: c(
                "dsec_egress_denied_total",
                "Names and DNS answers refused to sandboxes by their egress policy",
            ),
            egress_attach: h(
                "dsec_egress_attach_seconds",
                "Giving a sandbox its network path out (veth, addresses, nftables elements)",
                &[],
            ),
            egress_attach_early: c(
                "dsec_egress_attach_early_total",
                "Network paths out made while their sandbox launched, in its pre-built shell's namespaces",
            ),
            registry,
        }
    }
}
