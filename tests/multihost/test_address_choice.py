"""Which address gloo is told to advertise, and the line a failed connection becomes: the
pieces of ``worker/process_group.py`` the multi-host tests rely on, checked on this host
(no namespaces needed: Redis is reached over loopback here)."""

from __future__ import annotations

import os

import pytest

from shoal.worker import process_group as pg
from shoal.worker.errors import RendezvousFailed

#: what torch 2.13's gloo raised in a namespace when the peer had advertised 127.0.0.1
GLOO_REFUSED = ("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
                "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:40848$0")
GLOO_WAITED = "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.h:311] Connect timeout [none]"


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(pg.IFACE_ENV, raising=False)
    monkeypatch.delenv(pg.GLOO_IFACE_ENV, raising=False)


def test_the_interface_option_wins_then_gloos_variable_then_the_route_to_redis(r, clean_env, monkeypatch) -> None:
    # Redis over loopback: gloo's own default (the host name) is kept, as before
    chosen = pg.choose_address(r)
    assert (chosen.iface, chosen.source) == ("", "the host name; Redis is reached over loopback")
    assert pg.redis_local_address(r) == "127.0.0.1"
    monkeypatch.setenv(pg.GLOO_IFACE_ENV, "lo")
    assert pg.choose_address(r) == pg.Advertised("127.0.0.1", "lo", "GLOO_SOCKET_IFNAME")
    monkeypatch.setenv(pg.IFACE_ENV, "lo")
    assert pg.choose_address(r) == pg.Advertised("127.0.0.1", "lo", "--iface/SHOAL_IFACE")
    with pytest.raises(RendezvousFailed) as bad:
        pg.choose_address(r, "nosuch0")  # the argument beats the environment
    assert "interface 'nosuch0' (--iface/SHOAL_IFACE) has no IPv4 address on this host" in str(bad.value)
    assert "\n" not in str(bad.value)


def test_gloos_variable_names_the_interface_only_while_the_group_is_made(clean_env, monkeypatch) -> None:
    with pg._gloo_interface(pg.Advertised("10.0.0.5", "eth7", "the connection to Redis")):
        assert os.environ[pg.GLOO_IFACE_ENV] == "eth7"
    assert pg.GLOO_IFACE_ENV not in os.environ
    monkeypatch.setenv(pg.GLOO_IFACE_ENV, "eth1")
    with pg._gloo_interface(pg.Advertised("10.0.0.6", "eth2", "--iface/SHOAL_IFACE")):
        assert os.environ[pg.GLOO_IFACE_ENV] == "eth2"
    assert os.environ[pg.GLOO_IFACE_ENV] == "eth1"


def test_a_failed_connection_is_one_line_naming_the_addresses_and_the_option() -> None:
    lo = pg.Advertised("127.0.0.1", "lo", "--iface/SHOAL_IFACE")
    what = "rendezvous of generation 2 (rank 1/2)"
    assert pg.connect_failure(GLOO_REFUSED, what, lo) == (
        "rendezvous of generation 2 (rank 1/2): could not connect to peer 127.0.0.1:40848 (Connection refused); "
        "advertised 127.0.0.1 on lo (--iface/SHOAL_IFACE); set --iface/SHOAL_IFACE to an interface the peers reach")
    waited = pg.connect_failure(GLOO_WAITED, what, pg.Advertised("127.0.0.1", "", "the host name"))
    assert waited == ("rendezvous of generation 2 (rank 1/2): peers could not connect (timed out); advertised "
                      "127.0.0.1 (the host name); set --iface/SHOAL_IFACE to an interface the peers reach")
    assert pg._connect_failure(RuntimeError(GLOO_REFUSED))
    # a peer that never published its address is not a connection problem
    assert not pg._connect_failure(RuntimeError("Gloo connectFullMesh failed with RedisStore: timed out after "
                                                "3.000s waiting for key 'rank_1'"))
