"""``make demo``: the whole GOGH loop on embedded defaults, in a few minutes on a laptop.

Waves of ``@gogh_placed`` flow runs (zoo models with throughput requirements, one family
the shipped prior never saw) run on an emulated four-generation fleet, on a temporary
Prefect server, with MLflow on SQLite under ./.gogh. Between waves the retraining flow
learns a new refiner from what was measured and promotes it if it is better. The optimiser
chooses each GPU's power limit too (``PlacementPolicy.power_limit_levels``, enacted by the
emulator). Then the same waves are replayed with ``greedy-fastest`` placement at full power
on a fresh copy of the fleet, and the energy, requirement attainment and prediction errors
are compared.

The fleet is a site the shipped prior never saw: its V100s and A100s are PCIe boards
(:data:`DEMO_BOARDS`), which run the zoo 0-10.1% slower than the SXM boards the synthetic prior
learned, so there is something for the retraining to learn, as at any real site.

Energy is counted two ways (as ``gogh simulate`` does): what the runs drew (each run's share
of its board, start-up included: idle GPUs parked), and always on, over one window per wave
common to both policies, where every GPU also draws its idle power while empty. Windows are in
emulated time, with a wave's runs starting together (the emulator counts a run's own time, not
the seconds of orchestration between runs).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Four GPU generations (Kepler, Volta, Turing, Ampere) of the synthetic fleet, two of each.
DEMO_FLEET = {"k80": 2, "v100": 2, "t4": 2, "a100": 2}
#: Families and the batch sizes their runs use; CycleGAN is the family the synthetic prior
#: was trained without (models/synthetic/*/MODEL_CARD.md), so it is new to the predictors.
DEMO_JOBS = (("ResNet-18", 64), ("ResNet-50", 32), ("Transformer", 64), ("LM", 20),
             ("Recommendation", 2048), ("A3C", 20), ("CycleGAN", 1), ("CycleGAN", 1))
UNSEEN_FAMILY = "CycleGAN"
#: The demo's site: its V100s and A100s are the PCIe boards (the catalog maps them to the same
#: types as the SXM boards the synthetic prior was trained on), so the fleet runs 0-10.1% slower
#: than the prior has learned, by job and type, as a real site differs from a shipped prior.
#: Without it the emulated fleet was the prior's own training world and there was nothing for
#: the refiner to learn (its challengers tied the champion and were kept).
DEMO_BOARDS = {"v100": "v100-pcie", "a100": "a100-pcie-40gb"}
TIME_SCALE = 1 / 3600  # one emulated hour of training = one wall second
#: the power limits the demo's optimiser may choose, as fractions of each type's range
DEMO_LIMIT_LEVELS = [0.0, 0.25, 0.5, 0.75]


@dataclass(frozen=True)
class DemoJob:
    name: str
    family: str
    batch_size: int
    min_throughput: float
    work_steps: int
    wave: int


def _setup_env(home: Path, prefect_home: Path) -> None:
    from gogh_flows.localenv import MEMORY_DATABASE, OFFLINE, THROWAWAY_SERVER, set_defaults, sqlite_server

    set_defaults({
        **OFFLINE,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # a first start migrates a fresh database: slow on a busy 2-core machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        # eight concurrent flow runs write to the temporary server (its pool settings apply if the
        # user points it at a database file; in memory, below, Prefect uses one connection)
        **sqlite_server(20),
        # the temporary server is thrown away at the end (localenv.THROWAWAY_SERVER says why)
        **THROWAWAY_SERVER,
        # ... and its records are not kept: in memory, one connection, no minute-long lock stalls
        **MEMORY_DATABASE,
    })
    # Prefect creates its home without parents: a fresh GOGH_HOME would leave the temporary
    # server without a database folder (it then times out starting)
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    os.environ["GOGH_HOME"] = str(home)


def _retraining_line(r: dict) -> str:
    """One retraining's outcome, or why nothing was retrained (a small demo has too few measurements
    for a held-out quarter: it printed "challenger vNone MAPE nan%")."""
    if r.get("challenger_version") is None:
        return f"not retrained: {r.get('reason', 'no challenger was trained')}; kept the champion"
    trust = "in full" if r.get("trust_scale") is None else f"up to P1 error {r['trust_scale']:g}"
    weights = {"the champion's": "the champion's weights, new site offsets"}.get(r.get("weights"),
                                                                               f"corrections {trust}")
    return (f"({r.get('seconds', 0):.0f} s) challenger v{r['challenger_version']} MAPE "
            f"{r['challenger_mape']:.1%} ({weights}) vs champion {r['champion_mape']:.1%}, "
            f"P1 alone {r['p1_mape']:.1%}: " + ("promoted" if r.get("promoted") else "kept the champion"))


def plan_waves(truth: Any, waves: int, wave_size: int, seed: int) -> list[list[DemoJob]]:
    """Seeded jobs: requirement = q x best isolated throughput on the fleet, q ~ U(0.3, 0.8)."""
    from gogh_flows.workloads.zoo import job_type_name

    rng = random.Random(seed)
    out = []
    for w in range(waves):
        wave = []
        for i in range(wave_size):
            family, bs = DEMO_JOBS[(i + w) % len(DEMO_JOBS)]
            jt = job_type_name(family, bs)
            best = max(truth.isolated(jt, g) for g in DEMO_FLEET if truth.has(jt, g, 1))
            rho = round(rng.uniform(0.3, 0.8) * best, 4)
            hours = rng.uniform(0.5, 2.0)
            wave.append(DemoJob(f"{family.lower()}-w{w}-{i}", family, bs, rho, max(1, int(rho * hours * 3600)), w))
        out.append(wave)
    return out


def _run_wave(wave: list[DemoJob], cluster: Any, policy: Any) -> list[dict]:
    from gogh_flows import current_placement, gogh_placed

    def one(job: DemoJob) -> dict:
        @gogh_placed(model=job.family, batch_size=job.batch_size, min_throughput=job.min_throughput,
                     work_steps=job.work_steps, cluster=cluster, policy=policy)
        def train(job_name: str) -> dict:
            p = current_placement()
            chunk = max(1, job.work_steps // 4)  # report progress in four chunks
            done = 0
            while done < job.work_steps:
                step = min(chunk, job.work_steps - done)
                p.advance(step)
                done += step
            return {"job": job_name, "gpu": p.gpu_id, "predicted": p.predicted_throughput}

        return train.with_options(name=f"demo-{job.family.lower()}")(job_name=job.name)

    with ThreadPoolExecutor(max_workers=len(wave)) as ex:
        return list(ex.map(one, wave))


def _measurements(home: Path, tracking_uri: str) -> Any:
    from gogh_flows.tracking.measurements import MeasurementLog

    return MeasurementLog(tracking_uri, home / "measurements").read()


def _mape(pred: Any, true: Any) -> float:
    import numpy as np

    from gogh_flows.predict.p1 import mape

    return mape(np.asarray(pred, float), np.asarray(true, float))


def wave_rows(rows: Any, plan: list[list[DemoJob]]) -> list[Any]:
    """The measurement rows of each wave (waves run one after another, so the table is in wave order)."""
    ordered = rows.sort("logged_at")
    out, start = [], 0
    for wave in plan:
        out.append(ordered.slice(start, len(wave)))
        start += len(wave)
    return out


def busy_s(rows: Any) -> dict[str, float]:
    """GPU id -> its busy time in a wave, in emulated seconds: the longest run on it.

    A wave's runs start together; two runs sharing a board overlap, so the longest one is
    the board's busy time unless the wave queued a run behind another (then it is a lower bound).
    """
    busy: dict[str, float] = {}
    for r in rows.iter_rows(named=True):
        busy[r["gpu_id"]] = max(busy.get(r["gpu_id"], 0.0), float(r["duration_s"] or 0.0))
    return busy


def always_on_kwh(waves: list[Any], windows: list[float]) -> float:
    """The runs' energy plus every GPU's idle draw while empty, over each wave's common window."""
    import polars as pl

    from gogh_flows.catalog import get_gpu_type

    total = 0.0
    for rows, window in zip(waves, windows, strict=True):
        total += float(rows.select(pl.coalesce("run_energy_j", "energy_j")).to_series().sum())
        busy = busy_s(rows)
        for t, n in DEMO_FLEET.items():
            for i in range(n):
                total += get_gpu_type(t).idle_w * max(0.0, window - busy.get(f"{t}-{i}", 0.0))
    return total / 3.6e6


def run_product_demo(seed: int = 0, out: Path | None = None, waves: int = 3, wave_size: int = 8) -> dict:
    if waves < 2 or wave_size < 1:
        raise ValueError("the demo needs at least 2 waves (one retraining between them) and 1 run per wave")
    t0 = time.monotonic()
    home = Path(os.environ.get("GOGH_HOME", ".gogh")).resolve()
    run_home = home / "demo-runs" / f"seed{seed}-{int(time.time())}"
    _setup_env(run_home / "gogh", home / "prefect")
    out = Path(out) if out is not None else home / "demo"
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    say("starting: temporary Prefect server, MLflow on SQLite, emulated fleet "
        + ", ".join(f"{n} x {t}" for t, n in DEMO_FLEET.items())
        + f" ({', '.join(f'{t} as {v}' for t, v in DEMO_BOARDS.items())}: boards the shipped prior never saw)")
    import polars as pl
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from gogh_flows.flows.blocks import GpuCluster, PlacementPolicy, PredictorRegistry
    from gogh_flows.flows.observations import observations_from_measurements
    from gogh_flows.flows.predictors import predictor_source
    from gogh_flows.flows.session import close_all
    from gogh_flows.flows.retrain import refine_predictors
    from gogh_flows.predict.service import ThroughputPredictor
    from gogh_flows.truth.synthetic import synthetic_table

    truth = synthetic_table(list(DEMO_FLEET), seed=seed, boards=DEMO_BOARDS)
    plan = plan_waves(truth, waves, wave_size, seed)
    cluster = GpuCluster(fleet=DEMO_FLEET, time_scale=TIME_SCALE, seed=seed, boards=DEMO_BOARDS)
    registry = PredictorRegistry(tracking_uri=f"sqlite:///{run_home / 'gogh' / 'mlflow.db'}")
    gogh = PlacementPolicy(policy="optimizer", poll_s=0.5, power_limit_levels=DEMO_LIMIT_LEVELS)
    greedy = PlacementPolicy(policy="greedy-fastest", poll_s=0.5, refine=False)
    retrains = []
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        # start the temporary Prefect server once, before runs start concurrently
        from prefect import flow

        flow(name="gogh-demo-start")(lambda: None)()
        say("Prefect server up")
        for w, wave in enumerate(plan):
            per_family = Counter(j.family for j in wave)
            say(f"wave {w + 1}/{waves} (gogh): {len(wave)} flow runs: "
                + ", ".join(f + (f" x{n}" if n > 1 else "") for f, n in sorted(per_family.items())))
            results = _run_wave(wave, cluster, gogh)
            say("  placed on " + ", ".join(sorted(r["gpu"] for r in results)))
            if w < waves - 1:
                say("retraining the refiner from the measurements so far (refine_predictors flow)")
                r = refine_predictors(registry=None, min_measurements=4, holdout_fraction=0.25, epochs=150,
                                      seed=seed)
                retrains.append(r)
                say("  " + _retraining_line(r))
        gogh_rows = _measurements(run_home / "gogh", registry.resolved_tracking_uri())
        source = predictor_source(registry)
        final = source.get(force=True, bounded=False)
        versions = source.versions()
        close_all()
        say("replaying the same waves with greedy-fastest placement on a fresh copy of the fleet")
        os.environ["GOGH_HOME"] = str(run_home / "greedy")
        for w, wave in enumerate(plan):
            _run_wave(wave, cluster, greedy)
        greedy_rows = _measurements(run_home / "greedy", registry.resolved_tracking_uri())
        close_all()

    # prediction error: P1 alone vs the refined predictions the final champion makes for the
    # last wave, from the measurements of the earlier waves only
    obs = observations_from_measurements(gogh_rows)
    last_start = gogh_rows.filter(pl.col("run_id").is_in(
        gogh_rows.sort("started_at").tail(len(plan[-1]))["run_id"]))["started_at"].min()
    is_last = observations_from_measurements(gogh_rows.filter(pl.col("started_at") >= last_start))
    earlier = observations_from_measurements(gogh_rows.filter(pl.col("started_at") < last_start))
    from gogh_flows.predict.data import zoo_jobs

    feats = zoo_jobs(set(obs["job_type"]) | set(obs["partner"].drop_nulls()))
    p1_err = ThroughputPredictor(final.p1, None).refine_error(feats, earlier.head(0), is_last)
    p2_err = final.refine_error(feats, earlier, is_last)
    extras = [json.loads(x or "{}") for x in gogh_rows["extra"].to_list()]
    as_predicted, moved, trials = _as_predicted(extras)
    gogh_rows = gogh_rows.with_columns(pl.Series("_as_predicted", as_predicted, dtype=pl.Boolean))
    per_wave, left_out = [], 0
    for w in range(waves):
        rows = gogh_rows.slice(sum(len(x) for x in plan[:w]), len(plan[w]))
        left_out += int((~rows["_as_predicted"]).sum())
        rows = rows.filter(pl.col("_as_predicted"))
        per_wave.append(_mape(rows["predicted_throughput"], rows["throughput"]) if rows.height else float("nan"))

    def energy_kwh(rows: Any) -> float:  # each run's share of its GPU's energy, start-up included
        return float(rows.select(pl.coalesce("run_energy_j", "energy_j")).to_series().sum()) / 3.6e6

    def attainment(rows: Any) -> float:
        return float((rows["throughput"] >= rows["required_throughput"] * 0.999).mean())

    unseen = gogh_rows.filter(pl.col("family") == UNSEEN_FAMILY)
    unseen_seen = unseen.filter(pl.col("_as_predicted"))
    g_waves, f_waves = wave_rows(gogh_rows, plan), wave_rows(greedy_rows, plan)
    windows = [max([*busy_s(a).values(), *busy_s(b).values(), 0.0]) for a, b in zip(g_waves, f_waves)]
    # a run whose board the guard lifted ended at full power but started at its placement's limit
    limits = [float(e.get("power_limit_w") or e.get("limit_lifted_from_w") or 0) for e in extras]
    summary = {
        "runs": gogh_rows.height,
        "energy_kwh_gogh": round(energy_kwh(gogh_rows), 4),
        "energy_kwh_greedy_fastest": round(energy_kwh(greedy_rows), 4),
        "energy_kwh_always_on_gogh": round(always_on_kwh(g_waves, windows), 4),
        "energy_kwh_always_on_greedy_fastest": round(always_on_kwh(f_waves, windows), 4),
        "window_emulated_h": round(sum(windows) / 3600, 3),
        "runs_at_a_lower_power_limit": sum(1 for v in limits if v > 0),
        "runs_at_a_trial_limit": trials,
        "sla_attainment": round(attainment(gogh_rows), 4),
        "sla_attainment_greedy_fastest": round(attainment(greedy_rows), 4),
        "p1_mape": round(p1_err["mape"], 4),
        "p2_mape_after_retrain": round(p2_err["mape"], 4),
        "placement_mape_per_wave": [round(x, 4) if x == x else None for x in per_wave],  # None: none comparable
        "placement_mape_left_out": left_out,
        "placement_error_trend": _trend_verdict(per_wave),
        "unseen_family": UNSEEN_FAMILY,
        "unseen_family_runs": unseen.height,
        "unseen_family_placement_mape": round(_mape(unseen_seen["predicted_throughput"], unseen_seen["throughput"]), 4)
        if unseen_seen.height else None,
        "champion_version": versions["p2"],
        "p1_version": versions["p1"],
        "boards": DEMO_BOARDS,
        # what the champion learned of the boards (a job with nothing measured), beside what they
        # are: the site's truth over the prior's world, mean over the demo's job types
        "site_offsets_learned": {g: round(math.expm1(v), 4) for g, v in sorted(final.site.unmeasured.items())},
        "site_truth": _site_truth(plan, seed),
        "retrains": [{k: r.get(k) for k in ("challenger_version", "challenger_mape", "champion_mape", "p1_mape",
                                            "trust_scale", "weights", "promoted")}
                     for r in retrains],
        "measurements_compared": p2_err["n"],
        "fleet": DEMO_FLEET,
        "waves": waves, "wave_size": wave_size, "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "state": str(run_home),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(summary, gogh_rows, greedy_rows, out / "summary.png")
    saving = 1 - summary["energy_kwh_gogh"] / summary["energy_kwh_greedy_fastest"]
    print()
    print(f"runs: {summary['runs']} per policy, {waves} waves of {wave_size} on {sum(DEMO_FLEET.values())} "
          f"emulated GPUs ({', '.join(DEMO_FLEET)})")
    on_saving = 1 - summary["energy_kwh_always_on_gogh"] / summary["energy_kwh_always_on_greedy_fastest"]
    print(f"energy the runs drew (idle GPUs parked):  gogh {summary['energy_kwh_gogh']:.3f} kWh   greedy-fastest "
          f"{summary['energy_kwh_greedy_fastest']:.3f} kWh   ({saving:+.1%} saved by gogh)")
    print(f"energy with every GPU always on, over the same {summary['window_emulated_h']:.2f} emulated hours:  "
          f"gogh {summary['energy_kwh_always_on_gogh']:.3f} kWh   greedy-fastest "
          f"{summary['energy_kwh_always_on_greedy_fastest']:.3f} kWh   ({on_saving:+.1%} saved by gogh)")
    print(f"power limits: gogh lowered the limit of {summary['runs_at_a_lower_power_limit']} of "
          f"{summary['runs']} runs' boards ({trials} of them trying one level below the best its type "
          "measured); greedy-fastest runs at full power")
    print(f"requirement met:  gogh {summary['sla_attainment']:.0%} of runs   greedy-fastest "
          f"{summary['sla_attainment_greedy_fastest']:.0%}")
    verdict = _refiner_verdict(summary["p1_mape"], summary["p2_mape_after_retrain"])
    print(f"prediction error on the last wave (each run predicted from the earlier waves, without its own "
          f"entry's earlier measurements):  P1 alone {summary['p1_mape']:.1%}   P1+P2 (champion "
          f"v{versions['p2']}) {summary['p2_mape_after_retrain']:.1%}  ({p2_err['n']} measurements; {verdict})")
    print("placement-time prediction error per wave, each run predicted before it ran: "
          + "  ".join(f"w{i + 1} {x:.1%}" for i, x in enumerate(per_wave))
          + f"  ({summary['placement_error_trend']} from the first wave to the last)"
          + (f"  ({left_out} run{'s' if left_out != 1 else ''} left out: " + "; ".join(
              ([f"{moved} ran in other company than predicted (a partner joined or left after placement)"]
               if moved else [])
              + ([f"{trials} at a trial limit, one level below the best its type measured, predicted at the "
                  "rate measured above it"] if trials else [])) + ")"
             if left_out else ""))
    learned = summary["site_offsets_learned"]
    print("what the champion learned of this site's boards (a job with nothing measured): "
          + ("  ".join(f"{g} {learned[g] if abs(learned[g]) >= 5e-4 else 0.0:+.1%}" for g in learned)
             if learned else "nothing (it has no site offsets)")
          + "; what they are (the zoo here against the prior's world, mean over the demo's jobs): "
          + "  ".join(f"{g} {v:+.1%}" for g, v in summary["site_truth"].items()))
    print(f"registry: P1 v{versions['p1']}, P2 champion v{versions['p2']} "
          f"(retrainings: {', '.join('promoted' if r.get('promoted') else 'kept' for r in retrains)})")
    print(f"saved {out / 'summary.json'} and {out / 'summary.png'} in {summary['seconds']:.0f} s")
    return summary


def _site_truth(plan: list[list[DemoJob]], seed: int) -> dict[str, float]:
    """How much faster (+) or slower (-) each type runs the demo's job types at this site than in
    the world the prior learned (geometric mean over the job types; 0 where nothing differs)."""
    from gogh_flows.truth.synthetic import synthetic_table
    from gogh_flows.workloads.zoo import job_type_name

    site = synthetic_table(list(DEMO_FLEET), seed=seed, boards=DEMO_BOARDS)
    world = synthetic_table(list(DEMO_FLEET), seed=seed)
    jobs = sorted({job_type_name(j.family, j.batch_size) for wave in plan for j in wave})
    out = {}
    for g in sorted(DEMO_FLEET):
        logs = [math.log(site.isolated(j, g) / world.isolated(j, g)) for j in jobs if world.isolated(j, g) > 0]
        out[g] = round(math.expm1(sum(logs) / len(logs)), 4) if logs else 0.0
    return out


def _compared(before: float, after: float) -> int:
    """-1 lower, 1 higher, 0 the same: within 10% of each other two errors on a handful of runs
    are the same (a difference of a few hundredths of a point is not a win)."""
    if after < 0.9 * before:
        return -1
    if after > 1.1 * before:
        return 1
    return 0


def _as_predicted(extras: list[dict]) -> tuple[list[bool], int, int]:
    """Which runs' placement-time prediction can be scored; how many ran in other company, and how
    many at a trial limit (a run can be both).

    Only runs that ran in the company they were predicted for (a partner that came after the
    decision changes what the run measures, not what the predictor knew), and not at a trial limit
    (its figure was the rate measured a level above: a hope the run checks, not a prediction).
    """
    from gogh_flows.tracking.measurements import LIMIT_TRIAL, PARTNERS_CHANGED

    return ([PARTNERS_CHANGED not in e and LIMIT_TRIAL not in e for e in extras],
            sum(PARTNERS_CHANGED in e for e in extras), sum(LIMIT_TRIAL in e for e in extras))


def _trend_verdict(per_wave: list[float]) -> str:
    """Whether the placement-time error fell from the first wave to the last."""
    known = [x for x in per_wave if x == x]
    if len(known) < 2:
        return "too few waves to say"
    return {-1: "fell", 1: "rose", 0: "no clear change"}[_compared(known[0], known[-1])]


def _refiner_verdict(p1: float, p2: float) -> str:
    """What the two errors say (P1 alone against P1 with the refiner)."""
    return {-1: "the refiner helped", 1: "the refiner made it worse here",
            0: "no clear difference: P1 alone was already close"}[_compared(p1, p2)]


def _plot(summary: dict, gogh_rows: Any, greedy_rows: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    ax = axes[0]
    labels = ["gogh\n(drawn)", "greedy\n(drawn)", "gogh\n(always on)", "greedy\n(always on)"]
    values = [summary["energy_kwh_gogh"], summary["energy_kwh_greedy_fastest"],
              summary["energy_kwh_always_on_gogh"], summary["energy_kwh_always_on_greedy_fastest"]]
    bars = ax.bar(labels, values, color=["#2a7", "#c63", "#2a7", "#c63"])
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_ylabel("energy (kWh)")
    ax.set_title("Energy, same waves", fontsize=10)
    ax.text(0.0, -0.3, "drawn: what the runs drew (idle GPUs parked);\nalways on: plus idle GPUs, one window per wave",
            transform=ax.transAxes, fontsize=7, va="top")
    ax = axes[1]
    bars = ax.bar(["gogh", "greedy-fastest"], [summary["sla_attainment"], summary["sla_attainment_greedy_fastest"]],
                  color=["#2a7", "#c63"])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("share of runs at or above requirement")
    ax.set_title("Requirement attainment", fontsize=10)
    ax.text(0.0, -0.2, "measured throughput >= the run's min_throughput", transform=ax.transAxes, fontsize=7,
            va="top")
    ax = axes[2]
    waves = range(1, len(summary["placement_mape_per_wave"]) + 1)
    ax.plot(list(waves), [100 * x if x is not None else math.nan for x in summary["placement_mape_per_wave"]], "o-", label="placement-time")
    ax.axhline(100 * summary["p1_mape"], color="#999", ls="--", label="P1 alone (last wave)")
    ax.axhline(100 * summary["p2_mape_after_retrain"], color="#2a7", ls=":", label="P1+P2 champion (last wave)")
    ax.set_xticks(list(waves))
    ax.set_xlabel("wave")
    ax.set_ylabel("throughput prediction error (%)")
    ax.set_title("Throughput prediction error", fontsize=10)
    ax.legend(fontsize=7)
    ax.text(0.0, -0.2, "per wave: predicted at placement vs measured (runs whose partners changed after\n"
            "placement left out); lines: the last wave, each run\n"
            "without its own entry's earlier runs, by P1 alone and by the champion refiner (lower is better)",
            transform=ax.transAxes, fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["DEMO_BOARDS", "DemoJob", "plan_waves", "run_product_demo"]
