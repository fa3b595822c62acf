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
# The code runner's C++ tests compile with g++; the initramfs writer is checked against GNU cpio.
command -v g++ >/dev/null || need+=(g++)
command -v cpio >/dev/null || need+=(cpio)
# The cluster tests start a real etcd member.
command -v etcd >/dev/null || need+=(etcd-server)
command -v tar >/dev/null || need+=(tar)
[ -x /usr/bin/python3 ] || need+=(python3)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
# VM substrates: QEMU (TCG where /dev/kvm cannot run a guest), mksquashfs/unsquashfs for the
# templates' read-only root images, mke2fs for each VM's writable disk, unshare/mount for
# building images in a private mount namespace, lz4 to cross-check the kernel decompressor.
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v mksquashfs >/dev/null || need+=(squashfs-tools)
command -v mke2fs >/dev/null || need+=(e2fsprogs)
command -v unshare >/dev/null || need+=(util-linux)
# setpriv runs a test's client as another uid (sup.sock's peer check, one QEMU per uid), and the
# QEMU test then needs the kill program itself (procps), not the shell's builtin.
command -v setpriv >/dev/null || need+=(util-linux)
[ -x /bin/kill ] || [ -x /usr/bin/kill ] || need+=(procps)
# ipcmk (util-linux) makes the IPC objects an in-place reset must remove.
command -v ipcmk >/dev/null || need+=(util-linux)
# nsenter (util-linux) plants a device node in a running sandbox (S-13).
command -v nsenter >/dev/null || need+=(util-linux)
command -v mount >/dev/null || need+=(mount)
command -v lz4 >/dev/null || need+=(lz4)
# The guest kernel's modules are xz- (or zstd-) compressed; neither tool is in a minimal Debian.
command -v xz >/dev/null || need+=(xz-utils)
command -v zstd >/dev/null || need+=(zstd)
# Network egress: nft loads the node's table, ip and tc (iproute2) build the tests' fake
# internet and pace capped sandboxes; its servers need openssl (a CA), curl and Debian's pip
# (the package-index test) run inside sandboxes of the host template.
command -v nft >/dev/null || need+=(nftables)
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# The code runner's languages that the tests run (in the host template, the host's root).
bash scripts/install-run-toolchains.sh

cargo fmt --all -- --check
# The house's shape: no source file over 1,200 lines, no function over 150, no import circle
# between a crate's files, and docs/design.md's code map naming every module that exists.
python3 scripts/check-shape.py
cargo clippy --workspace --all-targets -- -D warnings
# Integration tests start the agent and shim binaries of the same target dir.
cargo build --workspace
# The guest kernel (Debian's linux-image-cloud-amd64, unpacked, never installed), the
# initramfs, the host template's root image and its snapshots: built once per host and cached
# in /var/cache/dsec/vm, so that the VM tests restore instead of boot.
# Its state dirs live under /tmp like the test daemons', whose host mask (and so root image)
# is then the same.
prep=$(mktemp -d /tmp/dsec-vm-prepare.XXXXXX)
# Searchable by the sandboxes' ids, as a node's run dir must be (mktemp makes it 0700): the
# runtime's idle shells build their roots below it.
chmod 0755 "$prep"
./target/x86_64-unknown-linux-gnu/debug/dsec --data-dir "$prep/data" --run-dir "$prep/run" vm prepare
rm -rf "$prep"
# Tests leave the machine as they found it: what is there before them is compared with what is
# there after (processes, zombies, mounts, cgroups, netns, nftables, files in /tmp and /run).
leakdir=target/leak-check
rm -rf "$leakdir"
bash scripts/check-leaks.sh snapshot "$leakdir"
# The Python tests' venv, made first: the Rust tests read Parquet exports back with its pyarrow.
bash scripts/test-python.sh --setup-only
export DSEC_TEST_PYTHON="$PWD/target/pyvenv/bin/python"
# deploy/: the Kubernetes manifests and systemd units parse.
"$DSEC_TEST_PYTHON" scripts/check-deploy.py
rust=0
cargo test --workspace --no-fail-fast || rust=$?
# The Python SDK: ruff and mypy --strict over it, then its system tests against the real daemon.
py=0
bash scripts/test-python.sh || py=$?
leaks=0
bash scripts/check-leaks.sh compare "$leakdir" || leaks=$?
if [ "$rust" != 0 ] || [ "$py" != 0 ] || [ "$leaks" != 0 ]; then
  echo "scripts/test.sh: cargo test exit $rust, python tests exit $py, leak check exit $leaks" >&2
  exit 1
fi
