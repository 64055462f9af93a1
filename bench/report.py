"""Joins kernel_bench's and anchors.py's JSON into the markdown tables of bench/RESULTS.md.

    python3 bench/report.py kernel_bench.json [anchors.json] [--again kernel_bench2.json]
                            [--flashinfer fi.json]

The first table: each shape's rate against the ceilings and SDPA's backends. With --flashinfer
(the {name: {backend: us}} JSON of the FlashInfer benchmark run in the same call), a second one:
each shape against the best peer, FlashInfer's fastest backend or SDPA cuDNN on head-major K/V,
with SDPA cuDNN on token-major K/V beside it where anchors.py measured it (the decodes). --again
takes a second kernel_bench round of the same call: both rounds are shown and the ratio takes the
better one. Only the default variant's rows (-1) enter the peer table.
"""

import argparse
import json


def anchor_of(anchors, name):
    """The anchors of the shape kernel_bench calls `name` (anchors.py names it, or a prefix of it
    that ends before one of its _-separated parts: b1x4096 is not b1x40960's)."""
    return next(
        (v for k, v in anchors["shapes"].items() if name == k or name.startswith(k + "_")), {}
    )


def ceilings_table(ours, anchors):
    gemm = anchors.get("gemm_tflops")
    copy = ours["copy_tbps"]
    print(
        f"Device: {ours['device']}; ceilings measured in this run: copy {copy:.2f} TB/s"
        + (f", cuBLAS bf16 GEMM {gemm:.0f} TFLOP/s" if gemm else "")
    )
    print()
    print(
        "| shape | ours (us) | TFLOP/s | TB/s | % copy | % GEMM | cuDNN (us) | FA2 (us) "
        "| vs cuDNN | vs FA2 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in ours["shapes"]:
        anchor = anchor_of(anchors, s["name"])
        cudnn, flash = anchor.get("cudnn"), anchor.get("flash")
        cells = [
            s["name"],
            f"{s['median_us']:.1f}",
            f"{s['tflops']:.0f}",
            f"{s['tbps']:.2f}",
            f"{100 * s['tbps'] / copy:.0f}%",
            f"{100 * s['tflops'] / gemm:.0f}%" if gemm else "",
            f"{cudnn:.1f}" if cudnn else "n/a",
            f"{flash:.1f}" if flash else "n/a",
            f"{cudnn / s['median_us']:.2f}x" if cudnn else "",
            f"{flash / s['median_us']:.2f}x" if flash else "",
        ]
        print("| " + " | ".join(cells) + " |")


def default_rows(bench):
    return {s["name"]: s for s in bench["shapes"] if s.get("variant", -1) == -1}


def peers_table(rounds, anchors, flashinfer):
    print()
    print(
        "| shape | ours (us) | FlashInfer best (backend) | SDPA cuDNN head-major / token-major "
        "| ours / best peer |"
    )
    print("|---|---:|---:|---:|---:|")
    first = default_rows(rounds[0])
    others = [default_rows(r) for r in rounds[1:]]
    for name, row in first.items():
        times = [row["median_us"]] + [o[name]["median_us"] for o in others if name in o]
        fi = {b: us for b, us in flashinfer.get(name, {}).items() if isinstance(us, (int, float))}
        anchor = anchor_of(anchors, name)
        peers = list(fi.values()) + ([anchor["cudnn"]] if "cudnn" in anchor else [])
        fi_best = min(fi, key=fi.get) if fi else None
        sdpa = [f"{anchor[k]:.1f}" for k in ("cudnn", "cudnn_bshd") if k in anchor]
        cells = [
            name,
            " / ".join(f"{t:.1f}" for t in times),
            f"{fi[fi_best]:.1f} ({fi_best})" if fi_best else "n/a",
            " / ".join(sdpa) if sdpa else "n/a",
            f"{min(peers) / min(times):.2f}x" if peers else "",
        ]
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel_bench")
    parser.add_argument("anchors", nargs="?")
    parser.add_argument("--again", help="a second kernel_bench round of the same call")
    parser.add_argument("--flashinfer", help="the FlashInfer benchmark's JSON of the same call")
    args = parser.parse_args()
    ours = json.load(open(args.kernel_bench))
    anchors = json.load(open(args.anchors)) if args.anchors else {"shapes": {}}
    ceilings_table(ours, anchors)
    if args.flashinfer:
        rounds = [ours] + ([json.load(open(args.again))] if args.again else [])
        peers_table(rounds, anchors, json.load(open(args.flashinfer)))


if __name__ == "__main__":
    main()
