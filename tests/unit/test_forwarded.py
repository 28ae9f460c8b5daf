"""--trusted-proxies: the client behind a trusted reverse proxy is the right-most untrusted
address of X-Forwarded-For; nobody else's header is believed."""

from __future__ import annotations

import subprocess

import pytest

from engine.errors import ConfigError
from engine.server.api.forwarded import TrustedProxies
from tests.server_harness import BIN


def test_a_trusted_proxys_forwarded_client_is_counted():
    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1", "fd00::/8"])
    # each proxy appends the address it received the request from: the right-most
    # untrusted one is the client, whatever the client wrote to its left
    assert proxies.client("10.1.2.3", ["6.6.6.6, 203.0.113.7"]) == "203.0.113.7"
    assert proxies.client("127.0.0.1", ["198.51.100.1, 10.9.9.9"]) == "198.51.100.1"
    assert proxies.client("10.1.2.3", ["198.51.100.1", "10.0.0.5"]) == "198.51.100.1"
    assert proxies.client("::ffff:10.1.2.3", ["2001:db8::1"]) == "2001:db8::1"
    # no header, only proxies, or a malformed hop: the peer
    assert proxies.client("10.1.2.3", []) == "10.1.2.3"
    assert proxies.client("10.1.2.3", ["10.0.0.9"]) == "10.1.2.3"
    assert proxies.client("10.1.2.3", ["198.51.100.1, not-an-ip"]) == "10.1.2.3"


def test_an_untrusted_peer_cannot_claim_another_address():
    proxies = TrustedProxies(["10.0.0.0/8"])
    assert proxies.client("198.51.100.9", ["203.0.113.7"]) == "198.51.100.9"
    assert TrustedProxies().client("10.1.2.3", ["203.0.113.7"]) == "10.1.2.3"


def test_a_bad_network_is_a_flag_error():
    with pytest.raises(ConfigError, match="--trusted-proxies"):
        TrustedProxies(["10.0.0.0/33"])
    done = subprocess.run([str(BIN), "serve", "--trusted-proxies", "10.0.0.0/8,nonsense"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--trusted-proxies 'nonsense'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
