//! Measures durable appends per second, fsyncs per second and append latency of the trajectory
//! log at 1, 16 and 64 concurrent writers (threads) with records of a given payload size.
//!
//! `cargo run --release -p dsec-node --example trajlog_throughput -- [dir] [payload bytes] [secs]`
//!
//! `dir` must be on the file system to measure (not tmpfs); a temporary directory is made in it.
//! The `dsec bench log` command is the benchmark of record; this is a quick probe.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dsec_node::trajlog::{Config, Record, RecordKind, TrajLog};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| ".".into()));
    let size: usize = args.next().map_or(Ok(200), |s| s.parse())?;
    let secs: u64 = args.next().map_or(Ok(3), |s| s.parse())?;
    for writers in [1usize, 16, 64] {
        let (log, _tmp) = TrajLog::open_temp_in(&dir, Config::new(""))?;
        let stop = AtomicBool::new(false);
        let started = Instant::now();
        let mut lat: Vec<Duration> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..writers)
                .map(|w| {
                    let (log, stop) = (&log, &stop);
                    s.spawn(move || {
                        let mut lat = Vec::new();
                        let traj = format!("w{w}");
                        let mut step = 0;
                        while !stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            let rec =
                                Record::new(&traj, step, RecordKind::Result, vec![b'x'; size]);
                            if log.append_blocking(rec).is_err() {
                                break;
                            }
                            lat.push(t.elapsed());
                            step += 1;
                        }
                        lat
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_secs(secs));
            stop.store(true, Ordering::Relaxed);
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let elapsed = started.elapsed().as_secs_f64();
        let s = log.stats();
        lat.sort_unstable();
        let pct = |p: f64| {
            lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
                .map_or(0, |d| d.as_micros())
        };
        println!(
            "{{\"writers\":{writers},\"payload\":{size},\"appends_per_s\":{:.0},\"fsyncs_per_s\":{:.0},\"records_per_fsync\":{:.1},\"p50_us\":{},\"p99_us\":{},\"max_us\":{}}}",
            s.appends as f64 / elapsed,
            s.fsyncs as f64 / elapsed,
            s.appends as f64 / s.fsyncs.max(1) as f64,
            pct(0.50),
            pct(0.99),
            pct(1.0),
        );
    }
    Ok(())
}
