#!/usr/bin/env bash
# Builds the `code-runner` template: a Debian root with the toolchain of every code-runner
# language Debian packages (see docs/api.md, "Code runner"), made with debootstrap and apt-get
# into a directory, packed as a root filesystem tarball and imported into dsec.
#
#   scripts/build-code-runner-template.sh [--name NAME] [--suite SUITE] [--mirror URL]
#                                         [--out TARBALL] [--no-import] [--minimal]
#
# Default: import into the node's data dir (`dsec template import NAME TARBALL --rootfs`;
# DSEC_DATA_DIR, default /var/lib/dsec): a running daemon sees the template at once. (Not
# `dsec template push`: an upload is limited to 256 MiB.) --no-import only writes the tarball.
# --minimal installs the small toolchains only (no Rust, C#, R, D, Scala, Kotlin, Racket, Jest):
# a 1.4 GB tarball. Needs root, a Debian mirror, ~5 GB free in $TMPDIR. The languages Debian 12
# does not package (julia, swift, lean, cuda) are absent: a run of one answers as a missing
# command does (see docs/api.md).
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=code-runner
SUITE=bookworm
MIRROR=
OUT=
MODE=import
MINIMAL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --name) NAME=$2; shift 2 ;;
    --suite) SUITE=$2; shift 2 ;;
    --mirror) MIRROR=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --no-import) MODE=none; shift ;;
    --minimal) MINIMAL=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build-code-runner-template.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$MODE" = none ] && [ -z "$OUT" ]; then
  echo "build-code-runner-template.sh: --no-import needs --out (the work dir is removed)" >&2
  exit 2
fi
if [ "$(id -u)" != 0 ]; then
  echo "build-code-runner-template.sh: run as root (debootstrap, chroot)" >&2
  exit 1
fi

# The toolchain of each language, by Debian package. python, pytest, cpp, c, bash, nodejs,
# typescript, go, go_test, java, junit, php, lua, perl, ruby, sql, verilog, python_gpu:
PACKAGES=(python3 python3-pytest gcc g++ libc6-dev bash nodejs node-typescript golang-go
  default-jdk-headless junit5 php-cli lua5.4 perl ruby sqlite3 iverilog)
if [ "$MINIMAL" = 0 ]; then
  # rust, csharp, R, D_ut, scala, kotlin_script, racket, jest:
  PACKAGES+=(rustc mono-mcs mono-runtime r-base-core gdc scala kotlin racket jest)
fi

DSEC=${DSEC_BIN:-}
if [ -z "$DSEC" ]; then
  DSEC=$(command -v dsec || echo target/x86_64-unknown-linux-gnu/debug/dsec)
fi
if [ "$MODE" != none ] && [ ! -x "$DSEC" ]; then
  echo "build-code-runner-template.sh: no dsec binary (set DSEC_BIN or build it)" >&2
  exit 1
fi
command -v debootstrap >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dsec-code-runner.XXXXXX")
ROOT=$WORK/root
cleanup() {
  umount -R "$ROOT/proc" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
OUT=${OUT:-$WORK/$NAME.tar}

echo "== debootstrap $SUITE into $ROOT" >&2
debootstrap --variant=minbase "$SUITE" "$ROOT" ${MIRROR:+"$MIRROR"} >&2

echo "== apt-get install ${PACKAGES[*]}" >&2
# No service starts in the root; /proc for the maintainer scripts that need it (Java's).
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"
mount -t proc proc "$ROOT/proc"
chroot "$ROOT" apt-get update -qq
chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2
chroot "$ROOT" apt-get clean
umount "$ROOT/proc"
rm -rf "$ROOT/var/lib/apt/lists/"* "$ROOT/usr/sbin/policy-rc.d" "$ROOT/var/cache/debconf/"*-old

echo "== pack $OUT" >&2
# Device nodes are the sandbox's own (dsec refuses them in a template).
tar -C "$ROOT" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
  -cf "$OUT" .
ls -l "$OUT" >&2

if [ "$MODE" = import ]; then
  "$DSEC" template import "$NAME" "$OUT" --rootfs
fi
echo "== template $NAME: list its languages with GET /v1/languages?template=$NAME" >&2
