"""Predictors for the learned policies, and job streams from a family they never saw.

Why this lives in the simulator: the claim under test is that GOGH places jobs of an
*unseen* model family well. The predictors must therefore be trained without that
family (as a job and as a partner: ``MeasuredSet.without``), and the simulated jobs
must all come from it. Both steps are here so the CLI and the benchmark do exactly
the same thing.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from gogh_flows.sim.learned import Predictors, gang_scaling
from gogh_flows.sim.unseen import UnseenFamilies
from gogh_flows.truth.table import ThroughputTable


class CalibrationError(ValueError):
    """The ensemble's weights and intervals could not be chosen on the families left; a plan at a
    risk level needs them (a caller can offer planning with the point predictions instead)."""


def family_types(truth: ThroughputTable, family: str) -> list[str]:
    """The truth's job types of ``family`` (error naming the families when there are none)."""
    from gogh_flows.predict.data import MeasuredSet

    full = MeasuredSet.from_table(truth)
    return list(full.of_family(full.family_named(family)))


def train_holdout(truth: ThroughputTable, family: str | None, *, p1_epochs: int | None = None,
                  p2_epochs: int | None = None, seed: int = 0,
                  log: Callable[[str], None] | None = None, intervals: bool = False,
                  strict: bool = True) -> Predictors:
    """Train P1 and P2 on ``truth`` without ``family`` (None: on everything).

    The same recipe as ``gogh predictors train``: P1 on every isolated and pair
    measurement left, P2 on out-of-family P1 vectors (one P1 per remaining family), so it
    learns how P1 errs on models it has not seen. ``intervals``: also choose the ensemble's weights and
    calibrate its intervals on the remaining families (:func:`calibrate_refiner`; what a risk
    level plans with; P2 is then trained once more per remaining family). Without, the
    predictions are P2's alone. ``strict=False``: where that cannot be done (too few families
    or measured jobs left), warn and go on with P2 alone.
    """
    import torch

    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.evaluate import out_of_family_p1
    from gogh_flows.predict.layout import Layout
    from gogh_flows.predict.p1 import P1Config, train_p1
    from gogh_flows.predict.p2 import P2Config, train_p2

    torch.set_num_threads(1)
    p1_cfg, p2_cfg = P1Config(seed=seed), P2Config(seed=seed)
    if p1_epochs is not None:
        p1_cfg = replace(p1_cfg, epochs=p1_epochs)
    if p2_epochs is not None:
        p2_cfg = replace(p2_cfg, epochs=p2_epochs)
    full = MeasuredSet.from_table(truth)
    data = full.without([family]) if family is not None else full
    p1 = train_p1(data, p1_cfg)
    layout = Layout(data.gpus, data.names)
    oof = out_of_family_p1(data, layout, dict(data.jobs), p1_cfg, log)
    p2 = train_p2(layout, oof, layout.truth(data, data.names), p2_cfg)
    if intervals:  # as `gogh predictors train`: conformal widths from the training families only
        from gogh_flows.predict.evaluate import EvalConfig, calibrate_refiner

        try:
            bounds, ensemble = calibrate_refiner(data, oof, EvalConfig(p1=p1_cfg, p2=p2_cfg, seed=seed))
        except ValueError as exc:
            what = (f"choosing the ensemble's weights and calibrating the intervals on the {len(data.families)} "
                    f"families left ({', '.join(data.families)}) failed: {exc}")
            if strict:
                raise CalibrationError(f"{what}; a risk level needs them: use a truth with more families, or plan "
                                       "with the point predictions (no risk level)") from None
            warnings.warn(f"{what}; the learned policies predict with P2 alone", stacklevel=2)
        else:
            p2.trained_on.update(intervals=bounds.to_dict(), ensemble=ensemble.to_dict())
    gang = gang_scaling(truth, data.names)
    left = f"without family {family!r}" if family is not None else "on every family"
    return Predictors(p1, p2, gang, f"trained in-run on {truth.source} {left} "
                                    f"(P1 {p1_cfg.encoder}, {p1_cfg.epochs} epochs; P2 {p2_cfg.epochs} "
                                    f"epochs; seed {seed})")


def train_each_unseen(truth: ThroughputTable, families: Sequence[str] | None = None, *,
                      p1_epochs: int | None = None, p2_epochs: int | None = None, seed: int = 0,
                      log: Callable[[str], None] | None = None, intervals: bool = False,
                      strict: bool = True) -> UnseenFamilies:
    """:func:`train_holdout` once per family (default: every family of ``truth``), each without it:
    predictors for a mixed stream in which every job's family is unseen (``sim.unseen``)."""
    from gogh_flows.predict.data import MeasuredSet

    full = MeasuredSet.from_table(truth)
    chosen = [full.family_named(f) for f in families] if families is not None else list(full.families)
    if not chosen:
        raise ValueError("train_each_unseen: name at least one family")
    by_family = {}
    for fam in chosen:
        if log:
            log(f"training without {fam}")
        by_family[fam] = train_holdout(truth, fam, p1_epochs=p1_epochs, p2_epochs=p2_epochs, seed=seed, log=log,
                                       intervals=intervals, strict=strict)
    # "trained in-run on SRC without family 'F' (P1 ...; seed S)" -> one line for all of them
    head, tail = next(iter(by_family.values())).description.split(" without ", 1)
    detail = tail[tail.index("("):] if "(" in tail else ""
    return UnseenFamilies(by_family, dict(full.family),
                          f"{head} once per family, each without it ({', '.join(chosen)}) {detail}".rstrip())


def load_predictors(directory: str | Path, truth: ThroughputTable) -> Predictors:
    """``DIR/p1`` and ``DIR/p2`` as written by ``gogh predictors train --out DIR``, or a shipped
    prior by its name (``gavel``, ``synthetic``), as ``gogh predict --predictors`` takes them.

    The gang scaling comes from the truth's job types of the families the models were
    trained on (their ``excluded_families`` are left out).
    """
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.io import load_p1, load_p2, prior_dir

    d = prior_dir(str(directory))
    if not (d / "p1").is_dir():
        raise ValueError(f"--predictors {str(directory)!r} is neither a shipped prior (gavel, synthetic) nor a "
                         "folder holding a p1/ model directory; write one with `gogh predictors train --out DIR`")
    p1 = load_p1(d / "p1")
    p2 = load_p2(d / "p2") if (d / "p2").is_dir() else None
    excluded = set(p1.trained_on.get("excluded_families", []) or [])
    full = MeasuredSet.from_table(truth)
    names = [n for n in full.names if full.family[n] not in excluded]
    return Predictors(p1, p2, gang_scaling(truth, names), f"loaded from {d}")


def relabel_to_family(jobs: Sequence, types: Sequence[str], throughput_of: Callable[[str, int], float],
                      *, seed: int) -> list:
    """Every job re-labelled to a job type of the held-out family, keeping its duration.

    A trace's arrival times, GPU counts and durations are kept; each job gets a type
    drawn (seeded, per job id) among ``types`` that run at its GPU count, and its steps
    are rescaled so it lasts as long on the reference GPU type (``throughput_of``) as
    the original did. Jobs no such type can run are dropped (the caller reports them).
    """
    out = []
    for j in jobs:
        ok = [t for t in types if throughput_of(t, j.num_gpus) > 0]
        old = throughput_of(j.job_type, j.num_gpus)
        if not ok or not old > 0:
            continue
        pick = ok[zlib.crc32(f"{seed}|{j.id}".encode()) % len(ok)]
        steps = j.total_steps / old * throughput_of(pick, j.num_gpus)
        out.append(replace(j, job_type=pick, total_steps=steps))
    return out


__all__ = ["family_types", "load_predictors", "relabel_to_family", "train_each_unseen", "train_holdout"]
