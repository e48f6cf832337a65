"""Figures a reader of a policy comparison wants, drawn from simulation results."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gogh_flows.sim.engine import SimResult


def plot_comparison(results: Mapping[str, SimResult], path: str | Path) -> Path:
    """Energy against SLA attainment, JCT CDF, and GPU occupancy by type over time.

    Occupancy is drawn for the first policy given (the reference, usually ``oracle``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, res in results.items():
        s = res.summary()
        ax1.scatter(s["sla_attainment"], s["energy_kwh"], s=40)
        ax1.annotate(name, (s["sla_attainment"], s["energy_kwh"]), textcoords="offset points",
                     xytext=(4, 4), fontsize=8)
        jct = np.sort([r.finished_s - r.arrival_s for r in res.jobs.values() if r.finished_s is not None])
        if len(jct):
            ax2.step(jct / 3600, np.arange(1, len(jct) + 1) / len(jct), where="post", label=name)
    ax1.set_xlabel("SLA attainment (fraction of running time at or above requirement)")
    ax1.set_ylabel("energy (kWh)")
    ax1.set_title("energy vs SLA attainment")
    ax2.set_xscale("log")
    ax2.set_xlabel("job completion time (h)")
    ax2.set_ylabel("fraction of jobs")
    ax2.set_title("JCT CDF")
    ax2.legend(fontsize=8)
    ref_name, ref = next(iter(results.items()))
    times = np.array([t for t, _ in ref.occupancy]) / 3600
    for gpu_type, total in sorted(ref.fleet.items()):
        frac = [counts.get(gpu_type, 0) / total for _, counts in ref.occupancy]
        ax3.step(times, frac, where="post", label=f"{gpu_type} ({total})")
    ax3.set_xlabel("time (h)")
    ax3.set_ylabel("fraction of GPUs busy")
    ax3.set_title(f"GPU occupancy by type ({ref_name})")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
