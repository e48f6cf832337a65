"""Figures a reader of a policy comparison wants, drawn from simulation results."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimResult


def energy_points(results: Mapping[str, SimResult]) -> dict[str, tuple[float, float, float]]:
    """Per policy: (SLA attainment, always-on kWh, parked kWh), both energies over the common window."""
    accounts = energy_accounts(results)
    return {name: (res.summary()["sla_attainment"], accounts[name].always_on_kwh, accounts[name].parked_kwh)
            for name, res in results.items()}


def plot_comparison(results: Mapping[str, SimResult], path: str | Path, seed: int | None = None) -> Path:
    """Energy against SLA attainment, JCT CDF, and GPU occupancy by type over time.

    Energy is the common window's (:mod:`gogh_flows.sim.account`), always on and parked, as
    the table ranks policies: each run's own energy charges a policy that finishes later more
    idle draw, and can rank the policies the other way round. Occupancy is drawn for the first
    policy given (the reference, usually ``oracle``). ``seed``: the run's, named in the title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = energy_points(results)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    for k, (name, res) in enumerate(results.items()):
        sla, on, parked = points[name]
        color = f"C{k % 10}"
        ax1.scatter(sla, on, s=40, color=color, label="always on" if k == 0 else None)
        ax1.scatter(sla, parked, s=40, facecolors="none", edgecolors=color,
                    label="idle GPUs parked" if k == 0 else None)
        ax1.annotate(name, (sla, on), textcoords="offset points", xytext=(4, 4), fontsize=8)
        jct = np.sort([r.finished_s - r.arrival_s for r in res.jobs.values() if r.finished_s is not None])
        if len(jct):
            ax2.step(jct / 3600, np.arange(1, len(jct) + 1) / len(jct), where="post", label=name)
    ax1.set_xlabel("SLA attainment (fraction of running time at or above requirement)")
    window_h = max((r.end_s for r in results.values()), default=0.0) / 3600
    ax1.set_ylabel(f"energy over one window for all, 0-{window_h:.1f} h (kWh)")
    ax1.set_title("energy vs SLA attainment" + (f" (seed {seed})" if seed is not None else ""))
    ax1.legend(fontsize=8)
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
