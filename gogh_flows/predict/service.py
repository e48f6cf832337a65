"""What the placement layer calls: predicted throughput tables, refined by what was measured.

Why a table: the optimiser, the simulator and the policies all read a
:class:`~gogh_flows.truth.table.ThroughputTable`. The predictor therefore answers in the
same type, so a placement can run on measured truth, synthetic truth or predictions
without knowing which.

How an entry is filled, in order of trust:

1. **observed** -- a logged measurement of exactly that entry (mean of log throughput
   when it was measured several times); an observed 0.0 means "did not run there";
2. **siblings** -- with a refiner, an isolated entry the job was not measured on, where
   measured job types of the same zoo family (the model at other batch sizes) show how
   the predictors err for this family (:mod:`gogh_flows.predict.siblings`);
3. **refined** -- P2's correction of P1, for the GPU types and partners in P2's layout,
   using every observation of the job (on any type, with any partner);
4. **P1** -- everything else. A pair whose partner is outside P2's layout keeps P1's
   slowdown ratio, applied to the job's (refined) isolated value, so one observation of
   a job moves all of its entries consistently.

A refiner trained with an ensemble (``gogh predictors train`` stores one) then averages
steps 3-4 with a baseline that needs no training, in log space, by weights chosen on unseen
families (:mod:`gogh_flows.predict.ensemble`): the per-type mean for a job with nothing
measured, the roofline ratio shifted to the job's measurements otherwise; a job farther from
every training job than the ensemble's reach gets that baseline alone. On Gavel's data that
average beats P2 alone (docs/predictors.md).

A predicted entry is 0.0 where the memory estimate says the job (or the pair) does not
fit, as in measured tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl

from gogh_flows.catalog import get_gpu_type
from gogh_flows.predict.intervals import Intervals, NoIntervalsError
from gogh_flows.predict.data import MeasuredSet, UnknownJobFeaturesError, zoo_jobs
from gogh_flows.predict.ensemble import Ensemble
from gogh_flows.predict.evaluate import out_of_family_p1, p1_vectors
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Model, Prediction
from gogh_flows.predict.p2 import TRUST_SCALES, P2Config, P2Model, train_p2
from gogh_flows.predict.siblings import family_and_batch, sibling_transfer
from gogh_flows.predict.site import SiteOffsets
from gogh_flows.truth.table import SCHEMA, ThroughputTable
from gogh_flows.workloads.features import WorkloadFeatures

OBSERVATION_SCHEMA: dict[str, pl.DataType] = {
    "job_type": pl.String(), "gpu_type": pl.String(), "partner": pl.String(), "throughput": pl.Float64(),
}


def observations_frame(rows: Iterable[Mapping] | pl.DataFrame = ()) -> pl.DataFrame:
    """Measurements as the predictors read them: one row per (job, GPU type, partner or null).

    ``throughput`` is the job's own steps/s (alone when ``partner`` is null); 0.0 records
    that it did not run there. Rows may repeat an entry (several runs): they are averaged
    in log space when used.
    """
    if isinstance(rows, pl.DataFrame):
        missing = [c for c in ("job_type", "gpu_type", "throughput") if c not in rows.columns]
        if missing:
            raise ValueError(f"observations lack column(s) {missing}; expected {list(OBSERVATION_SCHEMA)}")
        if "partner" not in rows.columns:
            rows = rows.with_columns(partner=pl.lit(None, dtype=pl.String))
        frame = rows.select(list(OBSERVATION_SCHEMA)).cast(OBSERVATION_SCHEMA)  # type: ignore[arg-type]
    else:
        recs = []
        for i, r in enumerate(rows):
            missing = [k for k in ("job_type", "gpu_type", "throughput") if r.get(k) is None]
            if missing:
                raise ValueError(f"observation {i} lacks {missing}: {dict(r)!r}")
            recs.append({k: r.get(k) for k in OBSERVATION_SCHEMA})
        frame = pl.DataFrame(recs, schema=OBSERVATION_SCHEMA)
    bad = frame.filter(
        pl.col("job_type").is_null() | pl.col("gpu_type").is_null() | pl.col("throughput").is_null()
        | ~pl.col("throughput").is_finite() | (pl.col("throughput") < 0)
    )
    if bad.height:
        raise ValueError(
            f"observation throughput must be a finite number >= 0 with a job type and GPU type; "
            f"got {bad.row(0, named=True)}"
        )
    return frame


class _Observed(dict):
    """(job, partner, gpu) -> mean log throughput (-inf: did not run there), plus the value to
    return for the entry: the measurement itself when there is one, else the geometric mean."""

    def __init__(self, logs: dict, values: dict) -> None:
        super().__init__(logs)
        self.values = values


def _aggregate(obs: pl.DataFrame) -> _Observed:
    if obs.height == 0:
        return _Observed({}, {})
    g = (
        obs.with_columns(lt=pl.when(pl.col("throughput") > 0).then(pl.col("throughput").log()))
        .group_by("job_type", "partner", "gpu_type")
        .agg(lt=pl.col("lt").mean(), ran=(pl.col("throughput") > 0).any(), n=pl.len(),
             first=pl.col("throughput").first())
    )
    logs, values = {}, {}
    for j, p, gt, lt, ran, n, first in g.iter_rows():
        logs[(j, p, gt)] = lt if ran else -math.inf
        values[(j, p, gt)] = first if n == 1 or not ran else math.exp(lt)
    return _Observed(logs, values)


def _stored(p2: P2Model | None, key: str, parse: Callable[[Any], Any], *, empty_is_none: bool = True) -> Any:
    """``trained_on[key]`` of the refiner, parsed (None when it has none)."""
    d = (p2.trained_on or {}).get(key) if p2 is not None else None
    if d is None or (empty_is_none and not d):
        return None
    try:
        return parse(d)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        why = f"it lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"the refiner's stored {key.replace('_', ' ')} (trained_on[{key!r}]) cannot be read: "
                         f"{why}; re-run `gogh predictors calibrate --model DIR` to write it again, or retrain "
                         "the refiner") from None


def stored_records(p2: P2Model | None) -> tuple[Ensemble | None, SiteOffsets, Intervals | None]:
    """The refiner's records beside its weights (its ensemble, site offsets and intervals), each
    checked: a ``ValueError`` that names the record for one that is malformed or out of range.
    Its weights' hash does not cover them, so a model read back is checked here."""
    site = _stored(p2, SITE_KEY, SiteOffsets.from_dict)  # not `or`: offsets of 0 are still a record
    return (_stored(p2, "ensemble", Ensemble.from_dict, empty_is_none=False),
            SiteOffsets() if site is None else site, _stored(p2, "intervals", Intervals.from_dict))


class ThroughputPredictor:
    """P1 (+ optional P2) behind a table-valued call; cheap enough to run at every placement."""

    def __init__(self, p1: P1Model, p2: P2Model | None = None) -> None:
        if not isinstance(p1, P1Model):
            raise TypeError(f"p1 must be a P1Model, got {type(p1).__name__}")
        if p2 is not None and not isinstance(p2, P2Model):
            raise TypeError(f"p2 must be a P2Model or None, got {type(p2).__name__}")
        self.p1 = p1
        self.p2 = p2
        self._zoo: dict[str, WorkloadFeatures | None] = {}
        self._priors: dict[tuple[str, tuple[str, ...]], np.ndarray | None] = {}
        # checked here: a record out of range failed every placement later, where nothing could
        # fall back (a security review); the intervals are read again when asked (a caller may add them)
        self.ensemble, self.site, _ = stored_records(p2)

    # -- public ------------------------------------------------------------------------------
    @property
    def intervals(self) -> Intervals | None:
        """The refiner's calibrated intervals (``gogh predictors train`` stores them), or None."""
        return _stored(self.p2, "intervals", Intervals.from_dict)

    def predict_table(self, jobs: Mapping[str, WorkloadFeatures], gpu_types: Sequence[str],
                      observations: pl.DataFrame | None = None, risk: float | None = None) -> ThroughputTable:
        """Isolated rows for every job x type, pair rows for every pair of ``jobs`` (a job with
        itself included) x type; scale factor 1.

        ``risk``: the lower end of the refiner's ``risk`` interval instead of the point
        prediction (:mod:`gogh_flows.predict.intervals`): wide for a job with nothing measured,
        narrower once any of its entries has been; a measured entry stays its measurement.
        """
        return self.predict_tables(jobs, gpu_types, observations, risk)[1]

    def predict_tables(self, jobs: Mapping[str, WorkloadFeatures], gpu_types: Sequence[str],
                       observations: pl.DataFrame | None = None,
                       risk: float | None = None) -> tuple[ThroughputTable, ThroughputTable]:
        """(point predictions, what :meth:`predict_table` plans with at ``risk``) from one
        prediction: a placement at a risk level decides on the bounds and records the point
        prediction of the slot it chose. Without ``risk`` both are the same table."""
        names = tuple(jobs)
        if not names:
            raise ValueError("predict_table needs at least one job")
        gpus = tuple(dict.fromkeys(gpu_types))
        if not gpus:
            raise ValueError("predict_table needs at least one GPU type")
        for g in gpus:
            get_gpu_type(g)  # unknown type -> error naming it
        obs = _aggregate(observations_frame(observations) if observations is not None else observations_frame())
        iso, pair = self._predict(dict(jobs), gpus, obs)
        activities = _activities(jobs, names, gpus)
        point = _table(names, gpus, iso, pair, activities)
        if risk is None:
            return point, point
        return point, _table(names, gpus, *self._lower_bounds(names, gpus, obs, iso, pair, risk), activities)

    def _lower_bounds(self, names: tuple[str, ...], gpus: tuple[str, ...], obs: _Observed, iso: np.ndarray,
                      pair: np.ndarray, risk: float) -> tuple[np.ndarray, np.ndarray]:
        intervals = self.intervals
        if intervals is None:
            raise NoIntervalsError(
                f"risk level {risk:g} asks for the refiner's calibrated intervals, and this predictor has none "
                f"({'no refiner' if self.p2 is None else 'its P2 was trained before intervals were calibrated'}); "
                "train it with `gogh predictors train` (or add them with `gogh predictors calibrate`), or set "
                "PlacementPolicy(risk_level=None) to plan with the point predictions")
        # what counts as measured is what the ensemble and P2 count: a throughput, not "did not run"
        measured = {j for (j, _, _), lt in obs.items() if math.isfinite(lt)}
        seen = set(obs.values)
        iso, pair = iso.copy(), pair.copy()
        for i, j in enumerate(names):
            known = j in measured
            shrink_iso = math.exp(-intervals.halfwidth("isolated_1obs" if known else "isolated", risk))
            shrink_pair = math.exp(-intervals.halfwidth("colocated_1obs" if known else "colocated", risk))
            for c, g in enumerate(gpus):
                if (j, None, g) not in seen:
                    iso[i, c] *= shrink_iso
                for k, p in enumerate(names):
                    if (j, p, g) not in seen:
                        pair[i, k, c] *= shrink_pair
        return iso, pair

    def refine_error(self, features: Mapping[str, WorkloadFeatures], train_obs: pl.DataFrame,
                     test_obs: pl.DataFrame, *, hide_same_entry: bool = True) -> dict:
        """MAPE of every test observation predicted from P1 + P2 with ``train_obs`` only.

        What the retraining flow compares a new refiner against the champion with.
        ``hide_same_entry`` (default): each test entry (job, GPU type, partner) is predicted
        without the training measurements of that same entry, as a placement predicts an entry
        not yet measured there. Otherwise an entry measured before is "predicted" as its own
        earlier measurement by any refiner (observed entries win), and the comparison measures
        only the runs' own variation: on the demo's fleet every held-out run repeated an entry
        of the training runs, and retraining was judged on that noise.
        """
        test = observations_frame(test_obs).filter(pl.col("throughput") > 0)
        out = {"mape": math.nan, "n": 0, "isolated_mape": math.nan, "isolated_n": 0,
               "colocated_mape": math.nan, "colocated_n": 0}
        if test.height == 0:
            return out
        needed = set(test["job_type"].to_list()) | {p for p in test["partner"].to_list() if p is not None}
        missing = sorted(n for n in needed if n not in features)
        if missing:
            raise ValueError(f"refine_error: no features for job type(s) {missing}; pass them in `features`")
        gpus = tuple(sorted(set(test["gpu_type"].to_list())))
        names = tuple(sorted(needed))
        train = observations_frame(train_obs)
        jobs = {n: features[n] for n in names}
        ji = {n: i for i, n in enumerate(names)}
        gi = {g: i for i, g in enumerate(gpus)}
        errs: dict[bool, list[float]] = {False: [], True: []}
        if hide_same_entry:
            groups = test.partition_by("job_type", "gpu_type", "partner", as_dict=True, maintain_order=True)
        else:
            groups = {None: test}
        for key, rows in groups.items():
            seen = train
            if key is not None:
                j, g, p = key
                same = (pl.col("job_type") == j) & (pl.col("gpu_type") == g) & (
                    pl.col("partner").is_null() if p is None else pl.col("partner") == p)
                seen = train.filter(~same)
            iso, pair = self._predict(jobs, gpus, _aggregate(seen))
            for j, g, p, t in rows.iter_rows():
                pred = iso[ji[j], gi[g]] if p is None else pair[ji[j], ji[p], gi[g]]
                errs[p is not None].append(abs(pred - t) / t)
        both = errs[False] + errs[True]
        out.update(mape=float(np.mean(both)), n=len(both))
        if errs[False]:
            out.update(isolated_mape=float(np.mean(errs[False])), isolated_n=len(errs[False]))
        if errs[True]:
            out.update(colocated_mape=float(np.mean(errs[True])), colocated_n=len(errs[True]))
        return out

    # -- internals ---------------------------------------------------------------------------
    def _partner_features(self, jobs: Mapping[str, WorkloadFeatures]) -> dict[str, WorkloadFeatures]:
        """P2's layout partners with features: the given jobs first, else the zoo (cached)."""
        out: dict[str, WorkloadFeatures] = {}
        for n in self.p2.layout.partners if self.p2 is not None else ():
            feats = jobs[n] if n in jobs else self._zoo_features(n)
            if feats is not None:  # None: a logged job of another team, its column stays unknown
                out[n] = feats
        return out

    def _zoo_features(self, job_type: str) -> WorkloadFeatures | None:
        """A zoo job type's features rebuilt from its name (cached); None for any other name."""
        if job_type not in self._zoo:
            try:
                self._zoo[job_type] = zoo_jobs([job_type])[job_type]
            except UnknownJobFeaturesError:
                self._zoo[job_type] = None
        return self._zoo[job_type]

    def _predict(self, jobs: dict[str, WorkloadFeatures], gpus: tuple[str, ...],
                 obs: _Observed) -> tuple[np.ndarray, np.ndarray]:
        """``iso [J, G]`` and ``pair [J, J, G]`` steps/s for the requested jobs and types."""
        names = tuple(jobs)
        J, G = len(names), len(gpus)
        extra_p = self._partner_features(jobs)
        partners = dict(jobs)
        for n, w in extra_p.items():
            partners.setdefault(n, w)
        lay = self.p2.layout if self.p2 is not None else None
        all_gpus = gpus + tuple(g for g in (lay.gpus if lay else ()) if g not in gpus)
        pred = self.p1.predict(jobs, all_gpus, partners=partners)
        iso = pred.isolated[:, :G].astype(np.float64)  # float64: observed values come back exactly
        pair = pred.pair[:, :J, :G].astype(np.float64)  # partners start with the jobs themselves, in order
        if self.p2 is not None:
            self._refine(names, gpus, all_gpus, pred, obs, iso, pair)
            if self.ensemble is not None:
                self.ensemble.blend(names, jobs, gpus, obs, iso, pair)
            moved = self._siblings(names, gpus, pred.isolated[:, :G].astype(np.float64), obs, iso, pair)
            if self.site:
                self._site(names, gpus, obs, iso, pair, skip=moved)
        # observed entries win, whatever the models say
        row = {n: i for i, n in enumerate(names)}
        col = {g: i for i, g in enumerate(gpus)}
        for (j, p, g), val in obs.values.items():
            if j not in row or g not in col:
                continue
            if p is None:
                iso[row[j], col[g]] = val
            elif p in row:
                pair[row[j], row[p], col[g]] = val
        return iso, pair

    def _site(self, names: tuple[str, ...], gpus: tuple[str, ...], obs: _Observed, iso: np.ndarray,
              pair: np.ndarray, skip: frozenset[str] = frozenset()) -> None:
        """Move each job's rows by this fleet's per-type offsets, by what was measured of it; in
        place. ``skip``: jobs their measured siblings moved (that carried the site's difference)."""
        seen: dict[str, list[str]] = {}
        for (j, _, g), v in obs.items():
            if math.isfinite(v):
                seen.setdefault(j, []).append(g)
        for i, j in enumerate(names):
            if j in skip:
                continue
            f = self.site.factors(gpus, seen.get(j, ()))
            iso[i] *= f
            pair[i] *= f[None, :]

    def _siblings(self, names: tuple[str, ...], gpus: tuple[str, ...], p1_iso: np.ndarray,
                  obs: _Observed, iso: np.ndarray, pair: np.ndarray) -> frozenset[str]:
        """Move unmeasured isolated entries (and their pairs) by what measured job types of the
        same zoo family show (:mod:`gogh_flows.predict.siblings`); in place. Returns the jobs moved."""
        col = {g: i for i, g in enumerate(gpus)}
        measured: dict[str, dict[int, float]] = {}
        for (j, p, g), v in obs.items():
            if p is None and g in col and math.isfinite(v):
                measured.setdefault(j, {})[col[g]] = math.exp(v)
        if not measured:
            return frozenset()
        kin = {n: family_and_batch(n) for n in (*names, *measured)}
        family = {n: k[0] for n, k in kin.items()}
        takers = [n for n in names if family[n] is not None
                  and any(family[m] == family[n] and m != n for m in measured)]
        if not takers:
            return frozenset()
        priors = {n: p1_iso[i] for i, n in enumerate(names)}
        for m in measured:
            if m not in priors and family[m] is not None:
                prior = self._zoo_prior(m, gpus)
                if prior is not None:
                    priors[m] = prior
        rows = {n: iso[i] for i, n in enumerate(names)}
        moved = sibling_transfer(rows, priors, {m: v for m, v in measured.items() if m in priors},
                                 family, takers, batch_size={n: k[1] for n, k in kin.items() if k[1]})
        index = {n: i for i, n in enumerate(names)}
        for n in takers:
            i = index[n]
            scale = np.where(iso[i] > 0, moved[n] / np.where(iso[i] > 0, iso[i], 1.0), 1.0)
            iso[i] = moved[n]
            pair[i] *= scale[None, :]
        return frozenset(takers)

    def _zoo_prior(self, job_type: str, gpus: tuple[str, ...]) -> np.ndarray | None:
        """P1's isolated row of a logged zoo job type that is not among the requested jobs."""
        key = (job_type, gpus)
        if key not in self._priors:
            w = self._zoo_features(job_type)
            self._priors[key] = (None if w is None else
                                 self.p1.predict({job_type: w}, gpus).isolated[0].astype(np.float64))
        return self._priors[key]

    def _refine(self, names: tuple[str, ...], gpus: tuple[str, ...], all_gpus: tuple[str, ...],
                pred: Prediction, obs: _Observed, iso: np.ndarray, pair: np.ndarray) -> None:
        """Overwrite ``iso``/``pair`` (in place) with P2's correction where its layout covers them."""
        lay = self.p2.layout
        J = len(names)
        p1_iso, p1_pair = pred.isolated, pred.pair
        p_idx = {n: i for i, n in enumerate(pred.partners)}
        g_idx = {g: i for i, g in enumerate(all_gpus)}
        lg = [g_idx[g] for g in lay.gpus]
        lp = [p_idx.get(p, -1) for p in lay.partners]
        lay_pair = np.full((J, len(lay.partners), len(lay.gpus)), np.nan)
        have = [k for k, i in enumerate(lp) if i >= 0]
        lay_pair[:, have, :] = p1_pair[:, [lp[k] for k in have], :][:, :, lg]
        with np.errstate(divide="ignore"):
            vec = np.log(lay.pack(p1_iso[:, lg], lay_pair))
        vec[~np.isfinite(vec)] = np.nan
        seen = np.full_like(vec, np.nan)
        lay_g = {g: i for i, g in enumerate(lay.gpus)}
        lay_p = {p: i for i, p in enumerate(lay.partners)}
        row = {n: i for i, n in enumerate(names)}
        for (j, p, g), v in obs.items():
            if j in row and g in lay_g and math.isfinite(v) and (p is None or p in lay_p):
                k = lay.isolated_index(g) if p is None else lay.pair_index(p, g)
                seen[row[j], k] = v
        # with nothing observed for a job, P2 returns its P1 vector unchanged
        ref = self.p2.refine(vec, seen)
        r_iso, r_pair = lay.unpack(ref)
        for gi, g in enumerate(gpus):
            if g not in lay_g:
                continue
            c = lay_g[g]
            fit = p1_iso[:, gi] > 0
            new = np.where(np.isfinite(r_iso[:, c]), np.exp(r_iso[:, c]), iso[:, gi])
            scale = np.where(fit & (iso[:, gi] > 0), new / np.where(iso[:, gi] > 0, iso[:, gi], 1), 1.0)
            iso[:, gi] = np.where(fit, new, 0.0)
            # partners outside the layout: P1's slowdown, on the refined isolated value
            pair[:, :, gi] *= scale[:, None]
            for b, n in enumerate(names):
                if n in lay_p:
                    v = r_pair[:, lay_p[n], c]
                    ok = np.isfinite(v) & (p1_pair[:, b, gi] > 0)
                    pair[:, b, gi] = np.where(ok, np.exp(np.where(ok, v, 0.0)), pair[:, b, gi])


def _activities(jobs: Mapping[str, WorkloadFeatures], names: tuple[str, ...], gpus: tuple[str, ...]) -> np.ndarray:
    """``[J, G]`` each job's power activity by the power model (fitted where a board was
    measured), from the same layer features the predictors read: without it every job was
    planned at one default activity, so the energy of a choice only followed its speed."""
    from gogh_flows.catalog import get_gpu_type
    from gogh_flows.truth.synthetic import step_profile

    types = [get_gpu_type(g) for g in gpus]
    return np.array([[step_profile(jobs[n], t).activity for t in types] for n in names], dtype=float)


def _table(names: tuple[str, ...], gpus: tuple[str, ...], iso: np.ndarray, pair: np.ndarray,
           activity: np.ndarray) -> ThroughputTable:
    J, G = len(names), len(gpus)
    jj, gg = np.meshgrid(np.arange(J), np.arange(G), indexing="ij")
    a, b = np.triu_indices(J)
    n_pairs = len(a)
    pa = np.repeat(a, G)
    pb = np.repeat(b, G)
    pg = np.tile(np.arange(G), n_pairs)
    nm = np.asarray(names, dtype=object)
    gp = np.asarray(gpus, dtype=object)
    iso_rows = pl.DataFrame({
        "job_type": nm[jj.ravel()].tolist(), "gpu_type": gp[gg.ravel()].tolist(),
        "partner": [None] * (J * G), "throughput": iso.ravel().astype(float),
        "partner_throughput": [None] * (J * G), "activity": activity.ravel(),
    }, schema={k: SCHEMA[k] for k in ("job_type", "gpu_type", "partner", "throughput", "partner_throughput",
                                      "activity")})
    pair_rows = pl.DataFrame({
        "job_type": nm[pa].tolist(), "gpu_type": gp[pg].tolist(), "partner": nm[pb].tolist(),
        "throughput": pair[pa, pb, pg].astype(float), "partner_throughput": pair[pb, pa, pg].astype(float),
        "activity": [None] * n_pairs * G,
    }, schema={k: SCHEMA[k] for k in ("job_type", "gpu_type", "partner", "throughput", "partner_throughput",
                                      "activity")})
    frame = pl.concat([iso_rows, pair_rows]).with_columns(scale_factor=pl.lit(1, dtype=pl.Int32))
    return ThroughputTable(frame, source="predicted")


def training_entries(observations: pl.DataFrame, base: MeasuredSet | None) -> dict[tuple[str, str | None, str], float]:
    """What a refiner is trained toward: (job, partner, gpu) -> log throughput.

    An entry both this fleet and the base data have is their mean: a shrinkage of the fleet's
    runs toward the base's world that costs little where the fleet differs the same way on every
    job (the per-type site offsets carry that, :mod:`gogh_flows.predict.site`) and guards against
    learning one board's job-by-job departures as a pattern. Replacing the base's entry with the
    fleet's, tried 2026-11-28, predicted a real H100 worse (`benchmarks/refiner_real_board.py`:
    0.403 against 0.379 mean absolute log error, a job's H100 rate from its A100 run) and the
    demo's next runs no better (6.35% against 6.31% over eight retrainings).
    """
    vals: dict[tuple[str, str | None, str], list[float]] = {}
    if base is not None:
        for j, g, t in base.iso.iter_rows():
            vals.setdefault((j, None, g), []).append(math.log(t))
        for j, p, g, t, _ in base.pairs.iter_rows():
            vals.setdefault((j, p, g), []).append(math.log(t))
    for k, v in _aggregate(observations).items():
        if math.isfinite(v):
            vals.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in vals.items()}


def fit_refiner(p1: P1Model, features: Mapping[str, WorkloadFeatures], observations: pl.DataFrame, *,
                base: MeasuredSet | None = None, config: P2Config = P2Config(),
                gpu_types: Sequence[str] | None = None, out_of_family: bool = False) -> P2Model:
    """Train a P2 on logged measurements (plus ``base`` data, e.g. the synthetic fleet).

    The refiner learns how P1's errors on a job spread across GPU types and partners, so it
    must see P1 vectors with realistic errors: logged jobs are usually new to P1 and are
    fine as they are; ``base`` jobs were mostly in P1's own training set, and
    ``out_of_family=True`` replaces their vectors with predictions of P1s trained without
    their family (one P1 per family: slower, better).
    """
    obs = observations_frame(observations)
    feats: dict[str, WorkloadFeatures] = dict(base.jobs) if base is not None else {}
    feats.update(features)
    named = list(dict.fromkeys(
        obs["job_type"].to_list() + [p for p in obs["partner"].to_list() if p is not None]))
    unknown = [n for n in named if n not in feats]
    if unknown:
        try:
            feats.update(zoo_jobs(unknown))
        except UnknownJobFeaturesError as exc:
            raise ValueError(f"fit_refiner: {exc}") from None
    vals = training_entries(obs, base)
    if not vals:
        raise ValueError("fit_refiner needs at least some positive measurements (observations or base)")
    names = tuple(dict.fromkeys([*(base.names if base is not None else ()), *named]))
    if gpu_types is not None:
        gpus = tuple(gpu_types)
    else:
        first = base.gpus if base is not None else ()
        gpus = tuple(first) + tuple(sorted({k[2] for k in vals} - set(first)))
    for g in gpus:
        get_gpu_type(g)
    layout = Layout(gpus, names)
    truth = np.full((len(names), layout.size), np.nan)
    row = {n: i for i, n in enumerate(names)}
    gset, pset = set(gpus), set(names)
    for (j, p, g), v in vals.items():
        if g in gset and (p is None or p in pset):
            k = layout.isolated_index(g) if p is None else layout.pair_index(p, g)
            truth[row[j], k] = v
    vectors = p1_vectors(p1, layout, names, feats)
    if out_of_family and base is not None and len(base.families) >= 2:
        oof = out_of_family_p1(base, layout, feats, p1.config)
        vectors[[row[n] for n in base.names]] = oof
    keep = np.isfinite(truth).any(axis=1)
    if keep.sum() < 2:
        raise ValueError("fit_refiner needs measurements of at least two job types")
    model = train_p2(layout, vectors[keep], truth[keep], config)
    model.trained_on.update({
        "observations": obs.height, "base_jobs": len(base.names) if base is not None else 0,
        "gpus": list(gpus), "out_of_family": bool(out_of_family and base is not None),
    })
    return model


def choose_trust_scale(p1: P1Model, p2: P2Model, features: Mapping[str, WorkloadFeatures],
                       seen: pl.DataFrame, val: pl.DataFrame,
                       scales: Sequence[float | None] = TRUST_SCALES) -> tuple[float | None, dict[str, float]]:
    """The trust scale (:attr:`P2Model.trust_scale`) under which ``p2`` predicts ``val`` best.

    Each validation measurement is predicted from ``seen`` without earlier measurements of its
    own entry, as a placement would (:meth:`ThroughputPredictor.refine_error`). The figures are
    returned by scale ("full" for None). A tie (within 0.01% of the error: float32 round-off,
    as when no validation job has another entry measured) goes to the scale nearer P1, later
    in ``scales``, and so does a validation set with nothing to score: when the data cannot
    tell, the refiner stays out of the way of a P1 that may be right.
    """
    if not scales:
        raise ValueError("choose_trust_scale needs at least one scale to choose from")
    errors: dict[str, float] = {}
    best: tuple[float, float | None] = (math.inf, scales[-1])
    for scale in scales:
        err = ThroughputPredictor(p1, replace(p2, trust_scale=scale)).refine_error(features, seen, val)["mape"]
        errors["full" if scale is None else f"{scale:g}"] = err
        if math.isfinite(err) and err <= best[0] * (1 + 1e-4) + 1e-12:
            best = (min(err, best[0]), scale)
    return best[1], errors


#: where a refiner keeps its fleet's per-type offsets (:mod:`gogh_flows.predict.site`)
SITE_KEY = "site_offsets"
#: fewer validation runs than this decide nothing that a tie would not: two or three runs of a
#: demo favoured refits that then predicted the next runs worse than the champion (retrain.py)
MIN_VALIDATION_RUNS = 8


def fit_site_offsets(predictor: ThroughputPredictor, features: Mapping[str, WorkloadFeatures],
                     observations: pl.DataFrame) -> SiteOffsets:
    """This fleet's per-type offsets (:mod:`gogh_flows.predict.site`) from its isolated
    measurements, each against what ``predictor`` (its own offsets left out) says of the entry
    given the other families' measurements and none of the job's own: a new job's case, where
    neither its measured siblings nor the refiner move it (a job its siblings move is left alone
    by the offsets). Not anchored: :func:`choose_anchoring` decides."""
    obs = observations_frame(observations)
    alone = obs.filter(pl.col("partner").is_null() & (pl.col("throughput") > 0))
    bare = ThroughputPredictor(predictor.p1, predictor.p2)
    bare.site = SiteOffsets()
    family = {j: family_and_batch(j)[0] for j in set(obs["job_type"].to_list())}
    residuals: list[tuple[str, float]] = []
    for (j, g), rows in alone.partition_by("job_type", "gpu_type", as_dict=True, maintain_order=True).items():
        others = [k for k in family if k != j and (family[j] is None or family[k] != family[j])]
        seen = obs.filter(pl.col("job_type").is_in(others))
        pred = bare._predict({j: features[j]}, (g,), _aggregate(seen))[0][0, 0]
        residuals += [(g, math.log(t / pred) if pred > 0 else math.nan) for t in rows["throughput"]]
    return SiteOffsets.fit(residuals)


#: how :func:`choose_anchoring` names its two settings in the errors it returns
ANCHORING = {True: "anchored", False: "measured jobs left to the refiner"}


def anchored_as(p2: P2Model, anchored: bool) -> P2Model:
    """``p2`` with its site offsets' :attr:`~SiteOffsets.anchored` set (a copy; weights shared)."""
    site = SiteOffsets.from_dict((p2.trained_on or {}).get(SITE_KEY))
    return replace(p2, trained_on={**p2.trained_on, SITE_KEY: replace(site, anchored=anchored).to_dict()})


def choose_anchoring(p1: P1Model, p2: P2Model, features: Mapping[str, WorkloadFeatures], seen: pl.DataFrame,
                     val: pl.DataFrame, default: bool = False) -> tuple[bool, dict[str, float]]:
    """Whether ``p2``'s site offsets should move a measured job's other types too
    (:attr:`SiteOffsets.anchored`): ``default`` unless the other choice predicts ``val`` 1%
    better, each entry predicted as :meth:`ThroughputPredictor.refine_error` does; ``default``
    as it is with fewer than :data:`MIN_VALIDATION_RUNS` runs to score. The errors are keyed by
    :data:`ANCHORING` (empty when nothing was scored)."""
    if val.height < MIN_VALIDATION_RUNS or not SiteOffsets.from_dict((p2.trained_on or {}).get(SITE_KEY)):
        return default, {}
    errors = {ANCHORING[a]: ThroughputPredictor(p1, anchored_as(p2, a)).refine_error(features, seen, val)["mape"]
              for a in (False, True)}
    mine, other = errors[ANCHORING[default]], errors[ANCHORING[not default]]
    return (not default if math.isfinite(other) and other < mine * 0.99 else default), errors


__all__ = [
    "ANCHORING", "MIN_VALIDATION_RUNS", "OBSERVATION_SCHEMA", "SITE_KEY", "ThroughputPredictor", "anchored_as",
    "choose_anchoring",
    "choose_trust_scale", "fit_refiner", "fit_site_offsets", "observations_frame", "stored_records",
    "training_entries",
]
