"""Where a step's device memory goes at its peak: torch FSDP2 and pydist on
bench_fsdp_cuda.py's models, one NCCL rank, from the caching allocator's trace.

    python benchmarks/gpu_memory_trace.py [linear,ln400,transformer]

Per model and mode: 3 warm-up steps and ``zero_grad``, then one step under
``torch.cuda.memory._record_memory_history(stacks="python")``; the trace is
replayed to its peak and the blocks alive there are grouped by their
Python frames (pydist's, FSDP's, the optimizer's, the benchmark's first).
Needs a GPU.
"""
import collections
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_fsdp import MODELS, _step_fn  # noqa: E402
from bench_fsdp_cuda import _build  # noqa: E402
from pydist.spawn import run_ranks  # noqa: E402


def where(e):
    """An allocation's place: its first Python frames, pydist's, FSDP's, the optimizer's and the benchmark's first."""
    frames = [f for f in e.get("frames", []) if f.get("filename", "").endswith(".py")]
    keep = [f for f in frames if "pydist" in f["filename"] or "fsdp" in f["filename"] or "optim" in f["filename"]
            or "bench" in f["filename"]] or frames
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in keep[:4]) or "(no python frame)"


def probe(rank, world, model_key, mode):
    """Rank entry point: the report of one model under one mode (a traceback if it failed)."""
    try:
        x = torch.randn(*MODELS[model_key].input_shape).cuda()
        model, opt = _build(mode, model_key, world)
        fn = _step_fn(model, opt, x)
        for _ in range(3):
            fn()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        live, cur, best, at_peak, n = {}, 0, 0, {}, 0
        for e in snap["device_traces"][0]:
            n += 1
            if e["action"] == "alloc":
                live[e["addr"]] = e
                cur += e["size"]
                if cur > best:
                    best, at_peak = cur, dict(live)
            elif e["action"] == "free_requested" and e["addr"] in live:
                cur -= live.pop(e["addr"])["size"]
        groups, counts = collections.Counter(), collections.Counter()
        for e in at_peak.values():
            groups[where(e)] += e["size"]
            counts[where(e)] += 1
        out = [f"## {model_key} {mode}: peak {peak / 2**20:.2f} MB above the step's start; replayed {best / 2**20:.2f} MB ({n} events)"]
        for k, v in groups.most_common(14):
            out.append(f"  {v / 2**20:8.3f} MB x{counts[k]:<4d} {k}")
        return "\n".join(out)
    except Exception:
        return traceback.format_exc()


if __name__ == "__main__":
    for model_key in (sys.argv[1] if len(sys.argv) > 1 else "linear,ln400,transformer").split(","):
        for mode in ("torch", "pydist"):
            print(run_ranks(probe, 1, args=(model_key, mode), backend="nccl", timeout=120)[0], flush=True)
