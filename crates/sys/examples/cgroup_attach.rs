//! Measures cgroup attach latency with and without `favordynmods`.
//!
//! For each sample: spawn `sleep 30`, create a fresh cgroup, stay idle for 30 ms (so the kernel's
//! `cgroup_threadgroup_rwsem` returns to its fast-reader mode), then time
//! [`Cgroup::attach`](dsec_sys::cgroup::Cgroup::attach) (one `cgroup.procs` write per hierarchy
//! on v1) and, separately, the first of those writes.
//!
//! Phases: (1) as found, (2) after [`CgroupManager::favor_dynmods`], (3) after unmounting the v1
//! named hierarchy again (pass `--undo`), to show whether the switch is reversible.
//!
//! Run as root: `cargo run -p dsec-sys --release --example cgroup_attach -- [--undo] [samples]`.

use std::error::Error;
use std::fs::OpenOptions;
use std::io::Write;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use dsec_sys::cgroup::{CgroupLimits, CgroupManager, CgroupVersion, FAVORDYNMODS_DIR};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn measure(mgr: &CgroupManager, label: &str, samples: usize) -> Result<(), Box<dyn Error>> {
    let mut full = Vec::with_capacity(samples);
    let mut first = Vec::with_capacity(samples);
    for i in 0..samples {
        // Alternate between timing the whole attach and timing only the first write.
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()?;
        let pid = i32::try_from(child.id())?;
        let name = format!("attach-bench-{i}");
        if let Some(old) = mgr.open(&name) {
            old.kill_all()?;
            old.remove()?;
        }
        let cg = mgr.create(&name, &CgroupLimits::default())?;
        thread::sleep(Duration::from_millis(30));
        let started = Instant::now();
        if i % 2 == 0 {
            cg.attach(pid)?;
            full.push(started.elapsed().as_secs_f64() * 1e3);
        } else {
            let path = cg.procs_paths()[0].clone();
            OpenOptions::new()
                .write(true)
                .open(&path)?
                .write_all(pid.to_string().as_bytes())?;
            first.push(started.elapsed().as_secs_f64() * 1e3);
            cg.attach(pid)?;
        }
        child.kill()?;
        child.wait()?;
        cg.kill_all()?;
        cg.remove()?;
    }
    for v in [&mut full, &mut first] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "{label:<40} attach (all {} hierarchies): median {:6.3} ms  p90 {:6.3} ms | first write: median {:6.3} ms  p90 {:6.3} ms  (n={})",
        mgr.base_dirs().len(),
        percentile(&full, 0.5),
        percentile(&full, 0.9),
        percentile(&first, 0.5),
        percentile(&first, 0.9),
        samples
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let undo = args.iter().any(|a| a == "--undo");
    let samples = args
        .iter()
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(40);
    let mgr = CgroupManager::detect("dsec-bench")?;
    println!("layout: {:?}", mgr.layout());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let already = mountinfo.lines().any(|l| l.contains("favordynmods"));
    println!("favordynmods already on some mount: {already}");

    measure(&mgr, "as found", samples)?;
    let enabled = mgr.favor_dynmods()?;
    println!("favor_dynmods() -> {enabled}");
    measure(&mgr, "with favordynmods", samples)?;

    if undo && mgr.version() == CgroupVersion::V1 {
        let status = Command::new("umount").arg(FAVORDYNMODS_DIR).status()?;
        println!("umount {FAVORDYNMODS_DIR}: {status}");
        measure(&mgr, "after unmounting favordynmods hierarchy", samples)?;
    }
    for base in mgr.base_dirs() {
        let _ = std::fs::remove_dir(base);
    }
    Ok(())
}
