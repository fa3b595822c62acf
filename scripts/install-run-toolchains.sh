#!/usr/bin/env bash
# Installs the code runner's toolchains that the tests run (sdk/python/tests/test_run.py):
# the host template is the host's root, so a Debian package installed here is a language of
# the runner. The cheap ones only: go, go_test, java, junit, nodejs, typescript, php, lua, ruby,
# pytest, verilog, sql, csharp (perl, bash, c and cpp come with the base system and gcc);
# measured ~100 s of apt-get here with Java and Node.js already there. Not installed for the
# tests: rust (Debian's rustc is 290 MB), R, D, Scala, Kotlin, Racket, Jest
# (scripts/build-code-runner-template.sh builds a template with all of them). Must run as root.
set -euo pipefail
need=()
command -v go >/dev/null || need+=(golang-go)
command -v node >/dev/null || need+=(nodejs)
command -v tsc >/dev/null || need+=(node-typescript)
command -v javac >/dev/null || need+=(default-jdk-headless)
[ -f /usr/share/java/junit-platform-console-standalone.jar ] || need+=(junit5)
command -v php >/dev/null || need+=(php-cli)
command -v lua >/dev/null || need+=(lua5.4)
command -v ruby >/dev/null || need+=(ruby)
/usr/bin/python3 -c 'import pytest' 2>/dev/null || need+=(python3-pytest)
command -v iverilog >/dev/null || need+=(iverilog)
command -v sqlite3 >/dev/null || need+=(sqlite3)
command -v perl >/dev/null || need+=(perl)
command -v mcs >/dev/null || need+=(mono-mcs)
command -v mono >/dev/null || need+=(mono-runtime)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
