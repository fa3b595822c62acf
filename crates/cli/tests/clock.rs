//! F-09: wall-clock jumps do not move TTL or lease expiry (the node keeps them on the
//! monotonic clock). This test steps the host's real-time clock forward and back, so it lives
//! in its own test binary (cargo runs test binaries one at a time) and restores the clock from
//! the monotonic time it measured. Needs root; CI runs as root.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dsec_testkit as testkit;
use serde_json::{json, Value};

fn set_wall_clock(t: SystemTime) {
    let d = t.duration_since(UNIX_EPOCH).expect("after the epoch");
    let st = Command::new("date")
        .arg("-s")
        .arg(format!("@{}.{:09}", d.as_secs(), d.subsec_nanos()))
        .stdout(Stdio::null())
        .status()
        .expect("date");
    assert!(st.success(), "set the wall clock (needs root)");
}

/// Puts the wall clock back where it would be without the jump, whatever happens.
struct Restore {
    wall: SystemTime,
    mono: Instant,
}

impl Drop for Restore {
    fn drop(&mut self) {
        set_wall_clock(self.wall + self.mono.elapsed());
    }
}

#[test]
fn f09_wall_clock_jumps_do_not_move_ttl_or_lease_expiry() {
    let (data, run) = testkit::dirs("dclk", "f09");
    let base = data.parent().expect("base dir").to_owned();
    let mut d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
        .args(&["--pool-max", "0"])
        .remove_on_drop(&base)
        .start()
        .expect("start dsec server");
    let call = |method: &str, path: &str, body: Option<Value>| -> Value {
        d.http().call(method, path, body.as_ref()).expect("http").1
    };
    let ttl = call("POST", "/v1/sandboxes", Some(json!({"ttl_ms": 4000})))["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let lease = call("POST", "/v1/sandboxes", Some(json!({"lease_ms": 4000})))["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let state = |id: &str| call("GET", &format!("/v1/sandboxes/{id}"), None)["state"].clone();
    let t0 = Instant::now();
    {
        let _restore = Restore {
            wall: SystemTime::now(),
            mono: Instant::now(),
        };
        // Forward by a day: by the wall clock both expired long ago.
        set_wall_clock(SystemTime::now() + Duration::from_secs(86_400));
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            state(&ttl),
            "running",
            "a forward jump does not expire a TTL"
        );
        assert_eq!(
            state(&lease),
            "running",
            "a forward jump does not expire a lease"
        );
        // Back by a day from the true time: by the wall clock neither is anywhere near.
        set_wall_clock(SystemTime::now() - Duration::from_secs(2 * 86_400));
        std::thread::sleep(Duration::from_millis(500));
    }
    // The clock is restored; on the monotonic clock both expire on time.
    let deadline = Instant::now() + Duration::from_secs(10);
    while (state(&ttl) != "stopped" || state(&lease) != "stopped") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = t0.elapsed();
    assert_eq!(state(&ttl), "stopped");
    assert_eq!(state(&lease), "stopped");
    assert!(
        took < Duration::from_secs(7),
        "expired about 4 s after creation, not by the jumped clock: {took:?}"
    );
    d.stop();
}
