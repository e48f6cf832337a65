"""Figures a reader of a policy comparison wants, drawn from simulation results."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gogh_flows.sim.engine import SimResult


def plot_comparison(results: Mapping[str, SimResult], path: str | Path) -> Path:
    """Energy against SLA attainment per policy, and the JCT CDF of each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
