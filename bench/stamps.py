#!/usr/bin/env python3
"""Where a stamped kernel's CTAs spent their time: reads kernel_bench --stamps files.

    python3 bench/stamps.py DIR/*.stamps

Each line of a .stamps file is one work's record (kernels/cuda/api.h, PhaseSlot): a CTA's, or,
for a persistent kernel (the stamped MLA kernel), an item's, many a CTA, each starting when the
producer takes it up, while the consumers still finish the item before; its "gap between works"
is then negative (the overlap), and the item boundary line says what the consumers wait between
one item's last P V and the next one's first S. The SM-time of
the launch (SMs x its span) is split into each CTA's phases, the gaps between one CTA's end and
the next one's start on the same SM, and the SMs' idle time before their first and after their
last CTA. Phases and gaps are measured in SM clock cycles (one SM's clock is one counter, so its
CTAs compare) and converted at the clock the records show (cycles over global-timer ns, the
median over the CTAs); the global timer, coarse but common to all SMs, places the SMs' first and
last CTAs in the launch.
"""

import argparse
import itertools
import statistics
import sys
from collections import defaultdict

SLOTS = [
    "sm_and_tiles",
    "start_ns",
    "end_ns0",
    "end_ns1",
    "start_clk",
    "q_issued_clk",
    "produced_clk",
    "q_ready_clk",
    "first_s_clk",
    "loop_end_clk",
    "stored_clk0",
    "stored_clk1",
]


def read(path):
    ctas = []
    with open(path) as f:
        for line in f:
            values = [int(v) for v in line.split()]
            if len(values) != len(SLOTS):
                sys.exit(f"{path}: a record of {len(values)} slots, not {len(SLOTS)}")
            r = dict(zip(SLOTS, values, strict=True))
            r["sm"] = r["sm_and_tiles"] & 0xFFFFFFFF
            r["tiles"] = r["sm_and_tiles"] >> 32
            r["end_ns"] = max(r["end_ns0"], r["end_ns1"])
            ctas.append(r)
    return ctas


def summarize(path):
    ctas = [c for c in read(path) if c["start_ns"] and c["tiles"]]
    if not ctas:
        return f"{path}: no CTA with key tiles"
    t0 = min(c["start_ns"] for c in ctas)
    t1 = max(c["end_ns"] for c in ctas)
    span = t1 - t0
    # The SM clock: cycles per ns over each CTA's whole life.
    ghz = statistics.median(
        (max(c["stored_clk0"], c["stored_clk1"]) - c["start_clk"]) / (c["end_ns"] - c["start_ns"])
        for c in ctas
        if c["end_ns"] > c["start_ns"]
    )

    def us(cycles):
        return cycles / ghz / 1e3

    phases = {
        "start -> Q ready": [us(c["q_ready_clk"] - c["start_clk"]) for c in ctas],
        "Q ready -> first S": [us(c["first_s_clk"] - c["q_ready_clk"]) for c in ctas],
        "first S -> last P V": [us(c["loop_end_clk"] - c["first_s_clk"]) for c in ctas],
        "last P V -> stored": [
            us(max(c["stored_clk0"], c["stored_clk1"]) - c["loop_end_clk"]) for c in ctas
        ],
    }
    per_tile = [
        us(c["loop_end_clk"] - c["first_s_clk"]) / (c["tiles"] - 1) for c in ctas if c["tiles"] > 1
    ]
    producer = {
        "start -> Q issued": [us(c["q_issued_clk"] - c["start_clk"]) for c in ctas],
        "Q issued -> last tile issued": [us(c["produced_clk"] - c["q_issued_clk"]) for c in ctas],
    }
    by_sm = defaultdict(list)
    for c in ctas:
        by_sm[c["sm"]].append(c)
    gaps, head, tail, boundaries = [], [], [], []
    parts = defaultdict(list)
    for runs in by_sm.values():
        # One SM's clock orders its CTAs and times the gaps between them (the global timer is
        # too coarse for gaps of a microsecond).
        runs.sort(key=lambda c: c["start_clk"])
        head.append((runs[0]["start_ns"] - t0) / 1e3)
        tail.append((t1 - runs[-1]["end_ns"]) / 1e3)
        gaps += [
            us(b["start_clk"] - max(a["stored_clk0"], a["stored_clk1"]))
            for a, b in itertools.pairwise(runs)
        ]
        # The consumers' view of the move from one work to the next: last P V to first S, and
        # its parts: the stores (the score warpgroup's, stamped by its first thread), the wait
        # for the next Q, the first S with its softmax; and the producer's: when it had issued
        # the next Q, from the last P V of the work before (negative: before it).
        for a, b in itertools.pairwise(runs):
            boundaries.append(us(b["first_s_clk"] - a["loop_end_clk"]))
            parts["stores"].append(us(a["stored_clk0"] - a["loop_end_clk"]))
            parts["stored -> next Q ready"].append(us(b["q_ready_clk"] - a["stored_clk0"]))
            parts["next Q ready -> its first S"].append(us(b["first_s_clk"] - b["q_ready_clk"]))
            parts["next Q issued, from last P V"].append(us(b["q_issued_clk"] - a["loop_end_clk"]))
    sm_time = len(by_sm) * span / 1e3
    busy = sum((c["end_ns"] - c["start_ns"]) / 1e3 for c in ctas)

    lines = [
        f"{path}: {len(ctas)} CTAs on {len(by_sm)} SMs, span {span / 1e3:.1f} us, "
        f"clock {ghz:.3f} GHz, {statistics.mean(c['tiles'] for c in ctas):.1f} key tiles a CTA",
        f"  CTA life: mean {busy / len(ctas):.2f} us, "
        f"p10 {quantile([(c['end_ns'] - c['start_ns']) / 1e3 for c in ctas], 0.1):.2f}, "
        f"p90 {quantile([(c['end_ns'] - c['start_ns']) / 1e3 for c in ctas], 0.9):.2f}",
    ]
    for name, values in list(phases.items()) + list(producer.items()):
        lines.append(
            f"  {name:30s} mean {statistics.mean(values):7.2f} us  p90 {quantile(values, 0.9):7.2f}"
        )
    if per_tile:
        lines.append(f"  {'a key tile in the loop':30s} mean {statistics.mean(per_tile):7.2f} us")
    phase_sum = {name: sum(values) for name, values in phases.items()}
    gap_sum, head_sum, tail_sum = sum(gaps), sum(head), sum(tail)
    lines.append("  SM-time (SMs x span):")
    for name, total in list(phase_sum.items()) + [
        ("between CTAs on an SM", gap_sum),
        ("before an SM's first CTA", head_sum),
        ("after an SM's last CTA", tail_sum),
    ]:
        lines.append(f"    {name:30s} {100 * total / sm_time:5.1f}%")
    if gaps:
        lines.append(
            f"  gap between CTAs on an SM: mean {statistics.mean(gaps):.2f} us, "
            f"p90 {quantile(gaps, 0.9):.2f}"
        )
        lines.append(
            f"  last P V -> next first S on an SM: mean {statistics.mean(boundaries):.2f} us, "
            f"p90 {quantile(boundaries, 0.9):.2f}"
        )
        for name, values in parts.items():
            lines.append(
                f"    {name:32s} mean {statistics.mean(values):7.2f} us  "
                f"p10 {quantile(values, 0.1):7.2f}  p90 {quantile(values, 0.9):7.2f}"
            )
    return "\n".join(lines)


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    for path in args.files:
        print(summarize(path))


if __name__ == "__main__":
    main()
