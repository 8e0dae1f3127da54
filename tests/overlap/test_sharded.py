"""The overlap lab over the sharded wrapper (pydist.fully_shard and
FullyShardedDataParallel), beside what test_trace.py and test_sim_net.py
check for DDP: PYDIST_TRACE writes each rank's all-gathers and
reduce-scatters per unit and step; PYDIST_SIM_NET is refused when it cannot
be read and otherwise slows every collective to the link's model, results
bitwise unchanged; ``report DIR`` names the collective that stalled."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pydist.spawn import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
WIDTH = 32
LAYERS = 3
LINK = "1Gbps,15ms"  # latency-bound: every collective takes >= 15 ms at 2 ranks, far above this model's compute


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _train(model, rank, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, WIDTH, generator=gen)).square().sum().backward()
        opt.step()


def _wrapped(kind):
    import pydist

    model = _model()
    if kind == "fully_shard":
        for layer in model:
            pydist.fully_shard(layer, reshard_after_forward=True)
        return pydist.fully_shard(model)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return pydist.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))


def _shards(model):
    """This rank's shards of the trained parameters (the same layout in both runs)."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in model.parameters()]


def _sharded_ranks(rank, world_size, trace_dir):
    """Each wrapper: a reference run, then a run with PYDIST_TRACE (and
    PYDIST_SIM_NET), whose parameters must be bitwise the reference's."""
    os.environ["PYDIST_SIM_NET"] = "garbage"
    for kind in ("fully_shard", "FullyShardedDataParallel"):
        with pytest.raises(ValueError, match="simulated network 'garbage'"):
            _wrapped(kind)
    del os.environ["PYDIST_SIM_NET"]

    for kind in ("fully_shard", "FullyShardedDataParallel"):
        reference = _wrapped(kind)
        _train(reference, rank)
        os.environ.update(PYDIST_TRACE=trace_dir, PYDIST_SIM_NET=LINK)
        traced = _wrapped(kind)
        _train(traced, rank)
        del os.environ["PYDIST_TRACE"], os.environ["PYDIST_SIM_NET"]
        for a, b in zip(_shards(reference), _shards(traced), strict=True):
            assert torch.equal(a, b), f"{kind}: parameters under PYDIST_SIM_NET/PYDIST_TRACE differ"
    from pydist.overlap import hooks

    hooks.TraceSession._current.write()  # as at exit; written here so a slow exit cannot race the test


@pytest.mark.timeout(120)
def test_sharded_trace_sim_net_and_report(tmp_path):
    trace_dir = str(tmp_path / "traces")
    run_ranks(_sharded_ranks, 2, args=(trace_dir,), timeout=100)
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4
    for rank in range(2):
        doc = json.loads((tmp_path / "traces" / f"rank{rank}.json").read_text())
        assert doc["otherData"]["rank"] == rank and doc["otherData"]["transport"] == "sim_net(shm)"
        events = doc["traceEvents"]
        steps = [e for e in events if e.get("cat") == "step"]
        # two wrappers (fully_shard's root, then FullyShardedDataParallel's), STEPS steps each
        assert sorted((e["tid"] // 1000, e["args"]["step"]) for e in steps) == [
            (w, s) for w in (0, 1) for s in range(STEPS)]
        for s in steps:
            assert s["args"]["rank"] == rank and s["args"]["transport"] == "sim_net(shm)"
            comm = [e for e in events if e.get("cat") == "comm" and e["tid"] // 1000 == s["tid"] // 1000
                    and e["args"]["step"] == s["args"]["step"]]
            by = {}
            for e in comm:
                a = e["args"]
                by.setdefault((a["collective"], "forward" if "forward" in a["phase"] else "backward"), []).append(a)
                # the simulated link: latency-bound, each collective at least its model's time
                assert a["complete_ms"] - a["launch_ms"] >= 15.0 * 0.999, a
                assert s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, (s, e)
            # every unit gathered in forward and reduced in backward, every step
            for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")):
                assert sum(a["bytes"] for a in by[(kind, phase)]) == LAYERS * unit_bytes, (kind, phase, by)
                units = sorted(u for a in by[(kind, phase)] for u in a["unit"].split("+"))
                assert len(units) == LAYERS, units
            assert sum(e["args"]["exposed_ms"] for e in comm) == pytest.approx(s["args"]["exposed_ms"])
            assert s["args"]["exposed_ms"] >= 5.0  # the link is far slower than the compute: the step waits on it
        assert any(e.get("name") == "thread_name" and e["args"]["name"].startswith("all_gather") for e in events)

    cli = [sys.executable, "-m", "pydist.overlap", "report", str(tmp_path / "traces")]
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run(cli, check=True, env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.count("stalling bucket:") == 4, out  # 2 ranks x 2 wrappers
    assert all(" = all_gather " in line or " = reduce_scatter " in line
               for line in out.splitlines() if "stalling bucket:" in line), out
    report = json.loads(subprocess.run(cli + ["--json"], check=True, env=env, capture_output=True, text=True,
                                       timeout=60).stdout)
    assert len(report["ranks"]) == 4 and all(r["stalling"]["exposed_ms_per_step"] > 0 for r in report["ranks"])
    assert isinstance(report["stragglers"], list)
