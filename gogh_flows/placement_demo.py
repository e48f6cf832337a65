"""The placement demo: one wave of zoo jobs on a small mixed synthetic fleet.

It shows what the optimiser decides and why (the explanation table), and what
the same wave costs under every baseline, all scored with one energy model.
Everything is embedded: the synthetic fleet needs no files and no servers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import polars as pl

from gogh_flows.energy import kwh
from gogh_flows.placement import (
    BASELINES,
    Gpu,
    Job,
    PlacementProblem,
    get_policy,
    placement_energy,
    violations,
)
from gogh_flows.truth.synthetic import synthetic_table
from gogh_flows.workloads import DEFAULT_BATCH_SIZES, FAMILIES, job_type_name

DEMO_FLEET = (("k80", 3), ("p100", 3), ("v100", 3), ("t4", 3), ("a100", 3), ("h100", 3))


@dataclass(frozen=True)
class DemoResult:
    explanation: pl.DataFrame
    comparison: pl.DataFrame


def demo_problem(seed: int = 0, wave: int = 16) -> PlacementProblem:
    rng = random.Random(seed)
    types = [t for t, _ in DEMO_FLEET]
    table = synthetic_table(types, seed=seed)
    gpus = [Gpu(f"{t}-{i}", t) for t, n in DEMO_FLEET for i in range(n)]
    jobs = []
    # Two jobs already run on the fleet, each meeting its requirement alone.
    for jid, fam, bs, gid in (("running-lm", "LM", 20, "v100-0"), ("running-r50", "ResNet-50", 64, "a100-0")):
        jt = job_type_name(fam, bs)
        gtype = gid.split("-")[0]
        rho = 0.5 * table.isolated(jt, gtype)
        jobs.append(Job(jid, jt, rho, rho * 3600 * 2, 1, (gid,)))
    for i in range(wave):
        fam = FAMILIES[i % len(FAMILIES)]
        bs = rng.choice(DEFAULT_BATCH_SIZES[fam])
        jt = job_type_name(fam, bs)
        # A requirement the way users state one: a fraction of what a V100 gives.
        rho = rng.uniform(0.3, 0.9) * table.isolated(jt, "v100")
        hours = rng.uniform(0.5, 4.0)
        jobs.append(Job(f"{fam.lower()}-{i}", jt, rho, rho * 3600 * hours))
    return PlacementProblem.build(gpus, jobs, table)


def run_demo(seed: int = 0) -> DemoResult:
    problem = demo_problem(seed)
    rows = []
    explanation = None
    reference: frozenset[str] = frozenset()
    for name in ("optimizer", *BASELINES):
        policy = get_policy(name, seed=seed) if name == "random" else get_policy(name)
        placement = policy.place(problem)
        broken = violations(problem, placement)
        if broken:  # every policy must respect the rules; a demo must not hide it
            raise AssertionError(f"{name} broke placement rules: {broken}")
        if name == "optimizer":
            explanation = placement.to_frame()
            reference = placement.placed_ids
        rows.append({
            "policy": name, "placed": len(placement.assignments), "waiting": len(placement.waiting),
            "energy_kwh": kwh(placement_energy(problem, placement)),
            "decision_ms": placement.solve_ms, "status": placement.status,
            # Energies compare like for like only when the same jobs were placed.
            "same_jobs": placement.placed_ids == reference,
        })
    comparison = pl.DataFrame(rows)
    ref = comparison.filter(pl.col("policy") == "optimizer")["energy_kwh"][0]
    # a signed percentage in words, rounded so that equal energies read +0.0%, never -0.0%
    comparison = comparison.with_columns(
        pl.Series("energy vs optimizer", [f"{round(100 * (e / ref - 1), 1) + 0.0:+.1f}%"
                                          for e in comparison["energy_kwh"]])
    )
    assert explanation is not None
    return DemoResult(explanation, comparison)
