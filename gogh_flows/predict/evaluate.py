"""Leave-one-family-out evaluation of P1, P2 and the baselines (DESIGN section 7).

For each held-out family: P1 and P2 are trained *here* on the other families only (the
held-out family's jobs and every pair involving them are removed by
:meth:`MeasuredSet.without` before anything is fitted), then every method predicts the
held-out jobs. ``_Nobs`` metrics reveal N measured entries of a held-out job (isolated
entries for the isolated metrics, co-located entries for the co-located one), drawn at
random ``repeats`` times, and score only the entries that stayed hidden.

``isolated_mape_1obs_siblings`` is the situation once a new family has run for a while and
another batch size of it arrives: one isolated entry of the held-out job is revealed, and
so are all isolated entries of the *other* held-out jobs (its siblings; the models were
still trained without the family). ``p2`` then is what the placement service does (P2 on the
job's own observation, then the siblings of :mod:`gogh_flows.predict.siblings`),
``matrix_completion`` fits the siblings' rows together with the known jobs (Gavel's way),
``nearest`` may pick a sibling as the nearest job, ``p1`` uses the job's own observation only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from gogh_flows.predict.baselines import MatrixCompletion, NearestJob
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.encoding import job_summary
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, P1Model, train_p1
from gogh_flows.predict.p2 import P2Config, P2Model, train_p2
from gogh_flows.predict.siblings import family_and_batch, sibling_transfer
from gogh_flows.workloads.features import WorkloadFeatures

METHODS = ("p1", "p2", "matrix_completion", "nearest")
METRICS = ("isolated_mape", "colocated_mape", "isolated_mape_1obs", "isolated_mape_2obs", "colocated_mape_1obs",
           "isolated_mape_1obs_siblings")
# metric -> (kind of entries revealed and scored, number revealed)
_PROTOCOL = {
    "isolated_mape": ("isolated", 0), "colocated_mape": ("pair", 0),
    "isolated_mape_1obs": ("isolated", 1), "isolated_mape_2obs": ("isolated", 2),
    "colocated_mape_1obs": ("pair", 1),
}


@dataclass(frozen=True)
class EvalConfig:
    p1: P1Config = field(default_factory=P1Config)
    p2: P2Config = field(default_factory=P2Config)
    repeats: int = 5
    seed: int = 0


def p1_vectors(model: P1Model, layout: Layout, names: Sequence[str],
               features: Mapping[str, WorkloadFeatures]) -> np.ndarray:
    pred = model.predict({n: features[n] for n in names}, layout.gpus,
                         partners={p: features[p] for p in layout.partners})
    return layout.from_prediction(pred)


def out_of_family_p1(data: MeasuredSet, layout: Layout, features: Mapping[str, WorkloadFeatures],
                     config: P1Config, log: Callable[[str], None] | None = None,
                     done: Callable[[], None] | None = None) -> np.ndarray:
    """P1 vectors for every job of ``data``, each from a P1 that never saw the job's family.

    P2 learns how to correct P1's errors on *new* models; in-sample P1 predictions would
    teach it that P1 is nearly always right.
    """
    if len(data.families) < 2:
        raise ValueError("out-of-family P1 predictions need measurements from at least two families")
    out = np.full((len(data.names), layout.size), np.nan)
    row = {n: i for i, n in enumerate(data.names)}
    for fam in data.families:
        model = train_p1(data.without([fam]), config)
        names = data.of_family(fam)
        out[[row[n] for n in names]] = p1_vectors(model, layout, names, features)
        if log:
            log(f"  out-of-family P1 for {fam} ({len(names)} jobs)")
        if done:
            done()
    return out


def _mape_entries(pred_log: np.ndarray, true_log: np.ndarray, where: np.ndarray) -> list[float]:
    m = where & np.isfinite(true_log) & np.isfinite(pred_log)
    return list(np.abs(np.exp(pred_log[m] - true_log[m]) - 1.0))


def score(complete: Callable[[int, np.ndarray], np.ndarray], truth: np.ndarray, layout: Layout,
          repeats: int, seed: int) -> dict[str, float]:
    """Every metric of one method; ``complete(i, observed_row)`` returns job i's full log row."""
    is_pair = layout.is_pair()
    out: dict[str, float] = {}
    for metric, (kind, n) in _PROTOCOL.items():
        rng = np.random.default_rng([seed, n, kind == "pair"])
        pool_mask = is_pair if kind == "pair" else ~is_pair
        errs: list[float] = []
        for i, row in enumerate(truth):
            known = np.flatnonzero(np.isfinite(row) & pool_mask)
            if n == 0:
                pred = complete(i, np.full_like(row, np.nan))
                errs += _mape_entries(pred, row, pool_mask)
                continue
            if len(known) <= n:
                continue
            for _ in range(repeats):
                shown = rng.choice(known, size=n, replace=False)
                obs = np.full_like(row, np.nan)
                obs[shown] = row[shown]
                hidden = pool_mask.copy()
                hidden[shown] = False
                errs += _mape_entries(complete(i, obs), row, hidden)
        out[metric] = float(np.mean(errs)) if errs else math.nan
    return out


def score_siblings(complete: Callable[[int, np.ndarray, np.ndarray], np.ndarray], truth: np.ndarray,
                   layout: Layout, repeats: int, seed: int) -> float:
    """``isolated_mape_1obs_siblings`` (module docstring). ``complete(i, observed_i, siblings)``
    returns job i's full log row; ``siblings`` is ``truth`` with job i's row and every pair
    entry hidden (NaN)."""
    iso = ~layout.is_pair()
    rng = np.random.default_rng([seed, 1, 17])
    errs: list[float] = []
    for i, row in enumerate(truth):
        known = np.flatnonzero(np.isfinite(row) & iso)
        if len(known) <= 1 or len(truth) < 2:
            continue
        sibs = np.where(iso[None, :], truth, np.nan)
        sibs[i] = np.nan
        for _ in range(repeats):
            k = rng.choice(known)
            obs = np.full_like(row, np.nan)
            obs[k] = row[k]
            hidden = iso.copy()
            hidden[k] = False
            errs += _mape_entries(complete(i, obs, sibs), row, hidden)
    return float(np.mean(errs)) if errs else math.nan


def with_siblings(refined_log: np.ndarray, p1_log: np.ndarray, observed_log: np.ndarray, layout: Layout,
                  names: Sequence[str], family: Mapping[str, str | None]) -> np.ndarray:
    """Log rows whose unmeasured isolated entries are moved by the measured siblings."""
    g = len(layout.gpus)
    with np.errstate(over="ignore", invalid="ignore"):
        rows = {n: np.exp(refined_log[i, :g]) for i, n in enumerate(names)}
        priors = {n: np.exp(p1_log[i, :g]) for i, n in enumerate(names)}
    measured = {n: {c: float(np.exp(observed_log[i, c])) for c in range(g) if np.isfinite(observed_log[i, c])}
                for i, n in enumerate(names)}
    sizes = {n: b for n in names if (b := family_and_batch(n)[1])}
    moved = sibling_transfer({n: np.nan_to_num(r) for n, r in rows.items()},
                             {n: np.nan_to_num(p) for n, p in priors.items()},
                             {n: m for n, m in measured.items() if m}, family, batch_size=sizes)
    out = refined_log.copy()
    for i, n in enumerate(names):
        with np.errstate(divide="ignore"):
            new = np.log(moved[n])
        out[i, :g] = np.where(np.isfinite(new) & np.isfinite(out[i, :g]), new, out[i, :g])
    return out


@dataclass
class HoldoutResult:
    family: str
    metrics: dict[str, dict[str, float]]
    seconds: float
    p1: P1Model | None = None
    p2: P2Model | None = None


def evaluate_holdout(full: MeasuredSet, holdout: str, config: EvalConfig = EvalConfig(),
                     log: Callable[[str], None] | None = None) -> HoldoutResult:
    start = time.perf_counter()
    train = full.without([holdout])
    test = full.of_family(holdout)
    if not test:
        raise ValueError(f"family {holdout!r} has no jobs; families here: {list(full.families)}")
    # the layout names every job as a potential partner; entries with held-out partners
    # are unknown in training (removed by without()) and scored in the test
    layout = Layout(full.gpus, full.names)
    features = dict(full.jobs)
    guard_no_leak(train, holdout)
    p1 = train_p1(train, config.p1)
    p1_test = p1_vectors(p1, layout, test, features)
    truth_train = layout.truth(train, train.names)
    truth_test = layout.truth(full, test)
    oof = out_of_family_p1(train, layout, features, config.p1, log)
    p2 = train_p2(layout, oof, truth_train, config.p2)
    mc = MatrixCompletion(seed=config.seed).fit(truth_train)
    nearest = NearestJob(
        np.stack([job_summary(full.jobs[n]) for n in train.names]), truth_train,
        np.log([full.jobs[n].step_flops for n in train.names]),
    )
    test_summary = [job_summary(full.jobs[n]) for n in test]
    test_flops = [math.log(full.jobs[n].step_flops) for n in test]
    methods: dict[str, Callable[[int, np.ndarray], np.ndarray]] = {
        "p1": lambda i, obs: np.where(np.isfinite(obs), obs, p1_test[i]),
        "p2": lambda i, obs: p2.refine(p1_test[i], obs)[0],
        "matrix_completion": lambda i, obs: mc.complete(obs)[0],
        "nearest": lambda i, obs: nearest.complete(test_summary[i], test_flops[i], obs),
    }
    metrics = {name: score(fn, truth_test, layout, config.repeats, config.seed) for name, fn in methods.items()}
    fam = {n: holdout for n in test}

    def p2_siblings(i: int, obs: np.ndarray, sibs: np.ndarray) -> np.ndarray:
        seen = sibs.copy()
        seen[i] = obs
        refined = p2.refine(p1_test, seen)
        return with_siblings(refined, p1_test, seen, layout, test, fam)[i]

    def nearest_siblings(i: int, obs: np.ndarray, sibs: np.ndarray) -> np.ndarray:
        others = [k for k in range(len(test)) if k != i]
        nb = NearestJob(
            np.stack([job_summary(full.jobs[n]) for n in train.names] + [test_summary[k] for k in others]),
            np.vstack([truth_train, sibs[others]]),
            np.array([math.log(full.jobs[n].step_flops) for n in train.names] + [test_flops[k] for k in others]),
        )
        return nb.complete(test_summary[i], test_flops[i], obs)

    together: dict[str, Callable[[int, np.ndarray, np.ndarray], np.ndarray]] = {
        "p1": lambda i, obs, sibs: methods["p1"](i, obs),
        "p2": p2_siblings,
        "matrix_completion": lambda i, obs, sibs: MatrixCompletion(seed=config.seed).fit(
            np.vstack([truth_train, np.delete(sibs, i, axis=0)])).complete(obs)[0],
        "nearest": nearest_siblings,
    }
    for name, fn in together.items():
        metrics[name]["isolated_mape_1obs_siblings"] = score_siblings(fn, truth_test, layout, config.repeats,
                                                                      config.seed)
    secs = time.perf_counter() - start
    if log:
        log(f"{holdout}: " + ", ".join(
            f"{m} iso {v['isolated_mape']:.3f} iso1 {v['isolated_mape_1obs']:.3f} co1 {v['colocated_mape_1obs']:.3f}"
            for m, v in metrics.items()) + f" ({secs:.0f} s)")
    return HoldoutResult(holdout, metrics, secs, p1, p2)


def in_sample_metrics(p1: P1Model, p2: P2Model, data: MeasuredSet, layout: Layout, oof_p1: np.ndarray,
                      *, repeats: int = 3, seed: int = 0) -> dict[str, float]:
    """Training-set figures for a model card: P1's fit, and P2's correction of out-of-family P1.

    Not a measure of generalisation (that is :func:`leave_one_family_out`); it shows the
    models learned what they were given.
    """
    truth = layout.truth(data, data.names)
    own = p1_vectors(p1, layout, data.names, dict(data.jobs))
    s_p1 = score(lambda i, obs: np.where(np.isfinite(obs), obs, own[i]), truth, layout, 1, seed)
    s_oof = score(lambda i, obs: np.where(np.isfinite(obs), obs, oof_p1[i]), truth, layout, 1, seed)
    s_p2 = score(lambda i, obs: p2.refine(oof_p1[i], obs)[0], truth, layout, repeats, seed)
    return {
        "p1_isolated_mape": s_p1["isolated_mape"], "p1_colocated_mape": s_p1["colocated_mape"],
        "oof_p1_isolated_mape": s_oof["isolated_mape"], "oof_p1_colocated_mape": s_oof["colocated_mape"],
        "p2_isolated_mape_1obs": s_p2["isolated_mape_1obs"], "p2_colocated_mape_1obs": s_p2["colocated_mape_1obs"],
    }


def guard_no_leak(train: MeasuredSet, holdout: str) -> None:
    """Fail loudly if anything of the held-out family is still in a training set."""
    leaked = [n for n in train.jobs if train.family[n] == holdout]
    partners = set(train.pairs["partner"].to_list()) | set(train.pairs["job"].to_list())
    leaked += [n for n in partners if n not in train.jobs]
    if leaked:
        raise AssertionError(f"held-out family {holdout!r} leaked into training data: {leaked[:5]}")


def _mean_finite(values: Sequence[float]) -> float:
    """Mean over the families that have the metric (a one-job family has no siblings)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def leave_one_family_out(full: MeasuredSet, holdouts: Sequence[str] | None = None,
                         config: EvalConfig = EvalConfig(),
                         log: Callable[[str], None] | None = None,
                         progress: Callable[[str, int, int], None] | None = None) -> dict:
    """The report ``gogh predictors evaluate`` writes: per family, then the mean over families.

    ``progress(name, done, total)`` hears of each held-out family done (``gogh_flows.progress``).
    """
    holdouts = tuple(holdouts) if holdouts else full.families
    unknown = [h for h in holdouts if h not in full.families]
    if unknown:
        raise ValueError(f"unknown holdout family {unknown}; families in this data: {list(full.families)}")
    start = time.perf_counter()
    families = {}
    for i, h in enumerate(holdouts):
        families[h] = evaluate_holdout(full, h, config, log).metrics
        if progress is not None:
            progress("held-out families", i + 1, len(holdouts))
    mean = {
        m: {k: _mean_finite([families[h][m][k] for h in holdouts]) for k in METRICS} for m in METHODS
    }
    return {
        "families": families, "mean": mean,
        "config": {"p1": asdict(config.p1), "p2": asdict(config.p2), "repeats": config.repeats,
                   "seed": config.seed},
        "seconds": round(time.perf_counter() - start, 1),
    }
