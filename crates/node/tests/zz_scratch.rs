mod common;
use common::*;
#[test]
fn scratch() {
    let mut sb = create(small_limits());
    for s in [
        "(sleep 0.2; echo a) & wait; echo done",
        "(sleep 0.2; kill -STOP 1; echo b) & wait; echo done",
        "(sleep 0.2; kill -KILL 1; echo c) & wait; echo done",
        "kill -STOP 1; echo d",
        "(kill -STOP 1; echo e) & wait; echo done",
        "echo x", "grep -E Sig /proc/self/status", "bash -c '(sleep 0.2; echo a) & wait; echo done'", "sleep 0.1 & wait $!; echo rc=$?", "sleep 0.1 & sleep 0.5; jobs -l; echo; cat /proc/$!/stat",
    ] {
        let r = sb.sh(s, 3000);
        eprintln!("{s:?} -> {:?} {:?} {:?}", r.status, stdout(&r), stderr(&r));
    }
}
