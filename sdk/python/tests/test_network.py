"""Network egress through the SDK: ``network=`` on create, ``set_network``, tenants'
``egress_ceiling``, typed errors. (What the policies let through is tested against a fake
internet in ``crates/cli/tests/egress.rs``; nothing here leaves the machine.)"""

from __future__ import annotations

import pytest

import dsec


def test_policy_round_trip_and_change(server, client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client, network={"egress": {"allow": ["pypi.org", "10.20.0.0/16:443"]}})
    try:
        assert sb.network == {"egress": {"allow": ["pypi.org", "10.20.0.0/16:443"]}}
        assert sb.network_address
        # The default route goes to the node; a destination the policy does not list is
        # refused at once (not left to time out), and so is a name it does not list.
        r = sb.exec(
            "/usr/bin/python3 -c \"import socket; s=socket.socket(); s.settimeout(5); s.connect(('192.0.2.77', 80))\""
        )
        assert r.exit_code != 0
        assert b"no route to host" in r.stderr.lower(), r.stderr  # admin-prohibited
        assert sb.exec("getent hosts example.com").exit_code != 0
        sb.set_network({"egress": "none"})
        assert sb.network == {"egress": "none"}
        assert sb.network_address is None
        assert b"eth0" not in sb.exec("cat /proc/net/dev").stdout
        sb.set_network({"egress": "all"})
        assert sb.network_address
        assert b"eth0" in sb.exec("cat /proc/net/dev").stdout
    finally:
        sb.destroy()


def test_default_is_loopback_only(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client) as sb:
        assert sb.network == {"egress": "none"}
        assert sb.network_address is None
        assert b"eth0" not in sb.exec("cat /proc/net/dev").stdout


def test_ceilings_and_bad_policies(server, client: dsec.Client) -> None:
    plain = server.new_tenant()
    with pytest.raises(dsec.Forbidden):
        dsec.Sandbox.create(plain, network={"egress": "all"})
    some = server.new_tenant(egress_ceiling={"allow": ["*.org"]})
    sb = dsec.Sandbox.create(some, network={"egress": {"allow": ["pypi.org"]}})
    try:
        with pytest.raises(dsec.Forbidden):
            sb.set_network({"egress": {"allow": ["github.com"]}})
    finally:
        sb.destroy()
    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(client, network={"egress": {"allow": ["::1"]}})
    with pytest.raises(dsec.InvalidRequest):
        dsec.Sandbox.create(client, network={"egress": "sometimes"})
