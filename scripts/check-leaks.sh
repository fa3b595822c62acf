#!/usr/bin/env bash
# What the tests may leave on the machine, before and after: `check-leaks.sh snapshot DIR` writes
# a snapshot, `check-leaks.sh compare DIR` fails (exit 1, listing them) when something is there
# now that was not then. Compared with a snapshot, not with emptiness, so that whatever else
# runs on the machine (a daemon in use, another checkout's tests) is not blamed on the tests;
# transient things get up to DSEC_LEAK_WAIT seconds (default 15) to go.
#
# Looked at: dsec processes (by name, by binary under this checkout's target/, or by being in a
# dsec cgroup) and QEMUs; zombies; mount points; cgroups named dsec* and the cgroups below them
# (the product's own base `dsec` may stay, empty); network namespaces; sandboxes' and the fake
# internet's veths; nftables rules (when nft
# exists); and the tests' files in /tmp and /run. Not looked at: the VM image cache
# (/var/cache/dsec), which is meant to persist.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

procs() {
  local d pid comm exe cg
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] && continue
    comm=$(cat "$d/comm" 2>/dev/null) || continue
    exe=$(readlink "$d/exe" 2>/dev/null || true)
    cg=$(cat "$d/cgroup" 2>/dev/null || true)
    # Another checkout's binaries are that checkout's business.
    [[ "$exe" == */target/*/dsec* && "$exe" != "$repo/target/"* ]] && continue
    case "$comm" in
      dsec*|qemu-system*) ;;
      *)
        if [[ "$exe" != "$repo/target/"* && "$exe" != *dsec-agent* ]] \
          && ! grep -q ':/dsec[^/]*/' <<<"$cg"; then
          continue
        fi
        ;;
    esac
    echo "process $pid $comm ${exe:-?}"
  done
}

zombies() {
  # Zombies of dsec processes (or dsec and QEMU zombies): one whose parent exits is reaped by
  # init, so what is left after the tests is one that a process of theirs does not reap.
  local d stat comm rest ours
  ours=" $(procs | awk '{print $2}' | tr '\n' ' ') "
  for d in /proc/[0-9]*; do
    stat=$(cat "$d/stat" 2>/dev/null) || continue
    # pid (comm) state ppid ...; comm may hold spaces and parentheses.
    comm=${stat#*(}
    comm=${comm%)*}
    rest=${stat##*) }
    read -r state ppid _ <<<"$rest"
    [ "$state" = Z ] || continue
    [[ "$ours" == *" $ppid "* || "$comm" == dsec* || "$comm" == qemu-system* ]] || continue
    echo "zombie ${d#/proc/} ($comm) parent $ppid"
  done
  return 0
}

mounts() {
  # Mount points and types; the favordynmods hierarchy a node mounts stays by design.
  awk '{ split($0, a, " - "); split(a[2], t, " "); print "mount " $5 " " t[1] }' /proc/self/mountinfo \
    | grep -v ' /run/dsec/cgroup-favordynmods ' || true
}

cgroups() {
  local root base child
  awk '{ split($0, a, " - "); split(a[2], t, " "); if (t[1] == "cgroup" || t[1] == "cgroup2") print $5 }' \
    /proc/self/mountinfo | sort -u | while read -r root; do
    for base in "$root"/dsec*/; do
      [ -d "$base" ] || continue
      [ "${base%/}" = "$root/dsec" ] || echo "cgroup ${base%/}"
      for child in "$base"*/; do
        [ -d "$child" ] && echo "cgroup ${child%/}"
      done
    done
  done
}

netns() {
  # Named ones; one kept by a bind mount shows as an nsfs mount, one kept by a process as
  # that process.
  ls /run/netns 2>/dev/null | sed 's/^/netns /' || true
}

links() {
  # Sandboxes' veths (dsv<k>-<n>) and the fake internet's (dsf-<n>) on the host.
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
    | grep -E '^(dsv|dsf)' | sed 's/^/link /' || true
}

nftables() {
  if command -v nft >/dev/null; then
    nft list ruleset 2>/dev/null | sed 's/^[[:space:]]*//; s/^/nft /' || true
  fi
}

files() {
  local f name
  for f in /tmp/* /tmp/.tmp* /run/*; do
    [ -e "$f" ] || continue
    name=${f##*/}
    case "$f" in
      /tmp/*)
        # The prefixes the tests use: common::dirs (dst-, dtr-, dcl-, dclk-, dsr-, dlm-, …),
        # the SDK fixtures (dp…), pytest, tempfile (.tmp…), and anything dsec.
        [[ "$name" =~ ^(d[a-z]{1,4}-.*|dp[A-Za-z0-9_]{8}|dsec.*|pytest-of-.*|\.tmp[A-Za-z0-9]{6})$ ]] || continue
        ;;
      /run/dsec) continue ;;
      /run/*) [[ "$name" =~ ^dsec ]] || continue ;;
    esac
    echo "file $f"
  done
  # The node's default run dir holds the favordynmods hierarchy every node mounts, which stays
  # by design (see mounts); anything else in it is a leak.
  for f in /run/dsec/*; do
    [ -e "$f" ] && [ "$f" != /run/dsec/cgroup-favordynmods ] && echo "file $f"
  done
  return 0
}

snapshot() {
  { procs; zombies; mounts; cgroups; netns; links; nftables; files; } | sort -u
}

usage() {
  echo "usage: $0 snapshot DIR | compare DIR" >&2
  exit 2
}

[ $# = 2 ] || usage
dir=$2
case "$1" in
  snapshot)
    mkdir -p "$dir"
    snapshot >"$dir/before"
    ;;
  compare)
    [ -f "$dir/before" ] || { echo "$0: no snapshot in $dir" >&2; exit 2; }
    deadline=$((SECONDS + ${DSEC_LEAK_WAIT:-15}))
    while :; do
      snapshot >"$dir/after"
      comm -13 "$dir/before" "$dir/after" >"$dir/new"
      if [ ! -s "$dir/new" ]; then
        echo "check-leaks: nothing left behind"
        exit 0
      fi
      [ $SECONDS -lt $deadline ] || break
      sleep 1
    done
    echo "check-leaks: the tests left these on the machine:" >&2
    sed 's/^/  /' "$dir/new" >&2
    exit 1
    ;;
  *) usage ;;
esac
