#!/usr/bin/env bash
# Python SDK checks and system tests: a venv under target/pyvenv with the SDK, its pinned linters,
# pytest and pyarrow; then ruff (lint and format) and mypy --strict over the SDK, which must pass;
# then pytest against a real `dsec server` it starts itself. Assumes `cargo build --workspace`
# already ran. Must run as root (the server makes namespaces and cgroups). Exit code: the first
# failing linter's, else pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's interpreter, not a pyenv shim on PATH.
PY=/usr/bin/python3
VENV=target/pyvenv
if [ ! -x "$VENV/bin/python" ]; then
  if [ ! -x "$PY" ] || ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip
  fi
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
# The code runner's languages that test_run.py runs (in the host template, the host's root).
bash scripts/install-run-toolchains.sh
# pyarrow: the independent Parquet reader the Rust tests cross-check exports with; moto[server]:
# the S3 server the cluster tests keep an origin store in (boto3 with it reads it back).
"$VENV/bin/pip" install -q --disable-pip-version-check "./sdk/python[lint]" pytest pytest-asyncio sandbox-fusion pyarrow pyyaml "moto[server]"
# test_e2b.py: the official E2B SDKs, unmodified, against the node's E2B-compatible API. The
# current releases share the main venv (no dependency of theirs conflicts with the above); e2b 2.20,
# the older release that routes by the access token alone after `Sandbox.connect(id)`, needs a
# venv of its own (a venv holds one version of a package); the tests run it as a subprocess.
"$VENV/bin/pip" install -q --disable-pip-version-check e2b==2.63.0 e2b-code-interpreter==2.11.5
E2B20_VENV=target/e2b20-venv
if [ ! -x "$E2B20_VENV/bin/python" ]; then
  rm -rf "$E2B20_VENV"
  "$PY" -m venv "$E2B20_VENV"
fi
"$E2B20_VENV/bin/pip" install -q --disable-pip-version-check e2b==2.20.0
# --setup-only: the venv alone (scripts/test.sh makes it before the Rust tests, which use it).
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi

# Lint and types (configured in sdk/python/pyproject.toml): set -e stops the run on a failure.
(
  cd sdk/python
  ../../"$VENV"/bin/ruff check src tests
  ../../"$VENV"/bin/ruff format --check src
  ../../"$VENV"/bin/mypy
)

export DSEC_BIN="${DSEC_BIN:-$PWD/target/x86_64-unknown-linux-gnu/debug/dsec}"
if [ ! -x "$DSEC_BIN" ]; then
  echo "scripts/test-python.sh: no dsec binary at $DSEC_BIN (run cargo build --workspace)" >&2
  exit 1
fi
# pytest's temporary dirs (the test daemons' data dirs) live under one dir of this run, removed
# when the script ends, instead of piling up in /tmp/pytest-of-<user>.
basetemp=$(mktemp -d /tmp/dsec-pytest.XXXXXX)
trap 'rm -rf --one-file-system "$basetemp"' EXIT
set +e
"$VENV/bin/python" -m pytest -q --basetemp "$basetemp/t" sdk/python/tests "$@"
rc=$?
exit $rc
