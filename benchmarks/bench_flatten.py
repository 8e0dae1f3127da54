"""Flatten bandwidth: pydist.ops.flatten vs torch, and vs one plain copy.

    python benchmarks/bench_flatten.py                 # full grid + target row, 1 thread
    python benchmarks/bench_flatten.py --threads 2
    python benchmarks/bench_flatten.py --quick         # smoke: small sizes, 2 reps
    python benchmarks/bench_flatten.py --device cuda   # on a GPU
    python benchmarks/bench_flatten.py --json out.json

For each (tensor count, total bytes) of float32 tensors it times, best of N:

    into    pydist.ops.flatten(tensors, out=bucket)   (preallocated bucket)
    alloc   pydist.ops.flatten(tensors)               (allocates the result)
    torch   torch._utils._flatten_dense_tensors(tensors)
    copy    bucket.copy_(src), one contiguous tensor of the same bytes

GB/s counts bytes read plus bytes written (2 x total). The ratios are
into/copy (how close to a plain copy) and into/torch (speed-up over torch).
The `target` row is issue #2's: 2000 tensors of 256-64k float32 elements.
Every flatten result is checked bitwise against torch's before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from torch._utils import _flatten_dense_tensors

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pydist.ops as ops  # noqa: E402
from pydist import _C  # noqa: E402

COUNTS = [10, 100, 1000, 10000]
TOTALS_MB = [1, 4, 16, 64, 256]


def make_tensors(sizes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device) for n in sizes]


def sizes_for(count, total_bytes, seed=0):
    """`count` float32 sizes, each 0.5-1.5x the mean, adding up to total_bytes/4."""
    gen = torch.Generator().manual_seed(seed)
    total = total_bytes // 4
    mean = total / count
    sizes = (mean * (0.5 + torch.rand(count, generator=gen))).long().clamp(min=1)
    sizes = (sizes.double() * total / sizes.sum()).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return sizes.clamp(min=0).tolist()


def best_seconds(fn, reps, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def run_case(label, sizes, device, reps):
    tensors = make_tensors(sizes, device)
    total = sum(sizes)
    bucket = torch.empty(total, device=device)
    src = torch.randn(total, device=device)
    want = _flatten_dense_tensors(tensors)
    ops.flatten(tensors, out=bucket)
    if not torch.equal(bucket.view(torch.int32), want.view(torch.int32)):
        raise SystemExit(f"{label}: pydist flatten differs from torch's; not timing a wrong answer")
    nbytes = 4 * total
    secs = {
        "into": best_seconds(lambda: ops.flatten(tensors, out=bucket), reps, device),
        "alloc": best_seconds(lambda: ops.flatten(tensors), reps, device),
        "torch": best_seconds(lambda: _flatten_dense_tensors(tensors), reps, device),
        "copy": best_seconds(lambda: bucket.copy_(src), reps, device),
    }
    gbs = {k: 2 * nbytes / s / 1e9 for k, s in secs.items()}
    return {
        "case": label, "count": len(sizes), "bytes": nbytes,
        **{f"{k}_us": s * 1e6 for k, s in secs.items()},
        **{f"{k}_gbs": g for k, g in gbs.items()},
        "into_vs_copy": gbs["into"] / gbs["copy"], "into_vs_torch": gbs["into"] / gbs["torch"],
    }


HEADER = (f"{'case':>8} {'count':>6} {'size(B)':>11} {'into GB/s':>10} {'alloc GB/s':>10} "
          f"{'torch GB/s':>10} {'copy GB/s':>10} {'into/copy':>9} {'into/torch':>10}")


def print_row(r):
    print(f"{r['case']:>8} {r['count']:>6} {r['bytes']:>11} {r['into_gbs']:>10.2f} {r['alloc_gbs']:>10.2f} "
          f"{r['torch_gbs']:>10.2f} {r['copy_gbs']:>10.2f} {r['into_vs_copy']:>9.2f} {r['into_vs_torch']:>10.2f}",
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1-4 MB, 2 reps")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    totals = [1, 4] if args.quick else TOTALS_MB
    counts = [10, 1000] if args.quick else COUNTS
    print(f"# bench_flatten: torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"streaming stores: {_C.streaming_isa()}, {platform.processor() or platform.machine()}")
    print("# GB/s = (bytes read + bytes written) / time, best of N; float32")
    print(HEADER)
    rows = []
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(256, 65536 + 1, (2000,), generator=gen).tolist()
    if args.quick:
        target = [n // 16 for n in target]
    rows.append(run_case("target", target, args.device, 2 if args.quick else 10))
    print_row(rows[-1])
    for count in counts:
        for mb in totals:
            reps = 2 if args.quick else (3 if mb >= 64 else 10)
            rows.append(run_case(f"grid", sizes_for(count, mb << 20), args.device, reps))
            print_row(rows[-1])
    t = rows[0]
    print(f"# target (2000 tensors, 256-64k elements): into {t['into_gbs']:.2f} GB/s = "
          f"{t['into_vs_copy']:.2f}x plain copy, {t['into_vs_torch']:.2f}x _flatten_dense_tensors")
    if args.json:
        meta = {"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(),
                "streaming_isa": _C.streaming_isa(), "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
