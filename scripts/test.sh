#!/usr/bin/env bash
# The one command that runs every test of dsec. Installs what the tests need on a fresh Debian
# machine (it must run as root: the sandbox tests create namespaces, mounts and cgroups).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "scripts/test.sh: the sandbox tests need root (namespaces, mounts, cgroups)" >&2
  exit 1
fi
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v gcc >/dev/null || need+=(gcc)
command -v tar >/dev/null || need+=(tar)
[ -x /usr/bin/python3 ] || need+=(python3)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Integration tests start the agent and shim binaries of the same target dir.
cargo build --workspace
rust=0
cargo test --workspace --no-fail-fast || rust=$?
# The Python SDK's system tests drive the real daemon (venv with the SDK, pytest).
py=0
bash scripts/test-python.sh || py=$?
if [ "$rust" != 0 ] || [ "$py" != 0 ]; then
  echo "scripts/test.sh: cargo test exit $rust, python tests exit $py" >&2
  exit 1
fi
