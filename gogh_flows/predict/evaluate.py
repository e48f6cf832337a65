"""Leave-one-family-out evaluation of P1, P2 and the baselines (DESIGN section 7).

For each held-out family: P1 and P2 are trained *here* on the other families only (the
held-out family's jobs and every pair involving them are removed by
:meth:`MeasuredSet.without` before anything is fitted), then every method predicts the
held-out jobs. ``_Nobs`` metrics reveal N measured entries of a held-out job (isolated
entries for the isolated metrics, co-located entries for the co-located one), every choice
in turn (:func:`_reveals`), and score only the entries that stayed hidden.

Everything the evaluation chooses (P1's encoder, P2's epochs, the ensemble's weights, the
siblings decay, the intervals) is chosen per held-out family on its training families alone,
each predicted by models fitted without it (the inner split): see :func:`evaluate_holdout`.

``isolated_mape_1obs_siblings`` is the situation once a new family has run for a while and
another batch size of it arrives: one isolated entry of the held-out job is revealed, and
so are all isolated entries of the *other* held-out jobs (its siblings; the models were
still trained without the family). ``p2`` then is what the placement service does (P2 on the
job's own observation, then the siblings of :mod:`gogh_flows.predict.siblings`),
``matrix_completion`` fits the siblings' rows together with the known jobs (Gavel's way),
``nearest`` may pick a sibling as the nearest job, ``p1`` uses the job's own observation only.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from gogh_flows.predict.baselines import MatrixCompletion, NearestJob, PriorRow, shifted
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.encoding import job_summary
from gogh_flows.predict.ensemble import CASES as ENSEMBLE_CASES
from gogh_flows.predict.ensemble import SETTINGS as ENSEMBLE_SETTINGS
from gogh_flows.predict.ensemble import WEIGHTS as ENSEMBLE_WEIGHTS
from gogh_flows.predict.ensemble import Domain, setting_name
from gogh_flows.predict.ensemble import BaselineRows, Ensemble
from gogh_flows.predict.ensemble import roofline_log as job_roofline_log
from gogh_flows.predict.intervals import CASES as INTERVAL_CASES
from gogh_flows.predict.intervals import (
    Fold, Intervals, adjusted_level, capped_halfwidth, from_errors, leave_one_out_folds,
)
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import ENCODERS, KINDS, MEAN, P1Config, P1Model, train_p1
from gogh_flows.predict.p2 import P2Config, P2Model, train_p2
from gogh_flows.predict.siblings import DECAY, family_and_batch, sibling_transfer
from gogh_flows.workloads.features import WorkloadFeatures

METHODS = ("p1", "p2", "matrix_completion", "nearest", "p1_shifted", "type_mean", "partner_mean", "roofline",
           "ensemble")
#: what each method is, in the report's words
METHOD_NOTES = {
    "p1": "P1, trained without the family; an observation replaces only its own entry",
    "p2": "P1 refined by P2 with the observations",
    "matrix_completion": "Gavel's way: low-rank completion of the known jobs' matrix with the new row",
    "nearest": "the most similar known job by whole-step features, scaled",
    "p1_shifted": "P1 moved by the observed offset (the no-learning use of an observation)",
    "type_mean": "each entry's geometric mean over the training jobs; with an observation, the ratio "
                 "baseline (observation x geometric mean of t_b / t_a)",
    "partner_mean": "isolated as type_mean; a pair as the job's isolated x the training jobs' mean slowdown "
                    "next to that partner on that type",
    "roofline": "the job's roofline kernel time per type x one efficiency fitted on the training jobs, pairs "
                "by the partner-mean slowdown; with an observation, a parameter-free ratio",
    "ensemble": "what the product predicts with: P2 averaged in log space with the partner-mean row when nothing "
                "is observed, with the roofline ratio otherwise; P2's weight for each case (isolated or "
                "co-located, nothing or something observed) chosen on the inner split (training families "
                "only) from 0, 0.25, 0.5, 0.75, 1, with a reach (3, 4, 5 or none) beyond which a job (its "
                "distance to the nearest training job in P1's scaled input features) gets the baseline alone; "
                "P2's 'does not fit' kept",
}
#: the siblings step's weight decays (0: every sibling weighs the same) chosen from on the inner split
SIBLING_DECAYS = (0.0, 1.0, 2.0, 4.0, 8.0)
#: a prediction of "does not fit" (or none) on an entry that was measured counts as this
#: factor off (MAPE 100%, absolute log error log 10): a wrong out-of-memory verdict costs
MISS_FACTOR = 10.0
#: the co-located 1-observation protocol reveals, per GPU type, this many pair entries in
#: turn (evenly over the partners), each scored on the entries left hidden
PAIR_REVEALS_PER_TYPE = 8
# protocol -> (kind of entries revealed and scored, number revealed)
PROTOCOLS = {
    "isolated": ("isolated", 0), "colocated": ("pair", 0), "isolated_1obs": ("isolated", 1),
    "isolated_2obs": ("isolated", 2), "colocated_1obs": ("pair", 1),
}
#: per protocol: MAPE (secondary, kept for comparison with earlier reports), mean absolute
#: log error and median ratio error (primary), and how many measured entries got no prediction
STATS = ("mape", "male", "ratio", "misses")


def metric_name(protocol: str, stat: str) -> str:
    """``isolated_1obs`` + ``male`` -> ``isolated_male_1obs`` (the key layout of earlier reports)."""
    base, _, suffix = protocol.partition("_")
    return f"{base}_{stat}" + (f"_{suffix}" if suffix else "")


SCORE_METRICS = tuple(metric_name(p, s) for p in PROTOCOLS for s in STATS)
#: the metrics a summary table shows (the primary log metric, then MAPE)
HEADLINE = ("isolated_male", "isolated_male_1obs", "colocated_male_1obs", "isolated_mape", "isolated_mape_1obs",
            "colocated_mape_1obs")


@dataclass(frozen=True)
class EvalConfig:
    p1: P1Config = field(default_factory=P1Config)
    p2: P2Config = field(default_factory=P2Config)
    repeats: int = 5
    seed: int = 0
    #: P1 encoders to choose from per held-out family on the inner split (:func:`choose_encoder`);
    #: empty: ``p1.encoder``, fixed
    encoders: tuple[str, ...] = ()
    #: P2 epochs to choose from per held-out family on the inner split (:func:`choose_p2_epochs`);
    #: empty: ``p2.epochs``, fixed
    p2_epochs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        unknown = [e for e in self.encoders if e not in KINDS]
        if unknown:
            raise ValueError(f"P1 encoders to choose from must be among {KINDS}, got {unknown}")
        if self.repeats < 1:
            raise ValueError(f"repeats (random draws for the siblings metric) must be >= 1, got {self.repeats}")
        if any(int(e) < 1 for e in self.p2_epochs):
            raise ValueError(f"P2 epochs to choose from must be >= 1, got {list(self.p2_epochs)}")


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
        raise ValueError(
            f"the refiner learns from P1s trained with each model family left out in turn, which needs "
            f"measurements of at least two families; these have {len(data.families)} "
            f"({', '.join(data.families) or 'none'}): exclude fewer families (--exclude-family) or give more data")
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


def p1_family_errors(oof: np.ndarray, truth: np.ndarray, layout: Layout, data: MeasuredSet) -> dict[str, float]:
    """How far out-of-family P1 vectors (``oof``, one row per job of ``data``) are from ``truth``
    with nothing observed, per family: the mean absolute log error of its isolated entries and
    of its co-located ones, averaged. A "does not fit" on a measured entry counts as a miss."""
    is_pair = layout.is_pair()
    row = {n: i for i, n in enumerate(data.names)}
    out: dict[str, float] = {}
    for fam in data.families:
        rows = [row[n] for n in data.of_family(fam)]
        parts = []
        for mask in (~is_pair, is_pair):
            ale = np.concatenate([_entry_errors(oof[i], truth[i], mask)[0] for i in rows])
            if ale.size:
                parts.append(float(np.mean(ale)))
        if parts:
            out[fam] = float(np.mean(parts))
    return out


def p1_inner_error(oof: np.ndarray, truth: np.ndarray, layout: Layout, data: MeasuredSet) -> float:
    """:func:`p1_family_errors` averaged over the families, each weighing the same (as the report
    averages them)."""
    per_family = p1_family_errors(oof, truth, layout, data)
    return float(np.mean(list(per_family.values()))) if per_family else math.inf


#: the name of the "choose one encoder" procedure's own inner error in a report's ``p1_encoder``
CHOSEN_ONE = "one chosen (nested)"


def choose_encoder(train: MeasuredSet, layout: Layout, features: Mapping[str, WorkloadFeatures],
                   config: EvalConfig, log: Callable[[str], None] | None = None,
                   done: Callable[[], None] | None = None) -> tuple[str, np.ndarray, dict[str, float]]:
    """The P1 encoder for one held-out family, chosen on the training families only.

    Why: the default encoder was picked by the leave-one-family-out figures this report
    publishes, so a fixed default carries that selection into them. Here each candidate
    predicts every training family from a P1 trained without it (the out-of-family vectors P2
    is trained on anyway), and the least error (:func:`p1_inner_error`) wins; a tie goes to
    ``config.p1.encoder``.

    With :data:`~gogh_flows.predict.p1.MEAN` among the candidates (``--encoder inner``), two
    procedures compete, each judged on the inner split as a held-out family will meet it: the
    mean of the encoders (its inner error as is: nothing is chosen) against choosing one encoder,
    whose error is *nested* (each inner family predicted by the encoder that the other inner
    families choose, :data:`CHOSEN_ONE`), since the least of three inner errors is an optimistic
    figure for the encoder it picks; the mean must do strictly better (a tie goes to the single
    encoder, the simpler model). The mean's vectors are the mean of its members' (each
    member a P1 of that encoder, trained as that encoder's own candidate is).
    Returns (encoder, its out-of-family vectors, every candidate's error); ``done`` hears of
    each out-of-family P1 trained (``gogh predictors train``'s progress).
    """
    candidates = config.encoders or (config.p1.encoder,)
    singles = [e for e in candidates if e != MEAN]
    truth = layout.truth(train, train.names)
    oofs: dict[str, np.ndarray] = {}
    errors: dict[str, float] = {}
    per_family: dict[str, dict[str, float]] = {}
    for enc in singles:
        oofs[enc] = out_of_family_p1(train, layout, features, replace(config.p1, encoder=enc), log, done)
    if MEAN in candidates:
        missing = [e for e in ENCODERS if e not in oofs]
        for enc in missing:  # members the candidates did not name (kept out of the choice)
            oofs[enc] = out_of_family_p1(train, layout, features, replace(config.p1, encoder=enc), log, done)
        oofs[MEAN] = np.mean([oofs[e] for e in ENCODERS], axis=0)
        for enc in missing:
            del oofs[enc]
    if len(candidates) == 1:
        return candidates[0], oofs[candidates[0]], {candidates[0]: math.nan}
    for enc in candidates:
        per_family[enc] = p1_family_errors(oofs[enc], truth, layout, train)
        errors[enc] = float(np.mean(list(per_family[enc].values()))) if per_family[enc] else math.inf
    best_single = min(singles, key=lambda e: (errors[e], e != config.p1.encoder)) if singles else None
    chosen = best_single
    if MEAN in candidates:
        if len(singles) > 1:
            nested = []
            for fam in per_family[singles[0]]:
                others = [f for f in per_family[singles[0]] if f != fam]
                pick = min(singles, key=lambda e: (np.mean([per_family[e][f] for f in others]) if others else 0.0,
                                                   e != config.p1.encoder))
                nested.append(per_family[pick][fam])
            errors[CHOSEN_ONE] = float(np.mean(nested))
            one = errors[CHOSEN_ONE]
        else:
            one = errors[best_single] if best_single is not None else math.inf
        if errors[MEAN] < one:
            chosen = MEAN
    if log:
        log("  P1 encoder on the inner split: " + ", ".join(f"{e} {v:.3f}" for e, v in errors.items())
            + f" -> {chosen}")
    return chosen, oofs[chosen], errors


def _mape_entries(pred_log: np.ndarray, true_log: np.ndarray, where: np.ndarray) -> list[float]:
    """Absolute percentage errors of the measured entries in ``where``; a missing prediction counts 100%."""
    _, ape, _ = _entry_errors(pred_log, true_log, where)
    return list(ape)


def _entry_errors(pred_log: np.ndarray, true_log: np.ndarray,
                  where: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(absolute log error, absolute percentage error, missed) of every measured entry in ``where``.

    Every measured entry is scored, whatever the method predicted there: no prediction, or a
    "does not fit", counts as :data:`MISS_FACTOR` off, so a wrong out-of-memory verdict is
    never free and every method is scored on the same entries; ``missed`` marks those.
    """
    m = where & np.isfinite(true_log)
    pred, true = pred_log[m], true_log[m]
    ok = np.isfinite(pred)
    d = np.where(ok, pred - np.where(ok, true, 0.0), 0.0)
    ale = np.where(ok, np.abs(d), math.log(MISS_FACTOR))
    with np.errstate(over="ignore"):
        ape = np.where(ok, np.abs(np.expm1(d)), 1.0)
    return ale, ape, ~ok


def _reveals(known: np.ndarray, kind: str, n: int, n_gpus: int) -> list[tuple[int, ...]]:
    """Which entries to reveal, in turn, deterministically: every set of ``n`` isolated entries
    (so each GPU type is the observed one as often as any other), or per GPU type up to
    :data:`PAIR_REVEALS_PER_TYPE` pair entries spread over the partners."""
    if kind == "isolated":
        return list(itertools.combinations(known.tolist(), n))
    out: list[tuple[int, ...]] = []
    for g in range(n_gpus):
        on_g = [int(k) for k in known if (k - n_gpus) % n_gpus == g]
        if not on_g:
            continue
        picks = np.unique(np.linspace(0, len(on_g) - 1, min(len(on_g), PAIR_REVEALS_PER_TYPE)).round().astype(int))
        out += [(on_g[t],) for t in picks]
    return out


def _stats(ale: list[float], ape: list[float], misses: int) -> dict[str, float]:
    if not ale:
        return {"mape": math.nan, "male": math.nan, "ratio": math.nan, "misses": float(misses)}
    return {"mape": float(np.mean(ape)), "male": float(np.mean(ale)), "ratio": float(np.exp(np.median(ale))),
            "misses": float(misses)}


@dataclass
class Scores:
    """One method's figures on one set of held-out jobs: pooled over entries, per job, and
    (1 observation, isolated) per GPU type revealed."""

    pooled: dict[str, float]
    per_job: list[dict[str, float]]
    by_revealed_type: dict[str, float]
    #: protocol -> every scored entry's absolute log error (a miss: inf), for interval calibration
    abs_errors: dict[str, np.ndarray] = field(default_factory=dict)


def score_all(complete: Callable[[int, np.ndarray], np.ndarray], truth: np.ndarray, layout: Layout) -> Scores:
    """Every metric of one method; ``complete(i, observed_row)`` returns job i's full log row.

    Deterministic: each protocol reveals every choice of entries in turn (:func:`_reveals`)
    and scores the measured entries left hidden.
    """
    is_pair = layout.is_pair()
    g = layout.n_isolated
    pooled: dict[str, float] = {}
    per_job: list[dict[str, float]] = [{} for _ in range(len(truth))]
    by_type: dict[str, list[float]] = {gpu: [] for gpu in layout.gpus}
    abs_errors: dict[str, np.ndarray] = {}
    for protocol, (kind, n) in PROTOCOLS.items():
        raw: list[np.ndarray] = []
        pool_mask = is_pair if kind == "pair" else ~is_pair
        all_ale: list[float] = []
        all_ape: list[float] = []
        all_miss = 0
        for i, row in enumerate(truth):
            known = np.flatnonzero(np.isfinite(row) & pool_mask)
            job_ale: list[float] = []
            job_ape: list[float] = []
            miss = 0
            if n == 0:
                reveal_sets: list[tuple[int, ...]] = [()]
            elif len(known) <= n:
                reveal_sets = []
            else:
                reveal_sets = _reveals(known, kind, n, g)
            for shown in reveal_sets:
                obs = np.full_like(row, np.nan)
                hidden = pool_mask.copy()
                for k in shown:
                    obs[k] = row[k]
                    hidden[k] = False
                ale, ape, missed = _entry_errors(complete(i, obs), row, hidden)
                raw.append(np.where(missed, np.inf, ale))
                miss += int(missed.sum())
                job_ale += ale.tolist()
                job_ape += ape.tolist()
                if protocol == "isolated_1obs" and len(ale):
                    by_type[layout.gpus[shown[0]]].append(float(np.mean(ale)))
            for stat, value in _stats(job_ale, job_ape, miss).items():
                per_job[i][metric_name(protocol, stat)] = value
            all_ale += job_ale
            all_ape += job_ape
            all_miss += miss
        for stat, value in _stats(all_ale, all_ape, all_miss).items():
            pooled[metric_name(protocol, stat)] = value
        abs_errors[protocol] = np.concatenate(raw) if raw else np.empty(0)
    return Scores(pooled, per_job, {gpu: float(np.mean(v)) if v else math.nan for gpu, v in by_type.items()},
                  abs_errors)


#: interval levels calibrated on the inner split and checked on the held-out family
LEVELS = (0.8, 0.9)
#: the protocols whose intervals are reported
INTERVAL_PROTOCOLS = ("isolated", "isolated_1obs", "colocated_1obs")


def conformal_halfwidth(abs_errors: np.ndarray, level: float) -> float:
    """Split-conformal half-width in log space: the ceil((n+1) level)-th smallest calibration error.

    An interval ``pred x/÷ exp(halfwidth)`` then covers a new entry with probability at least
    ``level`` when the new job is exchangeable with the calibration jobs: here, a family the
    models never saw, like the inner families were.
    """
    errs = np.sort(np.asarray(abs_errors, dtype=float))
    if errs.size == 0:
        return math.nan
    k = math.ceil((errs.size + 1) * level)
    return float(errs[min(k, errs.size) - 1]) if k <= errs.size else math.inf


def inside(abs_errors: np.ndarray, halfwidth: float) -> tuple[int, int]:
    """(entries inside ``pred x/÷ exp(halfwidth)``, entries); a missing prediction (inf) never is.
    Too few calibration errors for the level give an infinite half-width, which covers every
    entry that has a prediction (and says nothing useful: the half-width is reported too)."""
    errs = np.asarray(abs_errors, dtype=float)
    if math.isnan(halfwidth):
        return 0, 0
    return int(np.sum(np.isfinite(errs) & (errs <= halfwidth))), int(errs.size)


def coverage(abs_errors: np.ndarray, halfwidth: float) -> float:
    """Share of entries inside the interval (:func:`inside`); NaN when there is none to count."""
    n_in, n = inside(abs_errors, halfwidth)
    return n_in / n if n else math.nan


def interval_name(protocol: str, what: str, level: float) -> str:
    """``isolated_1obs``, ``cover``, 0.9 -> ``isolated_cover90_1obs``."""
    return metric_name(protocol, f"{what}{round(100 * level)}")


INTERVAL_METRICS = tuple(interval_name(p, w, lv) for p in INTERVAL_PROTOCOLS for lv in LEVELS
                         for w in ("cover", "halfwidth"))
METRICS = SCORE_METRICS + INTERVAL_METRICS + ("isolated_mape_1obs_siblings",)


def score(complete: Callable[[int, np.ndarray], np.ndarray], truth: np.ndarray, layout: Layout) -> dict[str, float]:
    """The pooled figures of :func:`score_all`."""
    return score_all(complete, truth, layout).pooled


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
                  names: Sequence[str], family: Mapping[str, str | None], decay: float = DECAY) -> np.ndarray:
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
                             {n: m for n, m in measured.items() if m}, family, batch_size=sizes, decay=decay)
    out = refined_log.copy()
    for i, n in enumerate(names):
        with np.errstate(divide="ignore"):
            new = np.log(moved[n])
        out[i, :g] = np.where(np.isfinite(new) & np.isfinite(out[i, :g]), new, out[i, :g])
    return out


@dataclass
class HoldoutResult:
    family: str
    metrics: dict[str, dict[str, float]]  # method -> metric -> pooled over the family's entries
    seconds: float
    p1: P1Model | None = None
    p2: P2Model | None = None
    jobs: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # job -> method -> metric
    by_revealed_type: dict[str, dict[str, float]] = field(default_factory=dict)  # method -> gpu -> male
    covered: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  # method -> cover metric -> (in, n)
    #: method -> cover metric -> (in, n) of the interval at the level itself (no nested adjustment)
    covered_unadjusted: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    #: method -> protocol -> level ("80") -> {"quantile": the level asked of the pooled inner
    #: errors, "nested_cover": its coverage of the inner families in turn}
    interval_quantiles: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    #: P2's weight in the ensemble per case (:data:`ENSEMBLE_CASES`), chosen on the inner split
    ensemble_weights: dict[str, float] | None = None
    #: and the reach that came with it (inf: every job)
    ensemble_reaches: dict[str, float] | None = None
    #: and the baseline P2 was blended with per case (:data:`BASELINE_OF` values)
    ensemble_baselines: dict[str, str] | None = None
    #: P1's encoder, and every candidate's inner-split error (NaN when there was no choice)
    encoder: str | None = None
    encoder_errors: dict[str, float] = field(default_factory=dict)
    #: the siblings step's decay, and every candidate's inner-split siblings MAPE
    siblings_decay: float = DECAY
    siblings_errors: dict[str, float] = field(default_factory=dict)
    #: P2's epochs, and every candidate's inner-split error (empty when there was no choice)
    p2_epochs: int | None = None
    p2_epoch_errors: dict[str, float] = field(default_factory=dict)


def blend(p2_log: np.ndarray, roof_log: np.ndarray, w_iso: float, w_pair: float, n_gpus: int) -> np.ndarray:
    """P2 and roofline rows averaged in log space (P2's weight ``w_iso`` on the first ``n_gpus``
    isolated entries, ``w_pair`` on the pairs); where P2 says "does not fit", that stands."""
    w = np.full(np.shape(p2_log), float(w_pair))
    w[..., :n_gpus] = w_iso
    with np.errstate(invalid="ignore"):
        mixed = w * p2_log + (1 - w) * roof_log
    return np.where(np.isfinite(p2_log) & np.isfinite(roof_log), mixed, p2_log)


def build_methods(full: MeasuredSet, train: MeasuredSet, test: Sequence[str], layout: Layout,
                  p1_test: np.ndarray, p2: P2Model, seed: int,
                  ensemble: Mapping[str, float] | None = None,
                  reaches: Mapping[str, float] | None = None,
                  baselines: Mapping[str, str] | None = None) -> dict[str, Callable[[int, np.ndarray], np.ndarray]]:
    """Every method's ``complete(i, observed_row)`` for the jobs ``test``, fitted on ``train`` only.

    ``ensemble`` is P2's weight per case (:data:`ENSEMBLE_CASES`; default 0.5 each) in the
    ``ensemble`` method, what the product predicts with (:mod:`gogh_flows.predict.ensemble`):
    P2 averaged with the partner-mean row when nothing is observed, with the roofline ratio
    otherwise, unless ``baselines`` (case -> :data:`BASELINE_OF` value) names the partner-mean row
    for a case with an observation; ``reaches`` the distance from the training jobs beyond which
    a job gets the baseline alone (default: none). The inner split chooses both among the candidates
    ``prior@<setting>`` (P2 and the partner-mean row) and ``ensemble@<setting>`` (P2 and the
    roofline ratio), settings as :func:`~gogh_flows.predict.ensemble.setting_name` writes them."""
    features = dict(full.jobs)
    truth_train = layout.truth(train, train.names)
    mc = MatrixCompletion(seed=seed).fit(truth_train)
    train_summary = np.stack([job_summary(full.jobs[n]) for n in train.names])
    nearest = NearestJob(train_summary, truth_train, np.log([full.jobs[n].step_flops for n in train.names]))
    test_summary = [job_summary(features[n]) for n in test]
    test_flops = [math.log(features[n].step_flops) for n in test]
    g = len(layout.gpus)
    type_mean = PriorRow.type_mean(truth_train, len(test), g)
    partner_mean = PriorRow.partner_mean(truth_train, len(test), g)
    roof = PriorRow.roofline(truth_train, roofline_log(full, train.names), roofline_log(full, test), g)
    weights = dict.fromkeys(ENSEMBLE_CASES, 0.5) if ensemble is None else dict(ensemble)
    reach = dict(reaches or {})
    domain = Domain.fit(train_summary)
    far = [domain.distance(s) for s in test_summary]
    seen: dict[tuple[int, bytes], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def rows(i: int, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P2's, the roofline's and the partner-mean rows for one reveal, computed once for every
        candidate weight."""
        key = (i, np.asarray(obs).tobytes())
        if key not in seen:
            seen[key] = (p2.refine(p1_test[i], obs)[0], roof.complete(i, obs), partner_mean.complete(i, obs))
        return seen[key]

    def w(i: int, case: str) -> float:
        """P2's weight for test job ``i`` in ``case`` (0 beyond the case's reach)."""
        return 0.0 if far[i] > reach.get(case, math.inf) else weights[case]

    base = dict(baselines or {})

    def ensembled(i: int, obs: np.ndarray) -> np.ndarray:
        p2_row, roof_row, prior_row = rows(i, obs)
        if np.isfinite(obs).any():
            iso_base, co_base = (prior_row if base.get(c, "roofline") == "partner_mean" else roof_row
                                 for c in ("isolated_1obs", "colocated_1obs"))
            return blend(p2_row, np.concatenate([iso_base[:g], co_base[g:]]), w(i, "isolated_1obs"),
                         w(i, "colocated_1obs"), g)
        return blend(p2_row, prior_row, w(i, "isolated"), w(i, "colocated"), g)

    def candidate(kind: int, weight: float, within: float) -> Callable[[int, np.ndarray], np.ndarray]:
        """One inner-split candidate: P2 and the ``kind``-th row of :func:`rows` at one setting."""
        def complete(i: int, obs: np.ndarray) -> np.ndarray:
            x = 0.0 if far[i] > within else weight
            r = rows(i, obs)
            return blend(r[0], r[kind], x, x, g)
        return complete

    return {
        "p1": lambda i, obs: np.where(np.isfinite(obs), obs, p1_test[i]),
        "p2": lambda i, obs: p2.refine(p1_test[i], obs)[0],
        "matrix_completion": lambda i, obs: mc.complete(obs)[0],
        "nearest": lambda i, obs: nearest.complete(test_summary[i], test_flops[i], obs),
        "p1_shifted": lambda i, obs: shifted(p1_test[i], obs),
        "type_mean": type_mean.complete,
        "partner_mean": partner_mean.complete,
        "roofline": roof.complete,
        "ensemble": ensembled,
        **{f"ensemble@{setting_name(x, r)}": candidate(1, x, r) for x, r in ENSEMBLE_SETTINGS},
        **{f"prior@{setting_name(x, r)}": candidate(2, x, r) for x, r in ENSEMBLE_SETTINGS},
    }


def _capped_mean(abs_errors: np.ndarray) -> float:
    """Mean absolute log error with a miss (inf) counted :data:`MISS_FACTOR` off, as scored."""
    return float(np.mean(np.minimum(abs_errors, math.log(MISS_FACTOR))))


#: the inner-split candidates each ensemble case is chosen among (their name before ``@w``): with
#: nothing observed P2 against the partner-mean row; with an observation against the roofline
#: ratio or the partner-mean row (the ratio baseline alone, the training jobs' slowdowns in pairs)
ENSEMBLE_CANDIDATE = {"isolated": ("prior",), "colocated": ("prior",), "isolated_1obs": ("ensemble", "prior"),
                      "colocated_1obs": ("ensemble", "prior")}
#: the product's name (:data:`~gogh_flows.predict.ensemble.BASELINES`) of each candidate kind's baseline
BASELINE_OF = {"prior": "partner_mean", "ensemble": "roofline"}
#: every candidate method the inner split scores for the ensemble's choice
ENSEMBLE_CANDIDATES = tuple(f"{kind}@{setting_name(w, r)}" for kind in ("prior", "ensemble") for w, r in ENSEMBLE_SETTINGS)


def ensemble_candidate(case: str, weight: float, reach: float = math.inf, baseline: str | None = None) -> str:
    """The inner-split method whose errors are the ensemble's for ``case`` at ``weight`` (and
    ``reach``), blending P2 with ``baseline`` (a :data:`BASELINE_OF` value; default the case's first)."""
    kind = ENSEMBLE_CANDIDATE[case][0] if baseline is None else {v: k for k, v in BASELINE_OF.items()}[baseline]
    return f"{kind}@{setting_name(weight, reach)}"


def choose_ensemble(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]]
                    ) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]], dict[str, str]]:
    """P2's weight, reach and baseline per case (:data:`ENSEMBLE_CASES`) with the least error on
    the inner split, each inner family weighing the same (its mean absolute log error, averaged
    over the families, as the report averages them; ties to more P2, then to the wider reach,
    then to the case's first baseline); and every candidate's error (keyed by its setting, with
    its baseline in front where a case has two). A miss counts log 10, as the report scores it:
    left infinite, one "does not fit" of P2 (kept at every weight) made every candidate infinite
    and the tie always chose P2 alone. Settings whose candidate ``by_family`` lacks are not
    candidates."""
    chosen, errors = {}, {}
    for case in ENSEMBLE_CASES:
        chosen[case], errors[case] = _choose_case(by_family, case)
    return ({c: w for c, (_, w, _) in chosen.items()}, {c: r for c, (_, _, r) in chosen.items()}, errors,
            {c: b for c, (b, _, _) in chosen.items()})


def _choose_case(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]], case: str,
                 skip: Collection[int] = ()) -> tuple[tuple[str, float, float], dict[str, float]]:
    """:func:`choose_ensemble` for one case, without the inner families at the indices ``skip``:
    ((baseline, weight, reach), every candidate's error)."""
    def err(name: str) -> float:
        means = [_capped_mean(e) for k, e in enumerate(by_family[name][case]) if e.size and k not in skip]
        return float(np.mean(means)) if means else math.inf

    kinds = ENSEMBLE_CANDIDATE[case]
    options = [(k, w, r) for k in kinds for w, r in ENSEMBLE_SETTINGS
               if case in by_family.get(f"{k}@{setting_name(w, r)}", {})]

    def key(kind: str, w: float, r: float) -> str:
        return setting_name(w, r) if len(kinds) == 1 else f"{BASELINE_OF[kind]}@{setting_name(w, r)}"

    errors = {key(*o): err(f"{o[0]}@{setting_name(o[1], o[2])}") for o in options}
    best = min(options, key=lambda o: (errors[key(*o)], -o[1], -o[2], kinds.index(o[0])))
    return (BASELINE_OF[best[0]], best[1], best[2]), errors


def choice_aware_errors(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]], case: str) -> np.ndarray:
    """:func:`choice_aware_parts`, every family's errors together."""
    parts = choice_aware_parts(by_family, case)
    return np.concatenate(parts) if parts else np.empty(0)


def choice_aware_parts(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]], case: str,
                       skip: Collection[int] = ()) -> list[np.ndarray]:
    """The errors the ensemble's *choice* makes on unseen families, for its intervals, one array
    per inner family: each family's errors under the setting chosen on the other inner families
    (and without those at ``skip``, whose arrays are left empty).

    Calibrating on the chosen setting's own inner errors is optimistic: the setting won there
    because those errors were the smallest of 17 candidates, and a held-out family did not take
    part in that contest (docs/predictors.md measured 84.6% held-out coverage of a 90% interval
    so calibrated). Here every calibration family is out of the choice as well as out of the
    training, as the held-out family will be. With fewer than two inner families there is no
    choice to leave one out of, and the chosen setting's errors are returned."""
    skip = set(skip)
    (b, w, r), _ = _choose_case(by_family, case, skip)
    parts = by_family[ensemble_candidate(case, w, r, b)][case]
    if sum(1 for k, e in enumerate(parts) if e.size and k not in skip) < 2:
        return [np.empty(0) if k in skip else e for k, e in enumerate(parts)]
    out = []
    for k in range(len(parts)):
        if k in skip:
            out.append(np.empty(0))
            continue
        (bk, wk, rk), _ = _choose_case(by_family, case, skip | {k})
        out.append(by_family[ensemble_candidate(case, wk, rk, bk)][case][k])
    return out


def ensemble_folds(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]], case: str) -> list[Fold]:
    """The folds that set the ensemble's interval levels (:func:`~gogh_flows.predict.intervals.adjusted_level`):
    each inner family's choice-aware errors against the others' as they would be without it (their
    setting chosen without either), so the family judged takes no part in what calibrates it."""
    own = choice_aware_parts(by_family, case)
    return [(choice_aware_parts(by_family, case, skip=(k,)), own[k]) for k in range(len(own))]


def inner_family_errors(full: MeasuredSet, train: MeasuredSet, layout: Layout, oof: np.ndarray,
                        config: EvalConfig, methods: Sequence[str] = METHODS,
                        protocols: Sequence[str] = INTERVAL_PROTOCOLS,
                        decays: Sequence[float] = (),
                        trained: dict[str, P2Model] | None = None) -> dict[str, dict[str, list[np.ndarray]]]:
    """Every method's errors on the inner split, one array per training family: each training
    family in turn, predicted by methods fitted on the other training families (P1: its
    out-of-family vectors; P2: trained on the others' out-of-family vectors).

    With ``decays``, also the siblings metric of P2 plus the siblings step at each decay, as
    ``siblings@<decay>`` -> ``siblings`` -> one 1-element array per family that has siblings.
    ``trained`` (inner family -> P2 at ``config.p2``) is used where it has the family and filled
    where not, so a later pass at the same settings does not train the same P2s again."""
    out: dict[str, dict[str, list[np.ndarray]]] = {m: {p: [] for p in protocols} for m in methods}
    out.update({f"siblings@{d:g}": {"siblings": []} for d in decays})
    row = {n: i for i, n in enumerate(train.names)}
    for fam in train.families:
        rest = train.without([fam])
        names = train.of_family(fam)
        rest_rows = [row[n] for n in rest.names]
        p2 = trained.get(fam) if trained is not None else None
        if p2 is None:
            p2 = train_p2(layout, oof[rest_rows], layout.truth(rest, rest.names), config.p2)
            if trained is not None:
                trained[fam] = p2
        p1_fam = oof[[row[n] for n in names]]
        built = build_methods(full, rest, names, layout, p1_fam, p2, config.seed)
        truth = layout.truth(train, names)
        for name in methods:
            errs = score_all(built[name], truth, layout).abs_errors
            for p in protocols:
                out[name][p].append(errs[p])
        for d in decays if len(names) > 1 else ():
            fam_of = dict.fromkeys(names, fam)

            def complete(i: int, obs: np.ndarray, sibs: np.ndarray, d: float = d) -> np.ndarray:
                seen = sibs.copy()
                seen[i] = obs
                return with_siblings(p2.refine(p1_fam, seen), p1_fam, seen, layout, names, fam_of, d)[i]
            out[f"siblings@{d:g}"]["siblings"].append(
                np.array([score_siblings(complete, truth, layout, config.repeats, config.seed)]))
    return out


def choose_p2_epochs(full: MeasuredSet, train: MeasuredSet, layout: Layout, oof: np.ndarray,
                     config: EvalConfig, log: Callable[[str], None] | None = None,
                     ) -> tuple[int, dict[str, float], dict[str, P2Model]]:
    """P2's epochs for one held-out family, chosen on the training families only: each candidate
    trains P2 per inner family (on the others' out-of-family vectors) and is scored with one
    observation, isolated and co-located averaged per family, families equal; a tie goes to
    ``config.p2.epochs``. Returns (epochs, every candidate's error, the chosen epochs' P2 per inner
    family for the passes that follow); no choice, nothing trained, without candidates."""
    if not config.p2_epochs:
        return config.p2.epochs, {}, {}
    errors: dict[str, float] = {}
    models: dict[int, dict[str, P2Model]] = {}
    for epochs in config.p2_epochs:
        cfg = replace(config, p2=replace(config.p2, epochs=int(epochs)))
        models[int(epochs)] = {}
        inner = inner_family_errors(full, train, layout, oof, cfg, methods=("p2",),
                                    protocols=("isolated_1obs", "colocated_1obs"),
                                    trained=models[int(epochs)])["p2"]
        per_family = [float(np.mean([_capped_mean(e) for e in parts if e.size]))
                      for parts in zip(inner["isolated_1obs"], inner["colocated_1obs"])
                      if any(e.size for e in parts)]
        errors[str(int(epochs))] = float(np.mean(per_family)) if per_family else math.inf
    chosen = min(config.p2_epochs, key=lambda e: (errors[str(int(e))], int(e) != config.p2.epochs))
    if log:
        log("  P2 epochs on the inner split: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items())
            + f" -> {int(chosen)}")
    return int(chosen), errors, models[int(chosen)]


def choose_decay(by_family: Mapping[str, Mapping[str, Sequence[np.ndarray]]]) -> tuple[float, dict[str, float]]:
    """The siblings decay with the least siblings MAPE on the inner split (families equal; a tie,
    or no inner family with siblings, goes to the product's :data:`DECAY`)."""
    errors = {}
    for d in SIBLING_DECAYS:
        vals = [float(e[0]) for e in by_family.get(f"siblings@{d:g}", {}).get("siblings", []) if np.isfinite(e[0])]
        errors[f"{d:g}"] = float(np.mean(vals)) if vals else math.nan
    finite = {d: errors[f"{d:g}"] for d in SIBLING_DECAYS if math.isfinite(errors[f"{d:g}"])}
    if not finite:
        return DECAY, errors
    return min(finite, key=lambda d: (finite[d], d != DECAY)), errors


def calibrate_refiner(data: MeasuredSet, oof: np.ndarray, config: EvalConfig) -> tuple[Intervals, Ensemble]:
    """What the product predicts with besides a P2 trained on ``data``, from one inner split (every
    family of ``data`` predicted by a P2 trained on the others' out-of-family P1 vectors,
    ``oof``): the ensemble's weights (:mod:`gogh_flows.predict.ensemble`) and the intervals
    (:mod:`gogh_flows.predict.intervals`), the conformal quantiles of the absolute log errors of
    the ensemble's choice, per case (:func:`choice_aware_errors`), so the intervals are those of
    what is predicted, chosen as it was."""
    layout = Layout(data.gpus, data.names)
    inner = inner_family_errors(data, data, layout, oof, config, methods=ENSEMBLE_CANDIDATES,
                                protocols=tuple(INTERVAL_CASES))
    weights, reaches, errors, baselines = choose_ensemble(inner)
    where = (f"{len(data.families)} families left out in turn ({', '.join(data.families)}), {len(data.names)} job "
             f"types, GPU types {', '.join(data.gpus)}")
    intervals = from_errors({case: choice_aware_parts(inner, case) for case in INTERVAL_CASES},
                            f"split conformal on {where}, of the ensemble's choice (each family's errors under "
                            f"the setting chosen without it), each level's quantile raised until the families "
                            f"left out in turn are covered as promised", conformal_halfwidth,
                            {case: ensemble_folds(inner, case) for case in INTERVAL_CASES})
    rows = BaselineRows.fit(layout, layout.truth(data, data.names))
    domain = Domain.fit(np.stack([job_summary(data.jobs[n]) for n in data.names]))
    return intervals, Ensemble(weights, rows, f"weights, reaches and baselines chosen on {where}", errors, reaches,
                               domain, baselines)


def evaluate_holdout(full: MeasuredSet, holdout: str, config: EvalConfig = EvalConfig(),
                     log: Callable[[str], None] | None = None, intervals: bool = True) -> HoldoutResult:
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
    # P1's encoder, chosen on the inner split (never on this family); P2 learns from the
    # chosen encoder's out-of-family vectors, the errors of the P1 it will correct
    encoder, oof, encoder_errors = choose_encoder(train, layout, features, config, log)
    p1 = train_p1(train, replace(config.p1, encoder=encoder))
    p1_test = p1_vectors(p1, layout, test, features)
    truth_train = layout.truth(train, train.names)
    truth_test = layout.truth(full, test)
    # P2's epochs likewise; what follows (the ensemble, the intervals, the siblings decay) is
    # chosen with the P2 that is reported
    p2_epochs, p2_epoch_errors, inner_p2 = choose_p2_epochs(full, train, layout, oof, config, log)
    config = replace(config, p2=replace(config.p2, epochs=p2_epochs))
    p2 = train_p2(layout, oof, truth_train, config.p2)
    # The ensemble's weights, chosen on the inner split (never on this family); the same pass
    # gives every method's inner errors for the intervals.
    inner = inner_family_errors(full, train, layout, oof, config,
                                methods=(*(m for m in METHODS if m != "ensemble"), *ENSEMBLE_CANDIDATES) if intervals
                                else ENSEMBLE_CANDIDATES,
                                protocols=tuple(dict.fromkeys((*INTERVAL_PROTOCOLS, *ENSEMBLE_CASES))),
                                decays=SIBLING_DECAYS if len(test) > 1 else (), trained=inner_p2)
    decay, decay_errors = choose_decay(inner)
    inner = {k: v for k, v in inner.items() if not k.startswith("siblings@")}
    weights, reaches, _, baselines = choose_ensemble(inner)
    # each method's calibration errors per inner family (the ensemble's: those of its choice)
    calib: dict[str, dict[str, list[np.ndarray]]] = {}
    if intervals:
        calib = {m: {p: list(inner[m][p]) for p in INTERVAL_PROTOCOLS} for m in METHODS if m != "ensemble"}
        calib["ensemble"] = {p: choice_aware_parts(inner, p) for p in INTERVAL_PROTOCOLS}
    methods = build_methods(full, train, test, layout, p1_test, p2, config.seed, ensemble=weights, reaches=reaches,
                            baselines=baselines)
    scores = {name: score_all(methods[name], truth_test, layout) for name in METHODS}
    metrics = {name: {**dict(sc.pooled), **dict.fromkeys(INTERVAL_METRICS, math.nan)} for name, sc in scores.items()}
    covered: dict[str, dict[str, tuple[int, int]]] = {name: {} for name in scores}
    # what the interval at the level itself would have covered, for the report (no choice sees it)
    covered_unadjusted: dict[str, dict[str, tuple[int, int]]] = {name: {} for name in scores}
    quantiles: dict[str, dict[str, dict[str, dict[str, float]]]] = {name: {} for name in scores}
    if intervals:
        for name, sc in scores.items():
            for p in INTERVAL_PROTOCOLS:
                folds = (ensemble_folds(inner, p) if name == "ensemble" else leave_one_out_folds(calib[name][p]))
                errs = np.concatenate(calib[name][p]) if calib[name][p] else np.empty(0)
                quantiles[name][p] = {}
                for level in LEVELS:
                    q, nested = adjusted_level(folds, level, conformal_halfwidth)
                    quantiles[name][p][f"{round(100 * level)}"] = {"quantile": q, "nested_cover": nested}
                    covered_unadjusted[name][interval_name(p, "cover", level)] = inside(
                        sc.abs_errors[p], capped_halfwidth(errs, level, conformal_halfwidth))
                    half = capped_halfwidth(errs, q, conformal_halfwidth)  # as the product stores it
                    n_in, n = inside(sc.abs_errors[p], half)
                    metrics[name][interval_name(p, "halfwidth", level)] = half
                    metrics[name][interval_name(p, "cover", level)] = n_in / n if n else math.nan
                    covered[name][interval_name(p, "cover", level)] = (n_in, n)
    test_summary = [job_summary(full.jobs[n]) for n in test]
    test_flops = [math.log(full.jobs[n].step_flops) for n in test]
    fam = {n: holdout for n in test}

    def p2_siblings(i: int, obs: np.ndarray, sibs: np.ndarray) -> np.ndarray:
        seen = sibs.copy()
        seen[i] = obs
        refined = p2.refine(p1_test, seen)
        return with_siblings(refined, p1_test, seen, layout, test, fam, decay)[i]

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
    for name in METHODS:
        fn = together.get(name)
        metrics[name]["isolated_mape_1obs_siblings"] = (
            score_siblings(fn, truth_test, layout, config.repeats, config.seed) if fn is not None else math.nan)
    jobs = {n: {name: sc.per_job[i] for name, sc in scores.items()} for i, n in enumerate(test)}
    secs = time.perf_counter() - start
    if log:
        log(f"{holdout}: " + ", ".join(
            f"{m} iso {v['isolated_male']:.3f} iso1 {v['isolated_male_1obs']:.3f} co1 {v['colocated_male_1obs']:.3f}"
            for m, v in metrics.items()) + f" (mean absolute log error; {secs:.0f} s)")
    return HoldoutResult(holdout, metrics, secs, p1, p2, jobs=jobs,
                         by_revealed_type={name: sc.by_revealed_type for name, sc in scores.items()},
                         covered=covered, covered_unadjusted=covered_unadjusted, interval_quantiles=quantiles,
                         ensemble_weights=weights, ensemble_reaches=reaches,
                         ensemble_baselines=baselines, encoder=encoder,
                         encoder_errors=encoder_errors, siblings_decay=decay, siblings_errors=decay_errors,
                         p2_epochs=p2_epochs, p2_epoch_errors=p2_epoch_errors)


def roofline_log(data: MeasuredSet, names: Sequence[str]) -> np.ndarray:
    """``[J, G]`` log roofline throughput (1 / kernel time) of each job on each GPU type of ``data``."""
    return np.array([[job_roofline_log(data.jobs[n], g) for g in data.gpus] for n in names])


def in_sample_metrics(p1: P1Model, p2: P2Model, data: MeasuredSet, layout: Layout,
                      oof_p1: np.ndarray) -> dict[str, float]:
    """Training-set figures for a model card: P1's fit, and P2's correction of out-of-family P1.

    Not a measure of generalisation (that is :func:`leave_one_family_out`); it shows the
    models learned what they were given.
    """
    truth = layout.truth(data, data.names)
    own = p1_vectors(p1, layout, data.names, dict(data.jobs))
    s_p1 = score(lambda i, obs: np.where(np.isfinite(obs), obs, own[i]), truth, layout)
    s_oof = score(lambda i, obs: np.where(np.isfinite(obs), obs, oof_p1[i]), truth, layout)
    s_p2 = score(lambda i, obs: p2.refine(oof_p1[i], obs)[0], truth, layout)
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
    holdouts = tuple(full.family_named(h, what="holdout family") for h in holdouts) if holdouts else full.families
    start = time.perf_counter()
    families, jobs, by_type, weights, reaches, encoders, decays, p2_epochs = {}, {}, {}, {}, {}, {}, {}, {}
    baselines: dict[str, dict[str, str]] = {}
    counts: dict[str, dict[str, list[int]]] = {m: {} for m in METHODS}
    plain_counts: dict[str, dict[str, list[int]]] = {m: {} for m in METHODS}
    quantiles: dict[str, dict] = {}
    if progress is not None:  # the clock starts now, not when the first family is done
        progress("held-out families", 0, len(holdouts))
    for i, h in enumerate(holdouts):
        result = evaluate_holdout(full, h, config, log)
        families[h] = result.metrics
        weights[h] = dict(result.ensemble_weights or {})
        reaches[h] = {c: (r if math.isfinite(r) else None) for c, r in (result.ensemble_reaches or {}).items()}
        baselines[h] = dict(result.ensemble_baselines or {})
        encoders[h] = {"chosen": result.encoder, "inner_male": result.encoder_errors}
        p2_epochs[h] = {"chosen": result.p2_epochs, "inner_male": result.p2_epoch_errors}
        if len(full.of_family(h)) > 1:
            decays[h] = {"chosen": result.siblings_decay, "inner_mape": result.siblings_errors}
        jobs.update(result.jobs)
        by_type[h] = result.by_revealed_type
        for m, by in result.covered.items():
            for k, (inside, n) in by.items():
                c = counts[m].setdefault(k, [0, 0])
                c[0] += inside
                c[1] += n
        for m, by in result.covered_unadjusted.items():
            for k, (inside, n) in by.items():
                c = plain_counts[m].setdefault(k, [0, 0])
                c[0] += inside
                c[1] += n
        quantiles[h] = result.interval_quantiles
        if progress is not None:
            progress("held-out families", i + 1, len(holdouts))
    job_metrics = SCORE_METRICS
    pooled_coverage = {m: {k: (inside / n if n else math.nan) for k, (inside, n) in by.items()}
                       for m, by in counts.items()}
    pooled_plain = {m: {k: (inside / n if n else math.nan) for k, (inside, n) in by.items()}
                    for m, by in plain_counts.items()}
    mean = {
        m: {k: _mean_finite([families[h][m][k] for h in holdouts]) for k in METRICS} for m in METHODS
    }
    mean_over_jobs = {
        m: {k: _mean_finite([jobs[j][m][k] for j in jobs]) for k in job_metrics} for m in METHODS
    }
    revealed = {m: {g: _mean_finite([by_type[h][m][g] for h in holdouts]) for g in full.gpus} for m in METHODS}
    return {
        "families": families, "mean": mean, "mean_over_jobs": mean_over_jobs, "jobs": jobs,
        "coverage_pooled": pooled_coverage, "coverage_pooled_unadjusted": pooled_plain,
        "interval_quantile": quantiles,
        "ensemble_p2_weight": weights,
        "ensemble_p2_reach": reaches, "ensemble_baseline": baselines, "p1_encoder": encoders,
        "siblings_decay": decays, "p2_epochs": p2_epochs,
        "isolated_male_1obs_by_revealed_type": revealed,
        "methods": dict(METHOD_NOTES),
        "protocol": {
            "reveals": "deterministic: every set of 1 (2) isolated entries of a held-out job in turn; per GPU type up to "
                       f"{PAIR_REVEALS_PER_TYPE} pair entries spread over the partners; the measured entries left "
                       "hidden are scored",
            "misses": f"a measured entry a method predicts nothing for (or 'does not fit') counts {MISS_FACTOR:g}x off "
                      "(MAPE 100%)",
            "metrics": "male = mean absolute log error, ratio = median of max(pred/true, true/pred), mape = mean "
                       "absolute percentage error (secondary); 'mean' averages families, 'mean_over_jobs' job types",
            "intervals": "split conformal: halfwidthNN = a quantile of the method's absolute log errors on the "
                         "inner split (each training family predicted by the method fitted on the other training "
                         "families; the ensemble's under the setting chosen without the family): the NN% quantile "
                         "(finite-sample corrected) raised in steps of 0.01 (to at most 0.99, else the largest "
                         "error) until its nested coverage (each inner family inside the interval the other inner "
                         "families calibrate) reaches NN% (interval_quantile: the quantile and its nested "
                         "coverage); coverNN = share of the held-out family's scored entries within "
                         "pred x/÷ exp(halfwidthNN); coverage_pooled pools every held-out entry; "
                         "coverage_pooled_unadjusted: the same at the NN% quantile itself (reported, not chosen on)",
            "selection": "chosen on the inner split (the training families, each predicted by models fitted without "
                         "it), never on the held-out family: the ensemble's weights, the intervals and, when "
                         "config.encoders names several, P1's encoder (least mean absolute log error with nothing "
                         "observed, isolated and co-located averaged per family, families equal; with 'mean' among "
                         "them, the mean of the encoders against the one chosen, that choice scored nested, each "
                         "inner family by the encoder the others choose; p1_encoder); when "
                         "config.p2_epochs names several, P2's epochs (least error with one observation, isolated "
                         "and co-located averaged per family; p2_epochs); for a "
                         "family with siblings, the siblings step's decay (least isolated_mape_1obs_siblings of P2 "
                         "plus the siblings step on the inner families that have siblings; siblings_decay). "
                         "config.p1.encoder and config.p2.epochs are the values that win ties",
        },
        "config": {"p1": asdict(config.p1), "p2": asdict(config.p2), "repeats": config.repeats,
                   "seed": config.seed, "encoders": list(config.encoders or (config.p1.encoder,)),
                   "p2_epochs": list(config.p2_epochs or (config.p2.epochs,))},
        "seconds": round(time.perf_counter() - start, 1),
    }
