//! `dsec-shim`: the spawner and per-sandbox supervisor processes of the container substrate.
#![forbid(unsafe_code)]

fn main() {
    let args: Vec<String> = std::env::args().collect();
    std::process::exit(dsec_shim::main(&args));
}
