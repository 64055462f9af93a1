"""Anchors for kernel_bench: the same shapes through torch's scaled_dot_product_attention (cuDNN
and flash backends, contiguous K/V), plus the ceilings of the device (bf16 GEMM through cuBLAS,
device-to-device copy), timed like kernel_bench: L2 flushed before every run, CUDA events, median.

K/V are head-major ([batch, kv_heads, kv_len, head_dim]: each head's keys one contiguous run), as
SDPA takes them. The decode shapes are measured once more with cuDNN on token-major K/V ([batch,
kv_len, kv_heads, head_dim] viewed as the former: a token's heads adjacent, as a paged cache
holds them), row "cudnn_bshd": what the layout alone costs a decode, which reads K/V once.

    python3 bench/anchors.py --json anchors.json
    python3 bench/anchors.py --filter 'decode_32/8_b64' --backends cudnn --no_ceilings --runs 3
    python3 bench/anchors.py --filter 'b32x' --decode_shapes 32x8192p16,4/1:512x4096 --no_ceilings

--filter keeps the shapes whose name the regular expression matches a part of, --backends the
labels named (cudnn, flash, cudnn_bshd), and --no_ceilings skips the GEMM and copy ceilings: so
that a profiler (Nsight Compute's --kernel-name, --launch-skip) sees one shape's kernels alone.
--decode_shapes adds decodes as kernel_bench's option of that name does, in its spelling
([QO/KV:]BxKEYS[pPAGE], 32/8 heads unless named; the page size, which contiguous K/V do not
have, is left out of the name; its mla<H>: shapes, which SDPA has no kernel for, are skipped),
so that one list gives both tools the same shapes.
"""

import argparse
import json
import re
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# name -> (qo_heads, kv_heads, head_dim, batch, q_len, kv_len); kv_len includes the new tokens.
GQA_SHAPES = {
    "gqa_decode_32/8_b64x4096": (32, 8, 128, 64, 1, 4096),
    "gqa_decode_32/8_b1x16384": (32, 8, 128, 1, 1, 16384),
    "gqa_decode_40/10_b128x2048_p16": (40, 10, 128, 128, 1, 2048),
    "gqa_prefill_32/8_8192_causal_p16": (32, 8, 128, 1, 8192, 8192),
    "gqa_prefill_32/8_4096_causal_p16": (32, 8, 128, 1, 4096, 4096),
    "gqa_prefill_40/10_8x512_on_1024_p16": (40, 10, 128, 8, 512, 1536),
    "gqa_prefill_20/4_1117_on_71488_p64": (20, 4, 128, 1, 1117, 71488 + 1117),
}
DECODE_SPEC = re.compile(r"(?:(\d+)/(\d+):)?(\d+)x(\d+)(?:p\d+)?")
MLA_SPEC = re.compile(r"mla[1-9]\d*:[1-9]\d*x[1-9]\d*p[1-9]\d*")


def decode_shapes(arg):
    """--decode_shapes' list -> {name: shape}, as kernel_bench names the shapes (less _p<PAGE>)."""
    shapes = {}
    for spec in arg.split(","):
        if MLA_SPEC.fullmatch(spec):
            continue  # SDPA has no MLA (kernel_bench's mla<H>: shapes)
        m = DECODE_SPEC.fullmatch(spec)
        qo, kv = (int(m[1]), int(m[2])) if m and m[1] else (32, 8)
        if not m or int(m[3]) < 1 or int(m[4]) < 1 or kv < 1 or qo < kv or qo % kv:
            raise argparse.ArgumentTypeError(f"wants [QO/KV:]BxKEYS[pPAGE], got {spec!r}")
        batch, keys = int(m[3]), int(m[4])
        shapes[f"gqa_decode_{qo}/{kv}_b{batch}x{keys}"] = (qo, kv, 128, batch, 1, keys)
    return shapes


BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


# GPU cycles the stream sleeps between the flush and the timed run (about 1 ms): SDPA's host-side
# dispatch (the cuDNN graph's cache lookup, the Python wrapper) then runs while the GPU is still
# busy, so the events time the kernels, as kernel_bench's do, and not the host. Without it, the
# cuDNN anchors ran 10-200% slower on some device machines than on others (bench/RESULTS.md,
# 2026-12-06), the decode of one sequence most.
HOST_LEAD_CYCLES = 2_000_000


def time_us(fn, runs=30):
    flush = torch.empty(
        2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda"
    )
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        flush.zero_()
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def gqa_anchor(backend, hq, hkv, d, batch, q_len, kv_len, token_major=False, runs=30):
    q = torch.randn(batch, hq, q_len, d, dtype=torch.bfloat16, device="cuda")
    if token_major:
        k = torch.randn(batch, kv_len, hkv, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    else:
        k = torch.randn(batch, hkv, kv_len, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    mask = causal_lower_right(q_len, kv_len) if q_len > 1 else None

    def run():
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return time_us(run, runs)


def gemm_ceiling(n: int = 8192) -> float:
    """bf16 matrix product rate through cuBLAS on random data, TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (time_us(lambda: a @ b, runs=10) * 1e-6) / 1e12


def copy_ceiling(size: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, TB/s."""
    src = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    return 2 * size / (time_us(lambda: dst.copy_(src), runs=10) * 1e-6) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--filter", default="", help="regular expression on the shape names")
    parser.add_argument("--backends", default="", help="comma-separated labels; all if empty")
    parser.add_argument("--no_ceilings", action="store_true")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--decode_shapes", type=decode_shapes, default={})
    args = parser.parse_args()
    torch.manual_seed(0)
    labels = set(args.backends.split(",")) if args.backends else None

    gemm_tflops = copy_tbps = None
    if not args.no_ceilings:
        gemm_tflops, copy_tbps = gemm_ceiling(), copy_ceiling()
        torch.cuda.empty_cache()
        print(f"cuBLAS bf16 GEMM {gemm_tflops:.0f} TFLOP/s, copy {copy_tbps:.2f} TB/s")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")

    results = {"gemm_tflops": gemm_tflops, "copy_tbps": copy_tbps, "shapes": {}}
    for name, shape in {**GQA_SHAPES, **args.decode_shapes}.items():
        if not re.search(args.filter, name):
            continue
        results["shapes"][name] = {}
        runs = [(label, backend, False) for label, backend in BACKENDS.items()]
        if "decode" in name:
            runs.append(("cudnn_bshd", SDPBackend.CUDNN_ATTENTION, True))
        for label, backend, token_major in runs:
            if labels is not None and label not in labels:
                continue
            try:
                us = gqa_anchor(backend, *shape, token_major=token_major, runs=args.runs)
            except RuntimeError as e:  # the backend does not take this shape
                print(f"{name} {label}: unsupported ({str(e).splitlines()[0][:80]})")
                continue
            results["shapes"][name][label] = us
            print(f"{name:40s} {label:6s} {us:10.1f} us")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
