mod common;
use common::*;
#[test]
fn scratch() {
    let mut sb = create(small_limits());
    std::fs::write("/tmp/zz_init", sb.init_pid().to_string()).unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let r = sb.sh("sleep 0.1 & wait $!; echo rc=$?", 3000);
    eprintln!("-> {:?} {:?} {:?}", r.status, stdout(&r), stderr(&r));
}
