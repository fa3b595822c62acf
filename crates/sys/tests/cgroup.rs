//! Integration tests of `dsec_sys::cgroup`. Run as root; they are never skipped.
//!
//! - Real-kernel tests use the host layout from [`CgroupManager::detect`] (v1 on the dev VM, v2
//!   on production-like hosts) and check limits, attach, enforcement, kill and removal.
//! - v2 paths are also exercised on the host's cgroup2 mount even when it has no controllers
//!   (directory creation, attach, `cgroup.procs`, `cgroup.kill`, the device program), and the
//!   v2 file-writing logic on a fake root (a plain temporary directory with the expected files).
//!
//! Every test has a base cgroup of its own (`dsec-test-cg-<pid>-<test>`, so that tests running
//! at once, here or in another checkout, never share one) and removes its cgroups and that
//! base, in every hierarchy, in `Drop` guards, also when it fails.

use std::error::Error;
use std::fs;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use dsec_sys::cgroup::devices::{ACCESS_MKNOD, ACCESS_READ, ACCESS_WRITE};
use dsec_sys::cgroup::{
    parse_mountinfo, Cgroup, CgroupError, CgroupLayout, CgroupLimits, CgroupManager, CgroupVersion,
    DeviceRule, MountInfo, SwapLimit,
};

type TestResult = Result<(), Box<dyn Error>>;

const BASE: &str = "dsec-test-cg";
const MIB: u64 = 1 << 20;

/// Kills and removes the named cgroup when dropped.
struct CgGuard<'a> {
    mgr: &'a CgroupManager,
    name: String,
}

impl<'a> CgGuard<'a> {
    fn new(mgr: &'a CgroupManager, name: &str) -> Self {
        // Leftovers of an earlier crashed run.
        if let Some(old) = mgr.open(name) {
            let _ = old.kill_all();
            let _ = old.remove();
        }
        Self {
            mgr,
            name: name.to_owned(),
        }
    }
}

impl Drop for CgGuard<'_> {
    fn drop(&mut self) {
        if let Some(cg) = self.mgr.open(&self.name) {
            let _ = cg.kill_all();
            let _ = cg.remove();
        }
    }
}

/// Kills and reaps a child when dropped.
struct ChildGuard(Child);

impl ChildGuard {
    fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).expect("invariant: pids fit in i32")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A manager over a base cgroup of one test's own; dropping it removes every cgroup below the
/// base and the base itself, in every hierarchy.
struct TestCgroups {
    mgr: CgroupManager,
    base: String,
}

impl Deref for TestCgroups {
    type Target = CgroupManager;
    fn deref(&self) -> &CgroupManager {
        &self.mgr
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        for name in self.mgr.list().unwrap_or_default() {
            if let Some(cg) = self.mgr.open(&name) {
                let _ = cg.kill_all();
                let _ = cg.remove();
            }
        }
        for dir in self.mgr.base_dirs() {
            match fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => eprintln!("removing {}: {e}", dir.display()),
            }
        }
    }
}

/// Creates the cgroup `name` with `limits` under `mgr`; returns both (dropping `mgr` kills and
/// removes the cgroup).
fn with_cgroup(
    mgr: TestCgroups,
    name: &str,
    limits: CgroupLimits,
) -> Result<(TestCgroups, Cgroup), CgroupError> {
    let cg = mgr.create(name, &limits)?;
    Ok((mgr, cg))
}

/// [`with_cgroup`] of the host layout and default limits.
fn host_cgroup(test: &str, name: &str) -> Result<(TestCgroups, Cgroup), CgroupError> {
    with_cgroup(host(test), name, CgroupLimits::default())
}

/// Kills everything in `cg`, which must then be empty, and asserts `child` died of SIGKILL.
fn kill_all_sigkills(cg: &Cgroup, child: &mut ChildGuard) -> TestResult {
    cg.kill_all()?;
    assert!(cg.pids()?.is_empty());
    let status = child.0.wait()?;
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    Ok(())
}

fn test_base(prefix: &str, test: &str) -> String {
    format!("{prefix}-{}-{test}", std::process::id())
}

fn host(test: &str) -> TestCgroups {
    let base = test_base(BASE, test);
    let mgr =
        CgroupManager::detect(&base).expect("cgroup layout detection (tests must run as root)");
    TestCgroups { mgr, base }
}

fn read(path: &Path) -> String {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .trim()
        .to_owned()
}

fn spawn(program: &str, args: &[&str]) -> Result<ChildGuard, Box<dyn Error>> {
    Ok(ChildGuard(
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

/// Spawns `sh -c` that joins `cg` (writes `$$` into every `cgroup.procs`) before running
/// `script`, so everything it forks starts inside the cgroup.
fn spawn_in(cg: &Cgroup, script: &str) -> Result<ChildGuard, Box<dyn Error>> {
    let join: String = cg
        .procs_paths()
        .iter()
        .map(|p| format!("echo $$ > '{}' || exit 99; ", p.display()))
        .collect();
    spawn("sh", &["-c", &format!("{join}{script}")])
}

fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        thread::sleep(Duration::from_millis(10));
    }
    cond()
}

fn all_gone(dirs: &[PathBuf]) -> bool {
    dirs.iter().all(|d| !d.exists())
}

/// Removes `cg` and checks that none of its directories is left.
fn remove_all_gone(cg: Cgroup) -> TestResult {
    let dirs = cg.dirs();
    cg.remove()?;
    assert!(all_gone(&dirs), "{dirs:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Real kernel, detected layout (v1 here).
// ---------------------------------------------------------------------------------------------

#[test]
fn detect_finds_v1_hierarchies_here() {
    let mgr = host("detect_finds_v1_hierarchies_here");
    if let CgroupLayout::V1 {
        cpu, memory, pids, ..
    } = mgr.layout()
    {
        for dir in [cpu, memory, pids] {
            assert!(dir.join("cgroup.procs").exists(), "{}", dir.display());
        }
    }
}

#[test]
fn limits_are_written_and_read_back() -> TestResult {
    let mgr = host("limits_are_written_and_read_back");
    let name = "limits";
    let _guard = CgGuard::new(&mgr, name);
    let limits = every_limit(200, (50_000, 100_000), 256 * MIB, 512 * MIB, 5);
    let cg = mgr.create(name, &limits)?;
    assert_eq!(cg.name(), name);
    match mgr.layout() {
        CgroupLayout::V1 {
            cpu, memory, pids, ..
        } => {
            let cpu = cpu.join(&mgr.base).join(name);
            let memory = memory.join(&mgr.base).join(name);
            let pids = pids.join(&mgr.base).join(name);
            assert_eq!(read(&cpu.join("cpu.shares")), "2048");
            assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "50000");
            assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");
            assert_eq!(
                read(&memory.join("memory.limit_in_bytes")),
                (512 * MIB).to_string()
            );
            assert_eq!(
                read(&memory.join("memory.soft_limit_in_bytes")),
                (256 * MIB).to_string()
            );
            let memsw = memory.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                assert_eq!(read(&memsw), (512 * MIB).to_string());
                assert_eq!(cg.swap_limit(), Some(SwapLimit::Disabled));
            } else {
                assert_eq!(cg.swap_limit(), Some(SwapLimit::NotAccounted));
            }
            assert_eq!(read(&pids.join("pids.max")), "5");
            // OOM killer left enabled.
            assert!(read(&memory.join("memory.oom_control")).contains("oom_kill_disable 0"));

            // Raising the limit above memsw takes the EINVAL path (memsw lifted first), and
            // lowering it again; memsw follows the raise.
            for (max, memsw_follows) in [(1024 * MIB, true), (64 * MIB, false)] {
                cg.set_limits(&CgroupLimits {
                    memory_max: Some(max),
                    ..CgroupLimits::default()
                })?;
                assert_eq!(read(&memory.join("memory.limit_in_bytes")), max.to_string());
                if memsw_follows && memsw.exists() {
                    assert_eq!(read(&memsw), max.to_string());
                }
            }
        }
        CgroupLayout::V2 { root } => {
            let dir = root.join(&mgr.base).join(name);
            assert_eq!(read(&dir.join("cpu.weight")), "200");
            assert_eq!(read(&dir.join("cpu.max")), "50000 100000");
            assert_eq!(read(&dir.join("memory.high")), (256 * MIB).to_string());
            assert_eq!(read(&dir.join("memory.max")), (512 * MIB).to_string());
            assert_eq!(read(&dir.join("pids.max")), "5");
        }
    }
    remove_all_gone(cg)?;
    Ok(())
}

#[test]
fn attach_pids_kill_remove() -> TestResult {
    let (_mgr, cg) = host_cgroup("attach_pids_kill_remove", "attach")?;
    let mut child = spawn("sleep", &["30"])?;
    cg.attach(child.pid())?;
    assert_eq!(cg.pids()?, vec![child.pid()]);
    for procs in cg.procs_paths() {
        assert_eq!(read(&procs), child.pid().to_string(), "{}", procs.display());
    }
    assert_eq!(cg.stats()?.pids_current, 1);

    kill_all_sigkills(&cg, &mut child)?;
    remove_all_gone(cg)?;
    Ok(())
}

/// The device list of the device tests: `/dev/null` and `/dev/zero`, and every pty.
const TEST_DEVICES: [DeviceRule; 3] = [
    DeviceRule::char(1, Some(3), ACCESS_READ | ACCESS_WRITE | ACCESS_MKNOD),
    DeviceRule::char(1, Some(5), ACCESS_READ | ACCESS_WRITE),
    DeviceRule::char(136, None, ACCESS_READ | ACCESS_WRITE),
];

/// Runs `sh` in `cg`: it opens `/dev/null` and `/dev/zero` (on the list) and `/dev/kmsg` (not
/// on it; this test process, root with every capability, may open it otherwise) and prints
/// what happened, one word each.
fn open_devices_in(cg: &Cgroup) -> Result<String, Box<dyn Error>> {
    let join: String = cg
        .procs_paths()
        .iter()
        .map(|p| format!("echo $$ > '{}' || exit 99; ", p.display()))
        .collect();
    let script = format!(
        "{join}for d in null zero kmsg; do \
           if (exec 3< /dev/$d) 2>/dev/null; then echo $d-opened; else echo $d-refused; fi; \
         done"
    );
    let out = Command::new("sh").args(["-c", &script]).output()?;
    assert!(out.status.success(), "{out:?}");
    Ok(String::from_utf8(out.stdout)?)
}

/// v1: `limit_devices` writes the list (read back from `devices.list`), the kernel enforces
/// it, and the devices directory is renamed and removed with the others.
#[test]
fn v1_device_list_is_enforced_renamed_and_removed() -> TestResult {
    let mgr = host("v1_device_list_is_enforced_renamed_and_removed");
    let CgroupLayout::V1 {
        devices: Some(_), ..
    } = mgr.layout()
    else {
        // Not a v1 host with the devices hierarchy: the v2 program is tested below.
        return Ok(());
    };
    let name = "devices";
    let _guard = CgGuard::new(&mgr, name);
    let cg = mgr.create(name, &CgroupLimits::default())?;
    let dir = cg.devices_dir().expect("a devices directory").to_owned();
    assert!(cg.dirs().contains(&dir));
    assert!(cg.limit_devices(&TEST_DEVICES)?);
    assert_eq!(
        read(&dir.join("devices.list")),
        "c 1:3 rwm\nc 1:5 rw\nc 136:* rw"
    );
    assert_eq!(
        open_devices_in(&cg)?,
        "null-opened\nzero-opened\nkmsg-refused\n"
    );

    let _renamed_guard = CgGuard::new(&mgr, "devices-renamed");
    let cg = mgr.rename(cg, "devices-renamed")?;
    let renamed = cg.devices_dir().expect("a devices directory").to_owned();
    assert!(!dir.exists() && renamed.exists(), "{}", renamed.display());
    assert_eq!(
        read(&renamed.join("devices.list")),
        "c 1:3 rwm\nc 1:5 rw\nc 136:* rw"
    );
    remove_all_gone(cg)?;
    Ok(())
}

#[test]
fn pids_max_is_enforced() -> TestResult {
    let (_mgr, cg) = with_cgroup(
        host("pids_max_is_enforced"),
        "pidsmax",
        CgroupLimits {
            pids_max: Some(5),
            ..CgroupLimits::default()
        },
    )?;
    // Five tasks fit (the shell and four sleeps); the fifth fork fails and dash gives up,
    // leaving the sleeps behind.
    let _sh = spawn_in(&cg, "for i in $(seq 20); do sleep 5 & done; wait")?;
    let mut peak = 0;
    wait_until(Duration::from_millis(500), || {
        peak = peak.max(cg.pids().map(|p| p.len()).unwrap_or(0));
        false
    });
    assert!((4..=5).contains(&peak), "peak {peak} processes");
    assert!(cg.stats()?.pids_current <= 5);
    let pids_dir = cg
        .procs_paths()
        .into_iter()
        .filter_map(|p| p.parent().map(Path::to_path_buf))
        .find(|d| d.join("pids.events").exists())
        .ok_or("no pids.events")?;
    let events = read(&pids_dir.join("pids.events"));
    let max_events: u64 = dsec_sys::cgroup::flat_keyed(&events, "max").ok_or("no max line")?;
    assert!(max_events >= 1, "{events}");
    cg.kill_all()?;
    assert!(cg.pids()?.is_empty());
    cg.remove()?;
    Ok(())
}

#[test]
fn memory_max_is_enforced_by_oom_kill() -> TestResult {
    let mgr = host("memory_max_is_enforced_by_oom_kill");
    let name = "oom";
    let _guard = CgGuard::new(&mgr, name);
    let limit = 32 * MIB;
    let cg = mgr.create(
        name,
        &CgroupLimits {
            memory_max: Some(limit),
            ..CgroupLimits::default()
        },
    )?;
    // `tail -n 1` keeps the current line in memory; /dev/zero has no newline.
    let mut hog = spawn_in(&cg, "head -c 268435456 /dev/zero | tail -n 1 > /dev/null")?;
    let status = hog.0.wait()?;
    assert!(!status.success(), "memory hog survived: {status}");
    let stats = cg.stats()?;
    assert!(stats.oom_kills >= 1, "{stats:?}");
    // The one-file read that follows every command agrees with the full stats.
    assert_eq!(mgr.oom_kills(name)?, stats.oom_kills);
    if let Some(peak) = stats.memory_peak {
        assert!(peak <= limit, "{stats:?}");
    }
    cg.kill_all()?;
    cg.remove()?;
    Ok(())
}

#[test]
fn kill_all_kills_a_process_tree() -> TestResult {
    let (_mgr, cg) = host_cgroup("kill_all_kills_a_process_tree", "killtree")?;
    let mut sh = spawn_in(
        &cg,
        "for i in 1 2 3; do (sleep 60 & sleep 60) & done; exec sleep 60",
    )?;
    assert!(
        wait_until(Duration::from_secs(3), || cg
            .pids()
            .map(|p| p.len() >= 7)
            .unwrap_or(false)),
        "tree did not start: {:?}",
        cg.pids()
    );
    cg.kill_all()?;
    assert!(cg.pids()?.is_empty());
    sh.0.wait()?;
    // pids.current drops once the zombies are reaped (the orphans by init).
    assert!(wait_until(Duration::from_secs(3), || cg
        .stats()
        .map(|s| s.pids_current == 0)
        .unwrap_or(false)));
    remove_all_gone(cg)?;
    Ok(())
}

#[test]
fn stats_report_cpu_and_memory() -> TestResult {
    let (_mgr, cg) = host_cgroup("stats_report_cpu_and_memory", "stats")?;
    let mut busy = spawn_in(&cg, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")?;
    busy.0.wait()?;
    let stats = cg.stats()?;
    assert!(stats.memory_peak.unwrap_or(1) > 0, "{stats:?}");
    assert_eq!(stats.oom_kills, 0);
    if let Some(ns) = stats.cpu_usage_ns {
        assert!(ns > 1_000_000, "{stats:?}");
    }
    cg.reset_peak()?;
    cg.remove()?;
    Ok(())
}

#[test]
fn names_are_validated() {
    let mgr = host("names_are_validated");
    for bad in ["../x", "a/b", "", "..", "x y"] {
        match mgr.create(bad, &CgroupLimits::default()) {
            Err(CgroupError::InvalidName { name }) => assert_eq!(name, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
        assert!(mgr.open(bad).is_none());
    }
    assert!(CgroupManager::with_layout(mgr.layout().clone(), "../etc").is_err());
}

#[test]
fn invalid_limits_create_nothing() {
    let mgr = host("invalid_limits_create_nothing");
    let name = "badlimits";
    let _guard = CgGuard::new(&mgr, name);
    let res = mgr.create(
        name,
        &CgroupLimits {
            cpu_weight: Some(0),
            ..CgroupLimits::default()
        },
    );
    assert!(
        matches!(res, Err(CgroupError::InvalidLimit { .. })),
        "{res:?}"
    );
    assert!(mgr.open(name).is_none());
}

#[test]
fn list_open_and_idempotent_remove() -> TestResult {
    let mgr = host("list_open_and_idempotent_remove");
    let (a, b) = ("list-a", "list-b");
    let _ga = CgGuard::new(&mgr, a);
    let _gb = CgGuard::new(&mgr, b);
    let cg_a = mgr.create(a, &CgroupLimits::default())?;
    let cg_b = mgr.create(b, &CgroupLimits::default())?;
    let listed = mgr.list()?;
    assert!(listed.iter().any(|n| n == a) && listed.iter().any(|n| n == b));

    let exists = mgr.create(a, &CgroupLimits::default());
    assert!(
        matches!(&exists, Err(CgroupError::Create { source, .. })
            if source.kind() == std::io::ErrorKind::AlreadyExists),
        "{exists:?}"
    );

    let reopened = mgr.open(a).ok_or("open after create")?;
    assert_eq!(reopened.dirs(), cg_a.dirs());
    cg_a.remove()?;
    reopened.remove()?; // already gone: fine
    assert!(mgr.open(a).is_none());
    assert!(!mgr.list()?.iter().any(|n| n == a));
    cg_b.remove()?;
    Ok(())
}

#[test]
fn favor_dynmods_v1_named_hierarchy() -> TestResult {
    // Mounts a hierarchy; makes no cgroup under the base.
    let mgr = CgroupManager::detect(BASE)?;
    if mgr.version() != CgroupVersion::V1 {
        // Not a pass that checked nothing: on a v2 host `favor_dynmods_v2_remount` is the test.
        return Err("this host's cgroups are v2: the v1 hierarchy cannot be tested here".into());
    }
    let dir = tempfile::tempdir()?;
    let mount_point = dir.path().join("fdm");
    let mgr = mgr.with_favordynmods_dir(&mount_point);
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount_point.clone());
    assert!(mgr.favor_dynmods()?, "first call mounts");
    let mounts = mountinfo();
    let m = mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == mount_point)
        .ok_or("not mounted")?;
    assert!(m.has_super_option("favordynmods") && m.has_super_option("name=dsec"));
    assert!(!mgr.favor_dynmods()?, "second call is a no-op");
    Ok(())
}

fn mountinfo() -> Vec<MountInfo> {
    parse_mountinfo(&read(Path::new("/proc/self/mountinfo")))
}

// ---------------------------------------------------------------------------------------------
// v2 on the host's (possibly controller-less) cgroup2 mount.
// ---------------------------------------------------------------------------------------------

/// The host's cgroup2 mount point. Mounting a second cgroup2 instance is avoided on purpose: a
/// fresh cgroup2 mount re-applies its (empty) options to the single v2 root, clearing flags
/// such as `nsdelegate` for the whole host.
fn cgroup2_mount() -> MountInfo {
    mountinfo()
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .expect("a cgroup2 mount (the dev VM has /sys/fs/cgroup/unified)")
}

fn v2_host(test: &str) -> TestCgroups {
    let root = cgroup2_mount().mount_point;
    let base = test_base("dsec-test-v2", test);
    let mgr =
        CgroupManager::with_layout(CgroupLayout::V2 { root }, &base).expect("valid base name");
    TestCgroups { mgr, base }
}

#[test]
fn v2_real_create_attach_kill_remove() -> TestResult {
    let name = "v2-real";
    let (mgr, cg) = with_cgroup(
        v2_host("v2_real_create_attach_kill_remove"),
        name,
        CgroupLimits::default(),
    )?;
    assert_eq!(cg.version(), CgroupVersion::V2);
    assert_eq!(cg.procs_paths().len(), 1);
    assert!(cg.dirs()[0].join("cgroup.kill").exists());

    let mut child = spawn("sleep", &["30"])?;
    cg.attach(child.pid())?;
    assert_eq!(cg.pids()?, vec![child.pid()]);
    assert!(mgr.list()?.iter().any(|n| n == name));

    kill_all_sigkills(&cg, &mut child)?; // cgroup.kill
    remove_all_gone(cg)?;
    Ok(())
}

/// v2: `limit_devices` loads and attaches a `BPF_CGROUP_DEVICE` program, which the kernel runs
/// for the processes of the host's cgroup2 hierarchy (there even when it has no controllers:
/// the program is the cgroup's, not a controller's); the program goes with the cgroup.
#[test]
fn v2_device_program_is_enforced() -> TestResult {
    let (_mgr, cg) = with_cgroup(
        v2_host("v2_device_program_is_enforced"),
        "devices",
        CgroupLimits::default(),
    )?;
    assert!(cg.devices_dir().is_none());
    assert!(cg.limit_devices(&TEST_DEVICES)?);
    assert_eq!(
        open_devices_in(&cg)?,
        "null-opened\nzero-opened\nkmsg-refused\n"
    );
    remove_all_gone(cg)?;
    Ok(())
}

#[test]
fn favor_dynmods_v2_remount() -> TestResult {
    let original = cgroup2_mount();
    if original.has_super_option("favordynmods") {
        return Err("cgroup2 mount already has favordynmods; cannot test the remount".into());
    }
    let mgr = v2_host("favor_dynmods_v2_remount");
    struct Restore(MountInfo);
    impl Drop for Restore {
        fn drop(&mut self) {
            // Remount with the original superblock options (cgroup2 reconfigure clears flags not
            // passed, which undoes favordynmods on the root flag).
            let opts: Vec<&str> = self
                .0
                .super_options
                .iter()
                .map(String::as_str)
                .filter(|o| *o != "rw" && *o != "ro")
                .collect();
            let mut o = String::from("remount");
            for x in opts {
                o.push(',');
                o.push_str(x);
            }
            let _ = Command::new("mount")
                .args(["-t", "cgroup2", "-o", &o, "cgroup2"])
                .arg(&self.0.mount_point)
                .status();
        }
    }
    let restore = Restore(original.clone());
    assert!(mgr.favor_dynmods()?);
    let now = cgroup2_mount();
    assert!(now.has_super_option("favordynmods"), "{now:?}");
    assert_eq!(
        now.mount_options, original.mount_options,
        "per-mount flags kept"
    );
    assert!(!mgr.favor_dynmods()?);
    drop(restore);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Fake roots: the file-writing logic without a kernel behind it.
// ---------------------------------------------------------------------------------------------

/// Limits with every field set.
fn every_limit(
    cpu_weight: u64,
    cpu_max: (u64, u64),
    memory_high: u64,
    memory_max: u64,
    pids_max: u64,
) -> CgroupLimits {
    CgroupLimits {
        cpu_weight: Some(cpu_weight),
        cpu_max: Some(cpu_max),
        memory_high: Some(memory_high),
        memory_max: Some(memory_max),
        pids_max: Some(pids_max),
    }
}

/// Asserts the contents of each `(path under dir, contents)`.
fn assert_files(dir: &Path, expected: &[(&str, String)]) -> TestResult {
    for (file, want) in expected {
        assert_eq!(&fs::read_to_string(dir.join(file))?, want, "{file}");
    }
    Ok(())
}

fn touch(dir: &Path, files: &[(&str, &str)]) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    for (name, content) in files {
        fs::write(dir.join(name), content)?;
    }
    Ok(())
}

#[test]
fn v2_fake_root_create_delegates_and_writes_limits() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    touch(
        root,
        &[
            ("cgroup.controllers", "cpuset cpu io memory pids\n"),
            ("cgroup.subtree_control", ""),
        ],
    )?;
    touch(&root.join("dsec"), &[("cgroup.subtree_control", "cpu")])?;
    let mgr = CgroupManager::with_layout(CgroupLayout::V2 { root: root.into() }, "dsec")?;
    assert_eq!(mgr.version(), CgroupVersion::V2);

    let cg = mgr.create("sbx", &CgroupLimits::default())?;
    assert_eq!(
        fs::read_to_string(root.join("cgroup.subtree_control"))?,
        "+cpu +memory +pids"
    );
    assert_eq!(
        fs::read_to_string(root.join("dsec/cgroup.subtree_control"))?,
        "+memory +pids"
    );
    let dir = root.join("dsec/sbx");
    assert_eq!(cg.procs_paths(), vec![dir.join("cgroup.procs")]);

    // A cgroup whose limit files are missing fails and is rolled back.
    let err = mgr.create(
        "broken",
        &CgroupLimits {
            pids_max: Some(3),
            ..CgroupLimits::default()
        },
    );
    assert!(matches!(err, Err(CgroupError::Write { .. })), "{err:?}");
    assert!(!root.join("dsec/broken").exists());

    let files = [
        "cpu.weight",
        "cpu.max",
        "memory.high",
        "memory.max",
        "memory.swap.max",
        "pids.max",
        "cgroup.procs",
        "cgroup.kill",
    ];
    touch(&dir, &files.map(|f| (f, "")))?;
    let swap = cg.set_limits(&every_limit(
        300,
        (20_000, 100_000),
        100 * MIB,
        128 * MIB,
        64,
    ))?;
    assert_eq!(swap, SwapLimit::Disabled);
    assert_files(
        &dir,
        &[
            ("cpu.weight", "300".to_owned()),
            ("cpu.max", "20000 100000".to_owned()),
            ("memory.high", (100 * MIB).to_string()),
            ("memory.max", (128 * MIB).to_string()),
            ("memory.swap.max", "0".to_owned()),
            ("pids.max", "64".to_owned()),
        ],
    )?;

    // No swap accounting: memory.swap.max absent is recorded, not an error.
    fs::remove_file(dir.join("memory.swap.max"))?;
    let swap = cg.set_limits(&CgroupLimits {
        memory_max: Some(64 * MIB),
        ..CgroupLimits::default()
    })?;
    assert_eq!(swap, SwapLimit::NotAccounted);

    cg.attach(4242)?;
    assert_eq!(fs::read_to_string(dir.join("cgroup.procs"))?, "4242");
    fs::write(dir.join("cgroup.procs"), "")?;
    cg.kill_all()?;
    assert_eq!(fs::read_to_string(dir.join("cgroup.kill"))?, "1");
    Ok(())
}

#[test]
fn v2_fake_root_stats_from_fixtures() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let dir = root.join("dsec/sbx");
    touch(
        &dir,
        &[
            ("memory.current", "1048576\n"),
            ("memory.peak", "4194304\n"),
            (
                "memory.events",
                "low 0\nhigh 3\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n",
            ),
            (
                "cpu.stat",
                "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n\
                 nr_throttled 0\nthrottled_usec 0\n",
            ),
            ("pids.current", "3\n"),
            ("cgroup.procs", "10\n11\n12\n"),
        ],
    )?;
    let mgr = CgroupManager::with_layout(CgroupLayout::V2 { root: root.into() }, "dsec")?;
    let cg = mgr.open("sbx").ok_or("open")?;
    let stats = cg.stats()?;
    assert_eq!(stats.memory_current, 1 << 20);
    assert_eq!(stats.memory_peak, Some(4 << 20));
    assert_eq!(stats.oom_kills, 2);
    assert_eq!(mgr.oom_kills("sbx")?, 2);
    assert!(mgr.oom_kills("other").is_err());
    assert!(mgr.oom_kills("../sbx").is_err());
    assert_eq!(stats.cpu_usage_ns, Some(1_500_000));
    assert_eq!(stats.pids_current, 3);
    assert_eq!(cg.pids()?, vec![10, 11, 12]);
    assert_eq!(mgr.list()?, vec!["sbx".to_owned()]);
    assert!(mgr.open("other").is_none());

    // memory.peak is optional (kernel < 5.19).
    fs::remove_file(dir.join("memory.peak"))?;
    assert_eq!(cg.stats()?.memory_peak, None);
    // A malformed memory.events is a parse error naming the file.
    fs::write(dir.join("memory.events"), "low 0\n")?;
    assert!(matches!(cg.stats(), Err(CgroupError::Parse { .. })));
    Ok(())
}

#[test]
fn v1_fake_root_maps_limits_and_tolerates_missing_memsw() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let r = tmp.path();
    let layout = CgroupLayout::V1 {
        cpu: r.join("cpu,cpuacct"),
        cpuacct: Some(r.join("cpu,cpuacct")),
        memory: r.join("memory"),
        pids: r.join("pids"),
        devices: None,
    };
    for h in ["cpu,cpuacct", "memory", "pids"] {
        touch(&r.join(h), &[])?;
    }
    let mgr = CgroupManager::with_layout(layout, "dsec")?;
    let cg = mgr.create("sbx", &CgroupLimits::default())?;
    assert_eq!(
        cg.procs_paths().len(),
        3,
        "co-mounted cpu,cpuacct counted once"
    );
    touch(
        &r.join("cpu,cpuacct/dsec/sbx"),
        &[
            ("cpu.shares", ""),
            ("cpu.cfs_quota_us", ""),
            ("cpu.cfs_period_us", ""),
        ],
    )?;
    touch(
        &r.join("memory/dsec/sbx"),
        &[
            ("memory.limit_in_bytes", ""),
            ("memory.soft_limit_in_bytes", ""),
        ],
    )?;
    touch(&r.join("pids/dsec/sbx"), &[("pids.max", "")])?;
    let swap = cg.set_limits(&every_limit(50, (25_000, 50_000), 8 * MIB, 16 * MIB, 7))?;
    assert_eq!(swap, SwapLimit::NotAccounted);
    assert_files(
        r,
        &[
            ("cpu,cpuacct/dsec/sbx/cpu.shares", "512".to_owned()),
            ("cpu,cpuacct/dsec/sbx/cpu.cfs_quota_us", "25000".to_owned()),
            ("cpu,cpuacct/dsec/sbx/cpu.cfs_period_us", "50000".to_owned()),
            (
                "memory/dsec/sbx/memory.limit_in_bytes",
                (16 * MIB).to_string(),
            ),
            (
                "memory/dsec/sbx/memory.soft_limit_in_bytes",
                (8 * MIB).to_string(),
            ),
            ("pids/dsec/sbx/pids.max", "7".to_owned()),
        ],
    )?;
    Ok(())
}
