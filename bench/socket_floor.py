#!/usr/bin/env python3
"""The floor under any bytes transport: one request of N bytes and one response of M bytes
through a plain loopback socket (TCP or unix), no RPC framework, preallocated buffers.

A second process echoes: it reads the whole request, then writes the whole response. What a call
costs here is the kernel's copies in and out of the socket buffers and the wake-ups, which every
bytes call through gRPC pays as well; bench/service_scenarios.sh's bytes scenarios are measured
against it (bench/RESULTS.md).

    bench/socket_floor.py --request 786432 --response 532480      (decode b64: q, k, v / out, lse)
    bench/socket_floor.py --request 100663296 --response 68157440 --seconds 5
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

# The socket buffers the server sets on its unix sockets (server/rpc/transport_args.cc).
BUFFER_BYTES = 4 << 20


def tune(sock, unix):
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
    if not unix:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def read_exactly(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def echo(listener, request, response):
    conn, _ = listener.accept()
    tune(conn, listener.family == socket.AF_UNIX)
    inbox = memoryview(bytearray(request))
    outbox = bytes(response)
    while read_exactly(conn, inbox):
        conn.sendall(outbox)
    conn.close()


def measure(transport, request, response, seconds, warmup):
    unix = transport == "unix"
    path = None
    if unix:
        path = os.path.join(tempfile.mkdtemp(), "floor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = path if unix else listener.getsockname()
    pid = os.fork()
    if pid == 0:
        try:
            echo(listener, request, response)
        finally:
            os._exit(0)
    listener.close()
    client = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
    client.connect(address)
    tune(client, unix)
    outbox = bytes(request)
    inbox = memoryview(bytearray(response))
    times = []
    start = time.monotonic()
    while time.monotonic() - start < seconds + warmup:
        t0 = time.perf_counter_ns()
        client.sendall(outbox)
        if not read_exactly(client, inbox):
            sys.exit("the echo process closed the connection")
        t1 = time.perf_counter_ns()
        if time.monotonic() - start >= warmup:
            times.append((t1 - t0) / 1000.0)
    client.close()
    os.waitpid(pid, 0)
    if path:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    times.sort()
    p50 = statistics.median(times)
    return {
        "transport": transport,
        "request_bytes": request,
        "response_bytes": response,
        "calls": len(times),
        "p50_us": p50,
        "p99_us": times[min(len(times) - 1, int(0.99 * len(times)))],
        "gb_per_s": (request + response) / (p50 * 1e3),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--request", type=int, required=True, help="bytes the client sends a call")
    ap.add_argument("--response", type=int, required=True, help="bytes it reads back")
    ap.add_argument("--transports", default="tcp,unix")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--json", help="append one JSON line per transport to this file")
    args = ap.parse_args()
    if args.request <= 0 or args.response <= 0:
        sys.exit("--request and --response must be positive")
    for transport in args.transports.split(","):
        if transport not in ("tcp", "unix"):
            sys.exit(f"unknown transport {transport!r} (tcp, unix)")
        r = measure(transport, args.request, args.response, args.seconds, args.warmup)
        print(
            f"{transport:5s} {args.request:>10d} in {args.response:>10d} out: "
            f"p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us, {r['gb_per_s']:.2f} GB/s, "
            f"{r['calls']} calls"
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
