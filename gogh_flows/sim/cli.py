"""``gogh simulate``: every named policy on one identical job stream.

Kept apart from ``gogh_flows/cli.py`` so the main command stays a thin router.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gogh_flows.sim.engine import SimConfig, attainment_text
from gogh_flows.sim.run import (
    ALL_POLICIES,
    CAP_POLICIES,
    DEFAULT_LIMIT_LEVELS,
    LEARNED_POLICIES,
    LIMITS_SUFFIX,
    SIM_POLICIES,
    WAIT_S,
    WAIT_SAVING,
    WAIT_SUFFIX,
    base_policy,
    best_isolated,
    parse_cluster,
    prepare_jobs,
    reference_throughput,
    run_policies,
)
from gogh_flows.sim.traces import (
    generate_arrivals,
    load_philly_distribution,
    read_trace,
)
from gogh_flows.truth import TRUTH_HELP, load_truth
from gogh_flows.datapaths import where_looked
from gogh_flows.truth.gavel import gavel_dir
from gogh_flows.truth.table import ThroughputTable


#: arrivals per hour of ``--trace generate:N`` when ``--rate`` is not given
DEFAULT_RATE = 6.0
#: P1's and P2's epochs when --holdout-family trains them here
HOLDOUT_EPOCHS = (100, 300)
#: ``--holdout-family each``: every job keeps its type, planned by predictors trained without its family
EACH = "each"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="compare placement policies on a trace")
    p.add_argument("--truth", default="synthetic", help=TRUTH_HELP)
    p.add_argument("--trace", required=True, help="a .trace file, or generate:N for N Poisson arrivals (their durations and GPU counts are drawn from Gavel's traces/philly_job_distribution.csv, so this needs Gavel's data too)")
    p.add_argument("--cluster", required=True, help="e.g. v100=8,p100=16,k80=24")
    p.add_argument("--policy", default=",".join(SIM_POLICIES),
                   help=f"comma-separated policy names, from: {', '.join(ALL_POLICIES)} "
                        "(the learned gogh, gogh-p1 need --predictors or --holdout-family)")
    p.add_argument("--predictors", help="directory holding p1/ and p2/ model directories, as written "
                                        "by `gogh predictors train --out DIR` (for gogh, gogh-p1)")
    p.add_argument("--holdout-family",
                   help="train P1/P2 in this command without this model family, and draw every "
                        "job from it (generate:N: its job types; a trace file: each job re-labelled "
                        "to one of its types, same duration on the reference GPU type); 'each': keep "
                        "the jobs' own types and plan each with P1/P2 trained without its family (one "
                        "training per family of the jobs)")
    p.add_argument("--p1-epochs", type=int, default=None,
                   help=f"P1 epochs with --holdout-family (default {HOLDOUT_EPOCHS[0]})")
    p.add_argument("--p2-epochs", type=int, default=None,
                   help=f"P2 epochs with --holdout-family (default {HOLDOUT_EPOCHS[1]})")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the requirements, arrivals, noise and any training in the command (default 0)")
    p.add_argument("--seeds", help="comma-separated seeds (e.g. 0,1,2): one run per seed, then each "
                   "policy's spread over them (predictors trained in the command are trained once, with the "
                   "first seed, and serve every seed); overrides --seed")
    p.add_argument("--rate", type=float, default=None,
                   help=f"arrivals per hour for generate:N (default {DEFAULT_RATE:g}); a trace file has its own")
    p.add_argument("--noise", type=float, default=0.0, help="log-normal sigma on true throughputs (default 0)")
    p.add_argument("--capacity", type=int, default=2, help="jobs per GPU: 1 exclusive, 2 pairs may share (default 2)")
    p.add_argument("--rltune-model", default=None,
                   help="the rltune peer's trained agent (a directory written by `gogh rltune train --out`; "
                        "default: the shipped models/rltune)")
    p.add_argument("--risk-level", type=float, default=None,
                   help="gogh plans unmeasured entries at the lower end of the refiner's calibrated "
                        "interval at this level (0.5-0.95; default: point predictions; gogh-p1 always plans "
                        "with P1's point predictions)")
    p.add_argument("--wait-hours", type=float, default=None,
                   help="how long the +wait policies let a new job wait for a busy GPU type that runs it "
                        f"for less energy (default {WAIT_S / 3600:g}; docs/optimizer.md has the trade against completion time)")
    p.add_argument("--wait-saving", type=float, default=None,
                   help="the share of energy that GPU type must save for a +wait policy to hold a job "
                        f"(default {WAIT_SAVING:g})")
    p.add_argument("--wait-within-reach", action="store_true",
                   help="the +wait policies hold a job only for a GPU type predicted to free a GPU for it "
                        "before its wait runs out (docs/optimizer.md: shorter completion times, a little more energy)")
    p.add_argument("--requirement-q", default="0.2,0.9",
                   help="LOW,HIGH: requirement = q * best isolated throughput, q ~ U(LOW, HIGH) (default 0.2,0.9)")
    p.add_argument("--no-rebalance", action="store_true",
                   help="never move a running job to a freed, clearly better GPU")
    p.add_argument("--rebalance-gain", type=float, default=None,
                   help=f"a move must cut the job's predicted remaining time (or energy) by this fraction "
                        f"(default {SimConfig.rebalance_gain:g})")
    p.add_argument("--migration-s", type=float, default=SimConfig.migration_s,
                   help=f"seconds without progress after a running job moves (default {SimConfig.migration_s:g})")
    p.add_argument("--floor", action="store_true",
                   help="add the least energy any schedule could spend on these jobs (a linear relaxation with "
                        "the fleet's capacity and hindsight; with the limit levels when a +limits policy runs): "
                        "how much there was to save, beside what each policy saved")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--plot", help="write a PNG: energy vs SLA attainment, and JCT CDF")
    p.set_defaults(func=cmd_simulate)


def _jobs(args: argparse.Namespace, truth: ThroughputTable, gpus: list):
    ref = "v100" if "v100" in truth.gpu_types else sorted({g.gpu_type for g in gpus})[0]
    family = None
    if args.holdout_family and args.holdout_family != EACH:
        from gogh_flows.sim.holdout import family_types

        family = family_types(truth, args.holdout_family)
    if args.trace.startswith("generate:"):
        try:
            n = int(args.trace.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--trace generate:N needs an integer N, got {args.trace!r}") from None
        if n < 1:
            raise ValueError(f"--trace generate:N needs N >= 1 jobs, got {n}")
        dist = load_philly_distribution(gavel_dir() / "traces" / "philly_job_distribution.csv")
        best = best_isolated(truth, gpus)
        runnable = [j for j in (family or truth.job_types) if best(j, 1) > 0]
        rate = reference_throughput(truth, ref)
        counts = sorted({int(g) for g in dist["num_gpus"] if g <= 8})
        served = [g for g in counts if any(rate(j, g) > 0 for j in runnable)]
        if served != counts:  # as a trace's jobs at those counts are dropped, draw none there
            print(f"note: no job type {'of family ' + repr(args.holdout_family) + ' ' if family else ''}runs at "
                  f"{', '.join(str(g) for g in counts if g not in served)} GPU(s) here; generate:N draws only jobs "
                  f"of {', '.join(str(g) for g in served) or 'no'} GPU(s) from Philly's distribution",
                  file=sys.stderr)
            dist = dist.filter(dist["num_gpus"].is_in(served))
        jobs = generate_arrivals(n, rate_per_hour=DEFAULT_RATE if args.rate is None else args.rate,
                                 job_types=runnable, distribution=dist, seed=args.seed, throughput_of=rate)
    else:
        jobs = read_trace(args.trace, max_gpus=8)
        if family is not None:
            from gogh_flows.sim.holdout import relabel_to_family

            n = len(jobs)
            jobs = relabel_to_family(jobs, family, reference_throughput(truth, ref), seed=args.seed)
            if len(jobs) < n:
                print(f"note: dropped {n - len(jobs)} of {n} trace jobs that no job type of family "
                      f"{args.holdout_family!r} can run at their GPU count", file=sys.stderr)
    if not jobs:
        raise ValueError(f"the trace {args.trace!r} has no jobs to simulate (an empty file, or every job "
                         "was dropped); give a trace with at least one job, or --trace generate:N")
    unknown = sorted({j.job_type for j in jobs if not truth.knows(j.job_type)})
    if unknown:
        known = sorted(truth.job_types)
        raise ValueError(f"trace job types missing from the truth table ({truth.source}): {unknown}; it knows "
                         f"{len(known)} job types, e.g. {known[:3]}: give a --truth that measures them (a "
                         "Gavel-format JSON, or 'synthetic' for the zoo's models on the catalog's GPUs), or drop "
                         "their jobs from the trace")
    try:
        q_low, q_high = (float(x) for x in args.requirement_q.split(","))
    except ValueError:
        raise ValueError(f"--requirement-q must be LOW,HIGH, got {args.requirement_q!r}") from None
    with _notes():
        return prepare_jobs(jobs, truth, gpus, seed=args.seed, q_low=q_low, q_high=q_high)


@contextmanager
def _notes() -> Iterator[None]:
    """Warnings raised inside, printed as notes for people (not Python warnings) when it ends
    (by a return too; not when it ends by an error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)


def _predictors(args: argparse.Namespace, truth: ThroughputTable, names: list[str], jobs: list):
    """Predictors for the learned policies: loaded, trained in-command, or none needed (``jobs``: every
    seed's; ``--holdout-family each`` trains for their families)."""
    if not any(base_policy(n) in LEARNED_POLICIES for n in names):
        return None
    if args.predictors:
        from gogh_flows.sim.holdout import load_predictors

        predictors = load_predictors(args.predictors, truth)
        _note_other_truth(args, predictors)
        if args.risk_level is not None:
            from gogh_flows.predict.service import ThroughputPredictor

            if ThroughputPredictor(predictors.p1, predictors.p2).intervals is None:
                raise ValueError(f"--risk-level {args.risk_level:g} plans with the refiner's calibrated intervals and "
                                 f"the predictors in {args.predictors} have none: add them with `gogh predictors "
                                 f"calibrate --model {args.predictors}`, or drop --risk-level")
        return predictors
    if args.holdout_family:
        from gogh_flows.sim.holdout import CalibrationError, train_each_unseen, train_holdout

        p1_epochs, p2_epochs = (HOLDOUT_EPOCHS[0] if args.p1_epochs is None else args.p1_epochs,
                                HOLDOUT_EPOCHS[1] if args.p2_epochs is None else args.p2_epochs)
        if args.holdout_family == EACH:
            from gogh_flows.predict.data import MeasuredSet

            family_of = MeasuredSet.from_table(truth).family
            families = sorted({family_of[j.job_type] for j in jobs})
            print(f"training P1 ({p1_epochs} epochs) and P2 ({p2_epochs} epochs) once for each family of the jobs "
                  f"({', '.join(families)}), without it, and choosing each one's ensemble weights and intervals on "
                  "the families it was trained on ...", file=sys.stderr, flush=True)
            train = functools.partial(train_each_unseen, truth, families)
        else:
            print(f"training P1 ({p1_epochs} epochs) and P2 ({p2_epochs} epochs) without "
                  f"family {args.holdout_family!r}, and choosing the ensemble's weights and intervals on the "
                  "families left ...", file=sys.stderr, flush=True)
            train = functools.partial(train_holdout, truth, args.holdout_family)
        # what `gogh predictors train` ships: the ensemble and its intervals, chosen on the inner split
        with _notes():
            try:
                return train(p1_epochs=p1_epochs, p2_epochs=p2_epochs, seed=args.seed, intervals=True,
                             strict=args.risk_level is not None)
            except CalibrationError as exc:
                raise ValueError(f"--risk-level {args.risk_level:g}: {exc} (drop --risk-level)") from None
    raise ValueError(f"policies {[n for n in names if base_policy(n) in LEARNED_POLICIES]} need predictors: pass "
                     "--predictors DIR (from `gogh predictors train --out DIR`) or --holdout-family F")


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds is None:
        return [args.seed]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers such as 0,1,2, got {args.seeds!r}") from None
    if not seeds:
        raise ValueError("--seeds names no seed; e.g. --seeds 0,1,2")
    negative = [s for s in seeds if s < 0]
    if negative:
        raise ValueError(f"--seeds must be integers >= 0, got {', '.join(map(str, negative))}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:  # the same run twice would count twice in the spread and look like agreement
        raise ValueError(f"--seeds names {', '.join(map(str, twice))} more than once; a seed's run is the same "
                         "every time, so name each seed once (e.g. --seeds 0,1,2)")
    return seeds


def _seeded(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seed": seed})


def _run_one(args: argparse.Namespace, truth: ThroughputTable, gpus: list, names: list[str], seed: int,
             jobs: list, predictors, patience=None):
    from gogh_flows.sim.account import busy_gpu_hours, energy_accounts

    config = SimConfig(seed=seed, noise=args.noise, rebalance=not args.no_rebalance,
                       rebalance_gain=args.rebalance_gain, migration_s=args.migration_s)
    from gogh_flows.progress import Progress

    with Progress() as bars:
        results = run_policies(jobs, gpus, truth, names, config=config, progress=bars.update, predictors=predictors,
                               risk_level=args.risk_level, rltune_model=args.rltune_model, patience=patience)
    accounts = energy_accounts(results)
    policies = {name: {**r.summary(), **accounts[name].as_row(), "busy_gpu_h": busy_gpu_hours(r)}
                for name, r in results.items()}
    if args.floor:
        from collections import Counter

        from gogh_flows.sim.bound import floor_rows
        from gogh_flows.sim.engine import TrueRates

        policies.update(floor_rows(jobs, Counter(g.gpu_type for g in gpus), TrueRates(truth, args.noise, seed),
                                   results, levels=_floor_levels(names)))
    return results, policies


#: What the spread table shows per policy, over the seeds.
SPREAD = ("on_vs_greedy-fastest", "on_vs_oracle", "parked_vs_greedy-fastest", "parked_vs_oracle",
          "sla_attainment", "avg_jct_s", "makespan_s", "jobs_unfinished")
#: marks a policy of the spread tables that left more jobs unfinished than another on some seed
FEWER_DONE = " (*)"


def fewer_done(per_seed: dict[int, dict[str, dict]]) -> set[str]:
    """Policies that left more jobs unfinished than another policy of the same seed: their mean
    figures count less work (a review read a learned policy's mean below the floor, its one
    never-placed job said only in a note per seed)."""
    out = set()
    for figures in per_seed.values():
        counts = _unfinished(figures)
        if counts:
            out |= {name for name, n in counts.items() if n > min(counts.values())}
    return out


def _unfinished(figures: dict[str, dict]) -> dict[str, int]:
    """Per policy of one seed, how many jobs it left unfinished."""
    return {name: int(row.get("jobs_unfinished") or 0) for name, row in figures.items() if "jobs_unfinished" in row}


def _spread(per_seed: dict[int, dict[str, dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """policy -> figure -> {mean, min, max} over the seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for figures in per_seed.values():
        for policy, row in figures.items():
            for key in SPREAD:
                if key in row and row[key] is not None and not math.isnan(row[key]):
                    out.setdefault(policy, {}).setdefault(key, []).append(float(row[key]))  # type: ignore[arg-type]
    return {p: {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for k, v in figs.items()}
            for p, figs in out.items()}


#: The printed table's columns (the JSON has every figure).
#: the printed tables, one subject each: one table of all of them was ~250 columns wide and wrapped
#: on a terminal (a new-user review); the JSON keeps every figure under its own key
SHOWN = {
    "energy over one window for every policy, GPUs always on": (
        "window_h", "energy_kwh", "energy_kwh_on", "on_vs_greedy-fastest", "on_vs_oracle"),
    "energy over that window, idle GPUs parked": ("energy_kwh_parked", "parked_vs_greedy-fastest", "parked_vs_oracle"),
    "service": ("sla_attainment", "avg_jct_s", "makespan_s", "migrations", "jobs_unfinished", "decision_p99_ms"),
}


def _tables(figures: dict[str, dict]) -> list[tuple[str, Any]]:
    """(title, table) per subject of :data:`SHOWN`, for the policies of one seed."""
    import polars as pl

    tables = []
    for title, keys in SHOWN.items():
        rows = []
        for name, row in figures.items():
            out = {"policy": name}
            for key in keys:
                if key in row:
                    h = key.endswith("_s")
                    out[key.removesuffix("_s") + "_h" if h else key] = row[key] / 3600 if h else row[key]
            if "sla_attainment" in out:
                out["sla_attainment"] = attainment_text(out["sla_attainment"])
            rows.append(out)
        if any(len(r) > 1 for r in rows):
            tables.append((title, pl.DataFrame(rows)))
    return tables


def _busy_table(figures: dict[str, dict]):
    """Per policy, the GPU-hours each type was busy: where the work went (a separate table: the
    main one is wide already)."""
    import polars as pl

    return pl.DataFrame([{"policy": name, **{f"{t} busy_gpu_h": h for t, h in row["busy_gpu_h"].items()}}
                         for name, row in figures.items() if row.get("busy_gpu_h")])


def unfinished_notes(per_seed: dict[int, dict[str, dict]]) -> list[str]:
    """What the table's ``jobs_unfinished`` column means for its ratios, where it is not 0.

    A job left unfinished (its requirement unmet on every GPU type under noise, or the run's
    horizon reached) spends nothing after that, so a policy that finished fewer jobs looks
    cheaper for work it never did; where every policy left the same ones the ratios still
    compare like with like. Said under the table: only a column showed it (a new-user review)."""
    notes = []
    for seed, figures in per_seed.items():
        counts = _unfinished(figures)
        if not any(counts.values()):
            continue
        where = f" (seed {seed})" if len(per_seed) > 1 else ""
        if len(set(counts.values())) == 1:
            n = next(iter(counts.values()))
            notes.append(f"note{where}: every policy left {n} job(s) unfinished (jobs_unfinished); their energy "
                         "stops where their work stopped, alike for every policy (docs/simulation.md)")
        else:
            said = ", ".join(f"{name} {n}" for name, n in counts.items())
            notes.append(f"note{where}: policies left different numbers of jobs unfinished ({said}): a policy "
                         "that finished fewer spent nothing on the work it never did, so its energy ratios are "
                         "not comparable with the others' (docs/simulation.md)")
    return notes


def _floor_levels(names: list[str]) -> tuple[float, ...]:
    """The limit levels the floor may use: those of the policies that set limits (the ``+limits``
    policies, ``greedy-fastest+cap``) when one runs, else none (a floor without the levels a
    policy used is no floor for it)."""
    return DEFAULT_LIMIT_LEVELS if any(LIMITS_SUFFIX in n or n in CAP_POLICIES for n in names) else ()


def _levels_text(levels: tuple[float, ...]) -> str:
    """Evenly spaced levels from 0 said as a range and a step (a list of sixteen reads poorly)."""
    if not levels:
        return "none (no policy setting limits ran)"
    n = len(levels)
    if n > 3 and levels[0] == 0 and all(math.isclose(f, i / n) for i, f in enumerate(levels)):
        return f"0 to {levels[-1]:g} of each type's range in steps of 1/{n}, and its maximum"
    return ",".join(f"{f:g}" for f in levels)


def _floor_legend(names: list[str]) -> str:
    """What the floor rows mean, for the policies that ran."""
    levels = _levels_text(_floor_levels(names))
    due = ("; 'floor, by greedy-fastest': the same, no job done later than greedy-fastest did it"
           if "greedy-fastest" in names else "")
    return ("'floor, may wait': the least any schedule meeting every requirement all the time could spend on "
            f"these jobs (the fleet's capacity, hindsight, jobs free to wait to the window's end){due}. Limit "
            f"levels {levels}; the window is the run's, so it depends on the policies run "
            "(docs/simulation.md, the energy floor)")


def _patience(args: argparse.Namespace):
    """What the +wait policies run with: --wait-hours, --wait-saving and --wait-within-reach, else the defaults."""
    from gogh_flows.placement.patience import Patience

    hours = WAIT_S / 3600 if args.wait_hours is None else args.wait_hours
    saving = WAIT_SAVING if args.wait_saving is None else args.wait_saving
    if not (math.isfinite(hours) and hours >= 0):
        raise ValueError(f"--wait-hours must be a number of hours >= 0 (0: never hold), got {hours!r}")
    if not 0 < saving < 1:
        raise ValueError(f"--wait-saving must be a share of energy in (0, 1), e.g. 0.1, got {saving!r}")
    return Patience(hours * 3600.0, saving, within_reach=args.wait_within_reach)


def _check_arguments(args: argparse.Namespace, truth: ThroughputTable, names: list[str]) -> None:
    """What can be checked before any job is read or model trained, with the option it concerns."""
    from gogh_flows.predict.cli import check_epochs
    from gogh_flows.sim.run import make_policy

    if not names:
        raise ValueError("--policy names no policy; e.g. --policy oracle,greedy-fastest")
    for name in names:  # an unknown name is refused here, with the list and the modifiers' order
        if name not in ALL_POLICIES:
            make_policy(name, truth, args.seed)
    generated = args.trace.startswith("generate:")
    if not generated:
        trace = Path(args.trace).expanduser()
        if trace.is_dir():
            raise ValueError(f"--trace {args.trace!r} is a folder; give a .trace file in it (e.g. "
                             f"{next(iter(sorted(trace.rglob('*.trace'))), trace / 'NAME.trace')}) or generate:N")
        if not trace.is_file():
            traces = gavel_dir() / "traces"
            where = (f"Gavel's are in {traces.resolve()}" if traces.is_dir() else
                     f"Gavel's traces were not found: set GOGH_GAVEL_DIR, by default {where_looked('gavel')}")
            raise ValueError(f"--trace {args.trace!r} not found; give a .trace file ({where}) or generate:N")
        args.trace = str(trace)  # as checked, ~ expanded
        if args.rate is not None:
            raise ValueError(f"--rate sets the arrivals of --trace generate:N; the trace {args.trace!r} has its "
                             "own arrival times. Drop --rate, or use generate:N")
    elif args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"--rate must be arrivals per hour > 0, got {args.rate:g}")
    if args.migration_s < 0 or not math.isfinite(args.migration_s):
        raise ValueError(f"--migration-s must be seconds >= 0, got {args.migration_s:g}")
    # SimConfig checks these too, but only once jobs are read and models trained (a minute)
    if not 0 <= args.noise < 1:
        raise ValueError(f"--noise must be a log-normal sigma in [0, 1) (0.1: about 10% run-to-run spread), "
                         f"got {args.noise:g}")
    if args.rebalance_gain is not None and not 0 <= args.rebalance_gain < 1:
        raise ValueError(f"--rebalance-gain must be a fraction in [0, 1) (the share of a job's predicted "
                         f"remaining time, or energy, that a move must save), got {args.rebalance_gain:g}")
    if args.seed < 0 and not args.seeds:  # --seeds, when given, replaces --seed
        raise ValueError(f"--seed must be an integer >= 0, got {args.seed}")
    check_epochs(args.p1_epochs, args.p2_epochs)
    if args.risk_level is not None:
        from gogh_flows.predict.intervals import LEVELS

        if not LEVELS[0] <= args.risk_level <= LEVELS[-1]:
            raise ValueError(f"--risk-level must be within the calibrated {LEVELS[0]:g}-{LEVELS[-1]:g} (the share of "
                             f"new jobs' throughputs the plan's lower bound should hold for), got {args.risk_level:g}")
    if (args.p1_epochs is not None or args.p2_epochs is not None) and not args.holdout_family:
        raise ValueError("--p1-epochs and --p2-epochs set the training of --holdout-family F; without it nothing is "
                         "trained here (--predictors DIR loads trained models). Add --holdout-family or drop them")
    learned = any(base_policy(n) in LEARNED_POLICIES for n in names)
    _check_unused(args, names, learned)
    if args.rebalance_gain is None:  # None until here: whether it was given is what _check_unused asks
        args.rebalance_gain = SimConfig.rebalance_gain
    if args.holdout_family == EACH:
        from gogh_flows.predict.data import MeasuredSet

        if not learned:
            raise ValueError(f"--holdout-family {EACH} trains the predictors of the learned policies and leaves the "
                             f"jobs as they are, and none of {names} is a learned policy (gogh, gogh-p1 and their "
                             "+limits, +fleet, +wait variants): add one, or drop --holdout-family")
        families = MeasuredSet.from_table(truth).families
        if len(families) < 3:
            raise ValueError(f"--holdout-family {EACH} trains P1/P2 once per family without it, and each training "
                             f"needs at least two families left; the truth ({truth.source}) has {len(families)} "
                             f"({', '.join(families)}): use a truth with at least three families")
    if args.predictors and args.holdout_family and learned:
        if args.holdout_family == EACH:
            raise ValueError(f"--holdout-family {EACH} trains P1/P2 here once per family, each without it; "
                             f"--predictors {args.predictors!r} is one model, which saw every family but those it was "
                             f"trained without. Drop --predictors, or name one family it excludes")
        _check_holdout_predictors(args.predictors, args.holdout_family)


def _check_unused(args: argparse.Namespace, names: list[str], learned: bool) -> None:
    """An option no policy of the run reads would be recorded in the JSON as if it had shaped the
    figures (a review: ``--no-rebalance --rebalance-gain 0.5`` wrote both), so it is refused."""
    if args.predictors and not learned:
        raise ValueError(f"--predictors {args.predictors!r} serves the learned policies (gogh, gogh-p1 and their "
                         f"+limits, +fleet, +wait variants), and none of {names} is one: add one, or drop --predictors")
    if args.rltune_model is not None and "rltune" not in names:
        raise ValueError(f"--rltune-model {args.rltune_model!r} is the rltune peer's agent, and rltune is not among "
                         f"{names}: add it to --policy, or drop --rltune-model")
    if args.no_rebalance and args.rebalance_gain is not None:
        raise ValueError(f"--rebalance-gain {args.rebalance_gain:g} sets when a running job moves to a freed GPU, and "
                         "--no-rebalance never moves one: drop one of them")


def _truth_name(spec: str) -> str:
    """The truth a ``--truth`` value (or a model's recorded one) names: ``synthetic``, or a file's name."""
    return "simulation_throughputs.json" if spec == "gavel" else "synthetic" if spec == "synthetic" else Path(spec).name


def _note_other_truth(args: argparse.Namespace, predictors) -> None:
    """Predictors trained on another truth than the one simulated is allowed (how they transfer is a
    fair question), but never silent: their figures then measure that too."""
    trained = (predictors.p1.trained_on or {}).get("truth")
    if trained and _truth_name(str(trained)) != _truth_name(args.truth):
        print(f"note: --predictors {args.predictors!r} were trained on {trained!r}, and this simulation's truth is "
              f"{args.truth!r}: the learned policies' figures include how far one is from the other. Train "
              f"predictors on the same truth (gogh predictors train --truth {args.truth}) or use --holdout-family "
              "to train them here", file=sys.stderr)


def _check_holdout_predictors(directory: str, family: str) -> None:
    """Loaded predictors that saw the held-out family would make its figures in-sample."""
    from gogh_flows.predict.io import load_p1, prior_dir

    p1_dir = prior_dir(directory) / "p1"
    if not p1_dir.is_dir():
        return  # load_predictors says what is missing
    excluded = load_p1(p1_dir).trained_on.get("excluded_families") or []
    if family.lower() not in {f.lower() for f in excluded}:
        raise ValueError(
            f"--predictors {directory!r} were trained with family {family!r} (trained without: "
            f"{', '.join(excluded) or 'none'}), so with --holdout-family {family!r} the learned policies would be "
            f"scored on jobs their predictors saw. Drop --predictors to train here without it, or train them "
            f"without it: gogh predictors train --exclude-family {family} --out DIR")


def cmd_simulate(args: argparse.Namespace) -> int:
    import polars as pl

    truth = load_truth(args.truth)
    if args.holdout_family and args.holdout_family.strip().casefold() == EACH:
        args.holdout_family = EACH
    elif args.holdout_family:  # the truth's spelling, whatever the case given: it names results and messages
        from gogh_flows.predict.data import MeasuredSet

        try:
            args.holdout_family = MeasuredSet.from_table(truth).family_named(args.holdout_family)
        except ValueError as exc:
            raise ValueError(f"--holdout-family: {exc}, or '{EACH}' to keep the jobs' own types and plan each without "
                             "its own family") from None
    if args.capacity not in (1, 2):
        raise ValueError(f"--capacity must be 1 (one job per GPU) or 2 (pairs may share), got {args.capacity}: "
                         "the predictors and the truth tables know pairs at most")
    gpus = parse_cluster(args.cluster, capacity=args.capacity)
    types = sorted({g.gpu_type for g in gpus})
    missing = [t for t in types if t not in truth.gpu_types]
    if missing:
        raise ValueError(f"cluster GPU types {missing} are not in the truth table "
                         f"({truth.source}); it covers {list(truth.gpu_types)}")
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    _check_arguments(args, truth, names)
    seeds = _seeds(args)
    if args.risk_level is not None and not any(base_policy(n) == "gogh" for n in names):
        raise ValueError(f"--risk-level applies to the learned policies' refiner (gogh; gogh-p1 plans with P1's "
                         f"point predictions, which its intervals do not describe) and gogh is not among {names}; "
                         "drop it or add gogh")
    waits = any(n.endswith(WAIT_SUFFIX) for n in names)
    if (args.wait_hours is not None or args.wait_saving is not None or args.wait_within_reach) and not waits:
        raise ValueError(f"--wait-hours, --wait-saving and --wait-within-reach apply to the +wait policies (e.g. "
                         f"oracle+limits+wait) and none is among {names}; drop them or add one")
    patience = _patience(args) if waits else None  # bad values stop here, before anything runs
    per_seed: dict[int, dict[str, dict]] = {}
    # every seed's jobs first, then the predictors once (the first seed's training) for all of them, as
    # benchmarks/energy_seeds.py does: the spread is the workload's, not the training's
    streams = {seed: _jobs(_seeded(args, seed), truth, gpus) for seed in seeds}
    predictors = _predictors(_seeded(args, seeds[0]), truth, names, [j for js in streams.values() for j in js])
    results = jobs = None
    for seed in seeds:
        jobs = streams[seed]
        run, per_seed[seed] = _run_one(args, truth, gpus, names, seed, jobs, predictors, patience)
        results = results or run  # the plot shows the seed the JSON's "policies" are for
    figures = {"policies": per_seed[seeds[0]], "jobs": len(jobs), "gpus": len(gpus), "seed": seeds[0],
               "truth": truth.source, "trace": args.trace, "cluster": args.cluster,
               "capacity": args.capacity, "requirement_q": args.requirement_q,
               "noise": args.noise, "rebalance": not args.no_rebalance,
               "rebalance_gain": args.rebalance_gain, "migration_s": args.migration_s,
               "holdout_family": args.holdout_family,
               # the learned policies plan with the lower end of their intervals at it (None: point predictions)
               "risk_level": args.risk_level,
               **({"wait_hours": patience.max_wait_s / 3600, "wait_saving": patience.min_saving,
                   "wait_within_reach": patience.within_reach}
                  if patience is not None else {}),
               "policies_are_for_seed": seeds[0],
               "energy_account": "energy_kwh is each policy's own run (idle until its own last completion); "
                                 "energy_kwh_on / energy_kwh_parked cover one window for every policy (0 to the "
                                 "last completion of any): always on (every GPU at least idle) and parked "
                                 "(empty GPUs at 0 W); on_vs_X / parked_vs_X are ratios to policy X",
               "predictors": predictors.description if predictors is not None else None}
    if args.floor:
        figures["floor"] = {
            "limit_levels": list(_floor_levels(names)),
            "meaning": _floor_legend(names)}
    if len(seeds) > 1:
        figures["seeds"] = seeds
        figures["per_seed"] = {str(s): f for s, f in per_seed.items()}
        figures["spread"] = _spread(per_seed)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=250, float_precision=3,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        for seed in seeds:
            if len(seeds) > 1:
                print(f"seed {seed}")
            for title, table in _tables(per_seed[seed]):
                print(f"{title}:")
                print(table)
            print("GPU-hours busy, per type:")
            print(_busy_table(per_seed[seed]))
        if len(seeds) > 1:
            def cell(key: str, v: dict[str, float]) -> tuple[str, str]:
                scale, name = (3600.0, key.removesuffix("_s") + "_h") if key.endswith("_s") else (1.0, key)
                return name, f"{v['mean'] / scale:.3f} [{v['min'] / scale:.3f}, {v['max'] / scale:.3f}]"

            over = f"over seeds {', '.join(map(str, seeds))} (mean [min, max])"
            marked = fewer_done(per_seed)
            for title, ratio in ((f"energy ratios {over}", True), (f"service {over}", False)):
                rows = [{"policy": p + (FEWER_DONE if p in marked else ""),
                         **dict(cell(k, v) for k, v in figs.items()
                                if k.startswith(("on_vs_", "parked_vs_")) == ratio)}
                        for p, figs in figures["spread"].items()]
                if any(len(r) > 1 for r in rows):
                    print(f"{title}:")
                    print(pl.DataFrame(rows))
            if marked:
                print(f"{FEWER_DONE.strip()}: left more jobs unfinished than another policy on at least one seed "
                      "(jobs_unfinished): its means count less work than the others', so they are not comparable "
                      "(and may fall below a floor); the notes below say which seeds", file=sys.stderr)
    print("energy_kwh: each policy's own run; energy_kwh_on / _parked: one common window for every "
          "policy, always on / idle GPUs parked; on_vs_X, parked_vs_X: ratios to policy X; <type> busy_gpu_h: "
          "GPU-hours that type's GPUs were busy (a board shared by two jobs counts once)", file=sys.stderr)
    if args.risk_level is not None and any(base_policy(n) == "gogh-p1" for n in names):
        print("gogh-p1 planned with P1's point predictions: the intervals are calibrated on the refiner's errors, "
              "not on P1 alone's, so --risk-level applies to gogh only", file=sys.stderr)
    if args.risk_level is not None:
        print(f"gogh planned at risk level {args.risk_level:g} (the lower end of the predictors' "
              "calibrated interval at that level); their completion times change the common window, so every "
              "policy's ratios depend on it", file=sys.stderr)
    for line in unfinished_notes(per_seed):
        print(line, file=sys.stderr)
    if args.floor:
        print(_floor_legend(names), file=sys.stderr)
        for seed in seeds:
            for name, row in per_seed[seed].items():
                if "note" in row:
                    print(f"{name} (seed {seed}): no figure, {row['note']}", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if args.plot:
        from gogh_flows.sim.plots import plot_comparison

        plot_comparison(results, args.plot, seed=seeds[0])  # the seed the JSON's "policies" are for
    return 0


__all__ = ["add_parser", "cmd_simulate"]
