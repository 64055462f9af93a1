"""Client-side routing over several servers (e.g. one attnserve per GPU).

A sequence's K/V lives in the pages of one server, so every call for it must go to that server.
Router places each new sequence with a consistent-hash ring (HashRing) and then keeps it there:

- Placement is sticky: the first server_for / split / pin of a sequence records its server, and
  later calls return that server until release() (call it when the sequence's pages are freed),
  even if servers are added meanwhile. Only new sequences follow the ring.
- The ring gives each server `vnodes` points on a 64-bit circle (BLAKE2b hashes, identical in
  every process, unlike Python's hash()); a key belongs to the first point clockwise from its
  own hash. Adding a server takes ~1/N of the keys, all from the others to it; removing one moves
  only its own keys. So routers in several processes, or after a restart, agree on where a
  sequence id goes without talking to each other.
- pin() places a sequence explicitly (e.g. on the least loaded server, or where its prefix is).

Sequence ids are str, bytes, int, or anything whose repr() is stable across processes (tuples of
those are). Router is generic in the client type: attnserve.Client, AsyncClient or anything else.
"""

from __future__ import annotations

import hashlib
import threading
from bisect import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from attnserve.client import Client

C = TypeVar("C")

DEFAULT_VNODES = 256


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of key that is the same in every process and Python version."""
    if isinstance(key, bytes):
        data = key
    elif isinstance(key, str | int):
        data = str(key).encode()
    else:
        data = repr(key).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing of keys onto named nodes, with virtual nodes (see the module doc)."""

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self._vnodes = vnodes
        self._nodes: list[str] = []
        self._points: list[tuple[int, str]] = []  # sorted (hash, node)
        self._hashes: list[int] = []  # the hashes of _points, for bisect
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[str]:
        """The nodes in the order they were added."""
        return list(self._nodes)

    def add(self, node: str) -> None:
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        self._nodes.append(node)
        points = [(stable_hash(f"{node}#{i}"), node) for i in range(self._vnodes)]
        self._set_points(self._points + points)

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            raise ValueError(f"node {node!r} is not on the ring")
        self._nodes.remove(node)
        self._set_points([p for p in self._points if p[1] != node])

    def node_for(self, key: Hashable) -> str:
        """The node that owns key."""
        if not self._points:
            raise LookupError("the ring has no nodes")
        i = bisect(self._hashes, stable_hash(key)) % len(self._points)
        return self._points[i][1]

    def _set_points(self, points: list[tuple[int, str]]) -> None:
        self._points = sorted(points)
        self._hashes = [h for h, _ in self._points]


@dataclass(frozen=True)
class ServerBatch(Generic[C]):
    """The part of a batch that one server serves, sequences in the order they were given.

    positions: index of each sequence in the list given to Router.split.
    rows: the query rows of these sequences within the whole batch's rows (sequence after
      sequence, q_lens rows each), so `q[batch.rows]` gathers this server's inputs and
      `out[batch.rows] = result.output` scatters its outputs back. For decode rows == positions.
    """

    server: str
    client: C
    seq_ids: list[Hashable]
    q_lens: list[int]
    positions: list[int]
    rows: np.ndarray


class Router(Generic[C]):
    """Keeps every sequence on the server that holds its pages (see the module doc).

    clients: name -> client, or clients named by their `.address`. Thread-safe. Router.connect
    builds sync Clients from addresses; close() closes those (and only those).
    """

    def __init__(
        self, clients: Mapping[str, C] | Iterable[C], *, vnodes: int = DEFAULT_VNODES
    ) -> None:
        named = clients if isinstance(clients, Mapping) else {_address(c): c for c in clients}
        self._clients: dict[str, C] = dict(named)
        self._ring = HashRing(self._clients, vnodes)
        self._placed: dict[Hashable, str] = {}
        self._owned: list[Client] = []
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls, addresses: Iterable[str], *, vnodes: int = DEFAULT_VNODES, **client_options: object
    ) -> Router[Client]:
        """A Router over new Clients (Client(address, **client_options)); close() closes them."""
        clients = [Client(a, **client_options) for a in addresses]  # type: ignore[arg-type]
        router: Router[Client] = Router(clients, vnodes=vnodes)
        router._owned = clients
        return router

    def close(self) -> None:
        """Closes the clients that Router.connect created."""
        for client in self._owned:
            client.close()

    def __enter__(self) -> Router[C]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def servers(self) -> list[str]:
        return self._ring.nodes

    @property
    def ring(self) -> HashRing:
        """The ring new sequences are placed by (node_for gives a key's home, placing nothing)."""
        return self._ring

    def client(self, server: str) -> C:
        return self._clients[server]

    def add_server(self, name: str, client: C) -> None:
        """Adds a server; only sequences placed from now on can go to it."""
        with self._lock:
            if name in self._clients:
                raise ValueError(f"server {name!r} is already routed to")
            self._ring.add(name)
            self._clients[name] = client

    def remove_server(self, name: str) -> list[Hashable]:
        """Removes a server and returns the sequences placed on it, now forgotten (their pages
        went with the server: recompute them elsewhere). The caller closes its client."""
        with self._lock:
            self._ring.remove(name)
            del self._clients[name]
            lost = [s for s, server in self._placed.items() if server == name]
            for seq_id in lost:
                del self._placed[seq_id]
            return lost

    def server_for(self, seq_id: Hashable) -> str:
        """The sequence's server: where it was placed, else (placing it now) its ring node."""
        with self._lock:
            return self._place(seq_id)

    def client_for(self, seq_id: Hashable) -> C:
        return self._clients[self.server_for(seq_id)]

    def placement(self, seq_id: Hashable) -> str | None:
        """Where the sequence is placed, or None (placing nothing)."""
        with self._lock:
            return self._placed.get(seq_id)

    def pin(self, seq_id: Hashable, server: str) -> None:
        """Places the sequence on server. ValueError if it is already placed on another one
        (its pages are there: release it first)."""
        with self._lock:
            if server not in self._clients:
                raise ValueError(f"no server {server!r}; routing to {self._ring.nodes}")
            current = self._placed.setdefault(seq_id, server)
            if current != server:
                raise ValueError(f"sequence {seq_id!r} is placed on {current!r}; release it first")

    def release(self, seq_id: Hashable) -> None:
        """Forgets the sequence's placement (after its pages were freed); unknown ids are fine."""
        with self._lock:
            self._placed.pop(seq_id, None)

    def split(
        self, seq_ids: Sequence[Hashable], q_lens: Sequence[int] | None = None
    ) -> list[ServerBatch[C]]:
        """Splits a batch by server, placing new sequences; servers in order of first appearance.

        q_lens: query rows per sequence (default one each, as in Decode).
        """
        if q_lens is None:
            q_lens = [1] * len(seq_ids)
        if len(q_lens) != len(seq_ids):
            raise ValueError(f"{len(q_lens)} q_lens for {len(seq_ids)} sequences")
        starts = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)])
        with self._lock:
            servers = [self._place(s) for s in seq_ids]
        positions: dict[str, list[int]] = {}
        for i, server in enumerate(servers):
            positions.setdefault(server, []).append(i)
        return [
            ServerBatch(
                server=server,
                client=self._clients[server],
                seq_ids=[seq_ids[i] for i in idx],
                q_lens=[q_lens[i] for i in idx],
                positions=idx,
                rows=np.concatenate(
                    [np.arange(starts[i], starts[i + 1]) for i in idx], dtype=np.int64
                ),
            )
            for server, idx in positions.items()
        ]

    def _place(self, seq_id: Hashable) -> str:
        server = self._placed.get(seq_id)
        if server is None:
            server = self._placed[seq_id] = self._ring.node_for(seq_id)
        return server


def _address(client: object) -> str:
    """The name of a client given without one: its `address`."""
    address = getattr(client, "address", None)
    if not isinstance(address, str):
        raise TypeError(f"{client!r} has no address: pass a mapping of server name to client")
    return address
