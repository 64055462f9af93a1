"""The Python client's cost beside attn_loadgen's on the same call: one client sends decode calls
of `--batch` sequences of `--context` tokens back to back and reports client latency and client
latency minus the kernel (Timings.compute_us), as attn_loadgen does.

    python3 bench/client_bench.py --address=127.0.0.1:PORT [--transport=shm] [--batch=64]
        [--context=4096] [--seconds=3] [--json=PATH]

The pool is the server's only pool. q is handed over as bf16 bits (a uint16 array, what a model
in bf16 holds), the page table is staged once (stage_page_table) as a scheduler does for every
layer of a step, and the output is copied out of the arena into the result (the client's API).
With --prepared the call is staged once (Client.prepare): q stays in its arena view, which a
model would write its queries into, and the output is read in place, as attn_loadgen does.
With --plan the staged table goes into a plan (Client.plan) that each call names.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))

from attnserve import BatchCsr, Client, call_queue  # noqa: E402
from attnserve.v1 import attention_pb2 as pb  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--transport", default="shm", choices=("bytes", "shm", "cuda", "auto"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup_seconds", type=float, default=1.0)
    p.add_argument("--prepared", action="store_true", help="Client.prepare(): one staging")
    p.add_argument("--plan", action="store_true", help="Client.plan(): the table in a plan")
    p.add_argument(
        "--no_predict",
        action="store_true",
        help="call queue: poll, then sleep until woken, without sleeping through the expected time",
    )
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.no_predict:
        call_queue.PREDICT = False

    with Client(args.address, transport=args.transport, timeout=60) as client:
        pool = client.pool_info()
        if pool.kind != pb.POOL_KIND_GQA:
            raise SystemExit("client_bench measures GQA pools")
        client.open_session()
        ps = pool.page_size
        per_seq = -(-args.context // ps)
        pages = [client.allocate_pages(per_seq) for _ in range(args.batch)]
        table = BatchCsr(
            qo_indptr=np.arange(args.batch + 1, dtype=np.int32),
            kv_indptr=np.arange(args.batch + 1, dtype=np.int32) * per_seq,
            kv_indices=np.concatenate(pages).astype(np.int32),
            kv_last_page_len=np.full(args.batch, args.context - (per_seq - 1) * ps, np.int32),
        )
        rng = np.random.default_rng()
        q = (rng.standard_normal((args.batch, pool.num_qo_heads, pool.head_dim), np.float32)
             .astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # fmt: skip
        client_us: list[float] = []
        compute_us: list[float] = []
        with client.stage_page_table(table) as staged:
            plan = client.plan(staged) if args.plan else None
            on = plan or staged
            prepared = client.prepare("decode", q, on) if args.prepared else None
            call = prepared.run if prepared else lambda: client.decode(0, q, on)
            start = time.perf_counter()
            while time.perf_counter() - start < args.warmup_seconds:
                call()
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                t0 = time.perf_counter()
                result = call()
                client_us.append((time.perf_counter() - t0) * 1e6)
                compute_us.append(result.timings.compute_us)
            if prepared:
                prepared.close()
            if plan:
                plan.release()
        for ids in pages:
            client.free_pages(ids)
        kinds = client.transport.kinds

    c = np.array(client_us)
    e = c - np.array(compute_us)
    r = {
        "transport": args.transport,
        "prepared": args.prepared,
        "plan": args.plan,
        "predict": not args.no_predict,
        "kinds": str(kinds),
        "batch": args.batch,
        "context": args.context,
        "calls": len(c),
        "client_us": {"p50": float(np.percentile(c, 50)), "p99": float(np.percentile(c, 99))},
        "end_to_end_overhead_us": {
            "p50": float(np.percentile(e, 50)),
            "p99": float(np.percentile(e, 99)),
        },
        "compute_us_p50": float(np.percentile(compute_us, 50)),
    }
    lat, e2e = r["client_us"], r["end_to_end_overhead_us"]
    how = "".join(f", {k}" for k in ("prepared", "plan") if getattr(args, k))
    print(
        f"python client, {args.transport} ({kinds}){how}, "
        f"decode batch {args.batch} x {args.context}: "
        f"{len(c)} calls\n  client us p50 {lat['p50']:.0f} p99 {lat['p99']:.0f}"
        f" | compute p50 {r['compute_us_p50']:.0f}\n  end to end  client - compute p50 "
        f"{e2e['p50']:.0f} p99 {e2e['p99']:.0f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
