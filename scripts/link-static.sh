#!/bin/sh
# Linker driver for dsec's own target (.cargo/config.toml): `cc`, except that the in-sandbox
# agent is linked as a static position-dependent executable instead of a static PIE.
# A static PIE relocates itself at start-up, which writes — and so copies — its 52 KiB of
# relocated read-only data (GOT, vtables) in every process; with thousands of idle sandboxes
# each running an agent, those private copies were a twentieth of a sandbox's host memory.
# Linked position-dependent, those pages stay shared in the page cache. The code is still
# compiled position-independent, which a position-dependent link accepts; every other binary
# (the daemon, the shim) stays a PIE.
case "$*" in
*/dsec_agent-*)
    for a in "$@"; do
        shift
        if [ "$a" = "-static-pie" ]; then
            set -- "$@" -static -no-pie
        else
            set -- "$@" "$a"
        fi
    done
    ;;
esac
exec "${DSEC_CC:-cc}" "$@"
