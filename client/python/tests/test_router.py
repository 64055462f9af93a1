"""HashRing balance and stability, and Router placement and batch splitting."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import fake_server
import numpy as np
import pytest

from attnserve import Client, HashRing, Router
from attnserve.router import stable_hash

KEYS = [f"req-{i}" for i in range(20000)]


def homes(ring: HashRing) -> dict[str, str]:
    return {k: ring.node_for(k) for k in KEYS}


@pytest.mark.parametrize("servers", [2, 3, 4, 8])
def test_ring_spreads_keys_evenly(servers: int) -> None:
    counts = Counter(homes(HashRing([f"gpu{i}" for i in range(servers)])).values())
    mean = len(KEYS) / servers
    assert len(counts) == servers
    assert all(0.85 * mean <= c <= 1.15 * mean for c in counts.values()), counts


def test_adding_a_server_moves_only_its_share_to_it() -> None:
    ring = HashRing([f"gpu{i}" for i in range(4)])
    before = homes(ring)
    ring.add("gpu4")
    after = homes(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.15 <= len(moved) / len(KEYS) <= 0.25  # ~1/5
    assert {after[k] for k in moved} == {"gpu4"}


def test_removing_a_server_moves_only_its_keys() -> None:
    ring = HashRing([f"gpu{i}" for i in range(5)])
    before = homes(ring)
    ring.remove("gpu2")
    after = homes(ring)
    assert {k for k in KEYS if before[k] != after[k]} == {k for k in KEYS if before[k] == "gpu2"}
    assert "gpu2" not in after.values()
    ring.add("gpu2")
    assert homes(ring) == before  # the ring depends on its members only, not on their history


def test_hashes_are_the_same_in_every_process() -> None:
    """Python's hash() of a str changes with PYTHONHASHSEED; the ring's does not."""
    code = "from attnserve.router import stable_hash; print(stable_hash('seq-1'), stable_hash(7))"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},  # keep PYTHONPATH and the like
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == [str(stable_hash("seq-1")), str(stable_hash(7))]
    assert stable_hash(7) == stable_hash("7") != stable_hash(b"8")
    assert stable_hash(("a", 1)) != stable_hash(("a", 2))


def test_ring_rejects_misuse() -> None:
    with pytest.raises(LookupError):
        HashRing().node_for("x")
    ring = HashRing(["a"])
    with pytest.raises(ValueError):
        ring.add("a")
    with pytest.raises(ValueError):
        ring.remove("b")
    with pytest.raises(ValueError):
        HashRing(vnodes=0)


def router(servers: int = 3) -> Router[str]:
    """A Router whose "clients" are just names."""
    return Router({f"gpu{i}": f"client{i}" for i in range(servers)})


def test_placement_follows_the_ring_then_sticks() -> None:
    r = router()
    seqs = [f"s{i}" for i in range(300)]
    placed = {s: r.server_for(s) for s in seqs}
    assert all(placed[s] == r.ring.node_for(s) for s in seqs)
    assert r.client_for("s0") == "client" + placed["s0"].removeprefix("gpu")
    r.add_server("gpu3", "client3")
    assert {s: r.server_for(s) for s in seqs} == placed  # live sequences stay with their pages
    assert any(r.ring.node_for(s) == "gpu3" for s in seqs)  # ... though the ring moved some
    r.release("s0")
    assert r.placement("s0") is None and r.server_for("s0") == r.ring.node_for("s0")


def test_pin_places_explicitly() -> None:
    r = router()
    home = r.ring.node_for("x")
    other = next(s for s in r.servers if s != home)
    r.pin("x", other)
    assert r.server_for("x") == other and r.placement("x") == other
    r.pin("x", other)  # again: fine
    with pytest.raises(ValueError, match="release it first"):
        r.pin("x", home)
    with pytest.raises(ValueError, match="no server"):
        r.pin("y", "gpu9")
    r.release("x")
    r.pin("x", home)
    assert r.server_for("x") == home


def test_removing_a_server_returns_its_sequences() -> None:
    r = router()
    seqs = [f"s{i}" for i in range(100)]
    placed = {s: r.server_for(s) for s in seqs}
    lost = r.remove_server("gpu1")
    assert sorted(lost) == sorted(s for s in seqs if placed[s] == "gpu1")
    assert r.servers == ["gpu0", "gpu2"]
    assert all(r.server_for(s) == placed[s] for s in seqs if s not in lost)
    assert all(r.server_for(s) != "gpu1" for s in lost)
    with pytest.raises(ValueError):
        r.add_server("gpu0", "again")


def test_split_groups_a_batch_by_server() -> None:
    r = router()
    seqs = [f"s{i}" for i in range(12)]
    q_lens = [i % 4 + 1 for i in range(12)]
    r.pin("s5", "gpu2")
    batches = r.split(seqs, q_lens)
    assert [b.server for b in batches] == list(dict.fromkeys(r.server_for(s) for s in seqs))
    rows = np.arange(sum(q_lens))
    owner = np.repeat(seqs, q_lens)
    gathered = []
    for b in batches:
        assert b.client == r.client(b.server)
        assert b.seq_ids == [seqs[i] for i in b.positions]
        assert b.q_lens == [q_lens[i] for i in b.positions]
        assert all(r.server_for(s) == b.server for s in b.seq_ids)
        assert len(b.rows) == sum(b.q_lens)
        np.testing.assert_array_equal(owner[b.rows], np.repeat(b.seq_ids, b.q_lens))
        gathered.append(rows[b.rows])
    np.testing.assert_array_equal(np.sort(np.concatenate(gathered)), rows)  # each row once
    decode = r.split(seqs)
    assert all(list(b.rows) == b.positions for b in decode)
    with pytest.raises(ValueError, match="q_lens"):
        r.split(seqs, [1])


def test_connect_names_servers_by_address() -> None:
    servers = [fake_server.start(fake_server.FakeAttentionService([fake_server.gqa_pool()]))]
    servers.append(fake_server.start(fake_server.FakeAttentionService([fake_server.gqa_pool()])))
    addresses = [address for _, address in servers]
    try:
        with Router.connect(addresses, timeout=5.0) as r:
            assert r.servers == addresses
            assert isinstance(r.client(addresses[0]), Client)
            for b in r.split([f"s{i}" for i in range(8)]):
                assert b.client.allocate_pages(len(b.seq_ids)) and b.client.address == b.server
        with Client(addresses[1]) as c:
            assert Router([c]).servers == [addresses[1]]
        with pytest.raises(TypeError, match="no address"):
            Router([object()])
    finally:
        for server, _ in servers:
            server.stop(grace=None)
