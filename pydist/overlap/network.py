"""A simulated cluster link in front of DDP's transport.

    PYDIST_SIM_NET=10Gbps,20us python train.py           # any unchanged script
    DistributedDataParallel(model, sim_net="10Gbps,20us")  # or per wrapper
    t = sim_net(transport, "1Gbps", "50us")                # any pydist transport

Every collective then completes no earlier than an alpha-beta model of a
ring over a link of that bandwidth and latency allows; the data still move
through the transport behind it, so results are bitwise unchanged. See
[Note: simulated network] in csrc/transport/sim_net_transport.cpp for the
model; ``model_seconds`` below is the same formula in Python, the oracle
the tests hold the C++ wrapper to. It governs pydist's own transports (shared
memory, the process group); a comm hook registered on the wrapper does its
own communication, which the simulated link does not slow.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

ENV = "PYDIST_SIM_NET"

__all__ = ["ENV", "Link", "parse_link", "model_seconds", "sim_net", "link_from_env"]

# Decimal units, as network links are quoted (10 Gb/s = 10e9 bits per second).
_BANDWIDTH_UNITS = {"bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}  # divide: 20us is exactly 20 / 1e6


class Link(NamedTuple):
    """A simulated link: bits per second and seconds per hop."""

    bandwidth_bps: float
    latency_s: float

    def __str__(self) -> str:
        return f"{self.bandwidth_bps / 1e9:g}Gbps,{self.latency_s * 1e6:g}us"


def _quantity(text: str, units: dict[str, float], what: str, spec: str) -> float:
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*", text)
    unit = found.group(2).lower().replace("/", "p") if found else ""
    if unit == "gbitps":
        unit = "gbps"
    if not found or unit not in units:
        raise ValueError(
            f"simulated network {spec!r}: cannot read the {what} {text.strip()!r}; write a number with one of the "
            f"units {', '.join(units)} (e.g. '10Gbps,20us')"
        )
    if units is _TIME_UNITS:
        return float(found.group(1)) / _PER_SECOND[unit]
    return float(found.group(1)) * units[unit]


def parse_link(spec: "str | Link") -> Link:
    """'10Gbps,20us' (bandwidth, then latency; latency defaults to 0) -> Link."""
    if isinstance(spec, Link):
        return spec
    parts = spec.split(",")
    if not 1 <= len(parts) <= 2 or not parts[0].strip():
        raise ValueError(f"simulated network {spec!r}: expected 'BANDWIDTH,LATENCY', e.g. '10Gbps,20us'")
    bandwidth = _quantity(parts[0], _BANDWIDTH_UNITS, "bandwidth", spec)
    latency = _quantity(parts[1], _TIME_UNITS, "latency", spec) if len(parts) == 2 else 0.0
    if bandwidth <= 0:
        raise ValueError(f"simulated network {spec!r}: the bandwidth must be > 0")
    return Link(bandwidth, latency)


def model_seconds(collective: str, nbytes: int, world_size: int, link: "str | Link") -> float:
    """The alpha-beta time of one ring collective of ``nbytes`` (the
    full-size tensor) over ``world_size`` ranks: the reference for
    [Note: simulated network]."""
    link = parse_link(link)
    n = world_size
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        steps = 2 * (n - 1)
    elif collective in ("reduce_scatter", "all_gather"):
        steps = n - 1
    else:
        raise ValueError(f"model_seconds: unknown collective {collective!r}; all_reduce, reduce_scatter or all_gather")
    return steps * link.latency_s + steps / n * nbytes * 8 / link.bandwidth_bps


def sim_net(inner, bandwidth: "str | float | Link", latency: "str | float" = 0.0):
    """``inner`` (a pydist transport) behind a simulated link. ``bandwidth``:
    '10Gbps', bits per second, or a Link / '10Gbps,20us' (then ``latency``
    is ignored); ``latency``: '20us' or seconds."""
    from pydist import transport

    if isinstance(bandwidth, Link) or (isinstance(bandwidth, str) and "," in bandwidth):
        link = parse_link(bandwidth)
    else:
        bw = parse_link(bandwidth).bandwidth_bps if isinstance(bandwidth, str) else float(bandwidth)
        lat = _quantity(latency, _TIME_UNITS, "latency", latency) if isinstance(latency, str) else float(latency)
        link = Link(bw, lat)
    return transport.wrap("sim_net", inner, bandwidth=link.bandwidth_bps, latency=link.latency_s)


def link_from_env() -> Link | None:
    """The link PYDIST_SIM_NET names, or None when it is unset or empty."""
    spec = os.environ.get(ENV, "").strip()
    return parse_link(spec) if spec else None
