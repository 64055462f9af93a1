"""Joins kernel_bench's and anchors.py's JSON into the markdown table of bench/RESULTS.md.

python3 bench/report.py kernel_bench.json anchors.json
"""

import json
import sys


def main():
    ours = json.load(open(sys.argv[1]))
    anchors = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"shapes": {}}
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
        name = s["name"]
        anchor = next((v for k, v in anchors["shapes"].items() if name.startswith(k)), {})
        cudnn, flash = anchor.get("cudnn"), anchor.get("flash")
        cells = [
            name,
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


if __name__ == "__main__":
    main()
