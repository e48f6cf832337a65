"""The retraining deployment: learn a new refiner from what the fleet really measured.

Every placed run logs its throughput; this flow turns those measurements into a challenger
P2, scores challenger and champion on the most recent measurements (held out from
training, so the comparison is about the future, not the past; each predicted without the
earlier measurements of its own entry, or any refiner would just read them back), registers
the challenger,
and moves the ``champion`` alias only when the challenger is strictly better. Placements
pick the new champion up on their next registry check, with no restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import numbers
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import polars as pl
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from gogh_flows.flows.blocks import PredictorRegistry, load_block, require_prefect_server, state_dir
from gogh_flows.flows.features import FeatureStore
from gogh_flows.flows.observations import observations_from_measurements
from gogh_flows.flows.predictors import PRIOR_ID_TAG, predictor_source
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.io import save_model
from gogh_flows.predict.p1 import P1Model
from gogh_flows.predict.p2 import P2Config, P2Model
from gogh_flows.predict.service import (
    ANCHORING,
    MIN_VALIDATION_RUNS,
    SITE_KEY,
    ThroughputPredictor,
    anchored_as,
    choose_anchoring,
    choose_trust_scale,
    fit_refiner,
    fit_site_offsets,
)
from gogh_flows.tracking.measurements import MeasurementLog
from gogh_flows.truth import load_truth, readable_truth

log = logging.getLogger("gogh_flows")
CHALLENGER = "challenger"


def split_recent(obs: pl.DataFrame, holdout_fraction: float,
                 seen: frozenset[str] | set[str] = frozenset()) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Oldest rows train, the most recent ``holdout_fraction`` test (at least one row each).

    ``seen``: digests (:func:`run_digests`) of runs a model being judged was trained on. They
    always train and are never tested (``obs`` needs its ``key`` column then), so the test can
    be smaller, or empty when every row was seen. The newest rows are not always the unseen
    ones: a machine's retraining pulls runs other machines logged, which may have started long
    before the champion was trained, while the champion may have been trained elsewhere on
    runs this machine only now takes in.
    """
    n = obs.height
    k = min(n - 1, max(1, math.ceil(n * holdout_fraction)))
    if not seen:
        return obs.head(n - k), obs.tail(k)
    order = pl.int_range(pl.len()).alias("_row")
    unseen = obs.with_columns(order).filter(~_digest_expr().is_in(sorted(seen)))
    test_rows = unseen["_row"].tail(min(k, unseen.height))
    is_test = pl.int_range(pl.len()).is_in(test_rows.implode())
    return obs.filter(~is_test), obs.filter(is_test)


#: ``trained_on`` record: digests of the measurements (run and GPU) that shaped a refiner, its
#: kept weights' included, so a later retraining never scores it on runs it learned
TRAINING_RUNS = "training_runs"


def _digest_expr() -> pl.Expr:
    """A measurement key's digest (12 hex digits of its SHA-1: a collision only costs one test row)."""
    return pl.col("key").map_elements(lambda k: hashlib.sha1(k.encode()).hexdigest()[:12], return_dtype=pl.String)


def run_digests(obs: pl.DataFrame) -> set[str]:
    """The digests of the runs in ``obs`` (its ``key`` column), as :data:`TRAINING_RUNS` stores them."""
    if obs.is_empty():
        return set()
    return set(obs.select(_digest_expr())["key"].drop_nulls().to_list())


def trained_runs(p2: P2Model | None) -> frozenset[str]:
    """The runs ``p2`` was trained on, as recorded (none for a refiner no retraining made)."""
    return frozenset((p2.trained_on or {}).get(TRAINING_RUNS, ()) if p2 is not None else ())


BASE_DATA = ("prior", "synthetic", "gavel", "none")


def base_measurements(base_data: str, prior: str | None, gpu_types: list[str]) -> MeasuredSet | None:
    """Throughputs the challenger learns from besides the logged runs (``base_data``)."""
    if base_data not in BASE_DATA:
        raise ValueError(f"base_data must be one of {BASE_DATA}, got {base_data!r}")
    source = (prior or "none") if base_data == "prior" else base_data
    # a base the user named ("gavel", the shipped prior "gavel") must be read; the truth a folder
    # prior records may be missing where this retraining runs, which is said and learned without
    named = source in BASE_DATA
    if not named:  # a team's own prior: the truth its refiner was trained on
        source = _folder_prior_truth(source)
    if source == "none":
        return None
    if source == "synthetic":
        from gogh_flows.truth.synthetic import synthetic_table

        return MeasuredSet.from_table(synthetic_table(gpu_types))
    try:
        return MeasuredSet.from_table(load_truth(source))
    except (OSError, ValueError) as exc:
        if base_data != "prior" or named:
            raise
        log.warning("gogh: the truth %s that the prior %s was trained on cannot be read (%s); the challenger "
                    "learns from the logged runs alone", source, prior, exc)
        return None


def _folder_prior_truth(prior: str) -> str:
    """What a prior folder's refiner was trained on (``trained_on.truth`` in its config: 'synthetic',
    'gavel' or a Gavel JSON's path, as it can be read from this process's folder), so a challenger
    keeps learning from it; 'none' if unrecorded."""
    from gogh_flows.predict.io import load_p2, prior_dir

    try:
        truth = load_p2(prior_dir(prior) / "p2").trained_on.get("truth")
    except (OSError, ValueError):  # ModelFormatError is a ValueError
        return "none"
    return readable_truth(str(truth)) if truth else "none"


#: what a challenger keeps of the champion's record: the ensemble's weights, reaches, baseline
#: rows and domain, and the intervals (:func:`gogh_flows.predict.evaluate.calibrate_refiner`).
#: The domain stays the base data's: a job the fleet has since logged is not counted as a
#: training job when its distance is measured (its own measurements correct it anyway).
INHERITED = ("ensemble", "intervals")


#: the share by which refitted weights must beat the champion's on the validation runs to be kept
REFIT_MARGIN = 0.01


def fit_challenger(p1: P1Model, features: dict, train: pl.DataFrame, *, base: MeasuredSet | None, config: P2Config,
                   gpu_types: list[str], validation_fraction: float,
                   inherit: dict | None = None, champion: P2Model | None = None,
                   seen: frozenset[str] = frozenset()) -> tuple[P2Model, int]:
    """A refiner fitted on ``train``, and how many measurements made its choices.

    Its choices are made on the newest ``validation_fraction`` of ``train``, by trial refiners
    fitted on the older rest, so nothing outside ``train`` takes part: the caller keeps its
    held-out runs for judging the result. They are how far it trusts its corrections over P1
    (:attr:`P2Model.trust_scale`, :func:`~gogh_flows.predict.service.choose_trust_scale`);
    whether this fleet's per-type site offsets move measured jobs too
    (:func:`~gogh_flows.predict.service.choose_anchoring`); and, given the ``champion``, whether
    its weights are refitted at all: the champion's weights (and trust scale) with new site
    offsets are kept unless refitted ones predict at least
    :data:`~gogh_flows.predict.service.MIN_VALIDATION_RUNS` validation runs :data:`REFIT_MARGIN`
    better. A refit on a few runs beside much base data can undo what the champion knew: the
    flow cannot afford the out-of-family P1 vectors a shipped refiner is trained on (one P1 per
    family), so its base jobs teach it P1's near-perfect fit to them. In the demo (2026-11-28)
    refits predicted the next runs at 5.9-7.1% where the champions they would replace did at
    2.9-5.2%, after two or three validation runs had favoured them.

    The champion's weights keep the offsets ``anchored`` (moving a measured job's other types)
    when they were never refitted on this fleet's runs, unless enough validation runs say not.

    ``seen``: the runs the champion was trained on (:func:`trained_runs`): they are never
    validation runs, which would favour its weights. The result records the runs that shaped it
    (:data:`TRAINING_RUNS`: ``train``'s, and ``seen`` too when the champion's weights are kept).

    ``inherit``: the champion's ``trained_on``; its :data:`INHERITED` records go to the trial
    and the challenger. Choosing them again takes a P2 per family of the base data (``gogh
    predictors calibrate``), too slow for this flow; without them a promoted challenger would
    predict with P2 alone and refuse every placement at a risk level.
    """
    kept = {k: v for k, v in (inherit or {}).items() if k in INHERITED}
    fit, val = split_recent(train, validation_fraction, seen) if train.height >= 2 else (train, train.head(0))
    shaped_by = run_digests(train) if "key" in train.columns else set()

    def with_site(model: P2Model, seen: pl.DataFrame, anchored: bool = False) -> P2Model:
        """``model`` with this fleet's site offsets (gogh_flows.predict.site) fitted on ``seen``:
        how its boards differ from the prior's world, per type, for jobs with nothing measured."""
        site = fit_site_offsets(ThroughputPredictor(p1, model), features, seen)
        return replace(model, trained_on={**model.trained_on, SITE_KEY: replace(site, anchored=anchored).to_dict()})

    def val_error(model: P2Model, anchored: bool, scored: dict[str, float]) -> float:
        """``model``'s validation MAPE with its offsets so anchored: choose_anchoring's figure
        when it scored that setting, else scored here."""
        if ANCHORING[anchored] in scored:
            return scored[ANCHORING[anchored]]
        return ThroughputPredictor(p1, anchored_as(model, anchored)).refine_error(features, fit, val)["mape"]

    def champions(anchored: bool, why: str, choice: dict) -> tuple[P2Model, int]:
        p2 = with_site(champion, train, anchored)
        p2.trained_on.update({"weights": "the champion's", "weights_reason": why, "weights_validation_mape": choice,
                              TRAINING_RUNS: sorted(shaped_by | seen)})
        return p2, val.height

    # weights never refitted on this fleet's runs (a shipped prior's, kept since) have not learned
    # its cross-type pattern: the offsets move a measured job's other types too unless enough
    # validation runs say otherwise (refitted weights have, and would count it twice)
    foreign = champion is not None and champion.trained_on.get("weights") != "refitted"
    if champion is not None and val.height < MIN_VALIDATION_RUNS:
        unlearned = " it had not learned" if seen else ""
        return champions(foreign, f"{val.height} validation runs{unlearned}, fewer than the {MIN_VALIDATION_RUNS} "
                                  "that judge a refit", {})
    trial = fit_refiner(p1, features, fit, base=base, config=config, gpu_types=gpu_types)
    trial.trained_on.update(kept)
    trial = with_site(trial, fit)
    trust, errors = choose_trust_scale(p1, trial, features, fit, val)
    trial = replace(trial, trust_scale=trust)
    anchored, anchor_errors = choose_anchoring(p1, trial, features, fit, val)
    choice = {"refitted": val_error(trial, anchored, anchor_errors)}
    if champion is not None:
        old = with_site(champion, fit)
        old_anchored, old_errors = choose_anchoring(p1, old, features, fit, val, default=foreign)
        choice["the champion's"] = val_error(old, old_anchored, old_errors)
        refit, kept_weights = choice["refitted"], choice["the champion's"]
        if not (math.isfinite(refit) and refit < kept_weights * (1 - REFIT_MARGIN)):
            return champions(old_anchored, f"the refit was not {REFIT_MARGIN:.0%} better on {val.height} "
                                           "validation runs", choice)
    p2 = fit_refiner(p1, features, train, base=base, config=config, gpu_types=gpu_types)
    p2.trained_on.update(kept)
    p2 = with_site(p2, train, anchored)
    p2.trained_on.update({"weights": "refitted", "weights_validation_mape": choice,
                          "site_anchoring_validation_mape": anchor_errors, "trust_scale_validation_mape": errors,
                          TRAINING_RUNS: sorted(shaped_by)})
    p2.trust_scale = trust
    return p2, val.height


@task(name="gogh-score-refiner", cache_policy=NO_CACHE, persist_result=False)
def score(predictor: ThroughputPredictor, features: dict, train: pl.DataFrame, test: pl.DataFrame) -> dict:
    return predictor.refine_error(features, train, test)


#: Prefect global concurrency limit (one slot) that retrainings of one refiner take in turn
RETRAIN_LIMIT_PREFIX = "gogh-refine-"


class RetrainingBusy(TimeoutError):
    """Another retraining of the same refiner held its slot for longer than this one would wait."""


def _say(message: str) -> None:
    """Into the flow run's log where there is one (what its user reads), else gogh_flows's."""
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().info(message)
    except MissingContextError:
        log.info("gogh: %s", message)


@contextlib.contextmanager
def one_retraining_at_a_time(model_name: str, wait_s: float) -> Iterator[None]:
    """Hold the one slot of the Prefect global concurrency limit ``gogh-refine-<model_name>``:
    Prefect's own lock across flow runs and processes that share a Prefect server (machines too,
    when they share one). Created on first use, and put back to one active slot without decay if
    someone changed it. A holder killed without cleaning up (SIGKILL) can leave the slot taken
    (temporary servers do not free lapsed leases; a restarted server forgets them), so the wait
    is bounded by ``wait_s`` and its error says how to free the slot."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = f"{RETRAIN_LIMIT_PREFIX}{model_name}"
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            limit = None
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:  # another retraining created it first: the same limit
                pass
        if limit is not None and (limit.limit != 1 or not limit.active or limit.slot_decay_per_second):
            log.warning("gogh: the concurrency limit %s was changed (limit %s, active %s, decay %s/s); put back to one "
                        "active slot without decay, or retrainings would overlap", name, limit.limit,
                        limit.active, limit.slot_decay_per_second)
            client.update_global_concurrency_limit(
                name, GlobalConcurrencyLimitUpdate(limit=1, active=True, slot_decay_per_second=0.0))
        elif limit is not None and limit.active_slots:
            # in the flow run's own log: at the gogh_flows logger's INFO a user saw a Running retraining
            # that logged nothing for minutes (a killed holder's slot lapses after Prefect's 300 s lease)
            _say(f"another retraining of {model_name} holds the Prefect concurrency limit {name}; waiting up to "
                 f"{wait_s:g} s for it (a retraining killed without cleaning up frees its slot when Prefect's "
                 f"lease lapses, about 5 minutes; or `prefect gcl update {name} --active-slots 0`)")
    with contextlib.ExitStack() as held:
        try:
            # only the wait for the slot is this lock's timeout: one raised by the retraining it
            # guards goes on as it is. A lapsed lease renewal must not cancel the retraining
            # mid-registration: the alias check before promoting covers a champion moved meanwhile
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True,
                                           raise_on_lease_renewal_failure=False))
        except TimeoutError as exc:
            raise RetrainingBusy(
                f"another retraining of {model_name} held the Prefect concurrency limit {name} for more than "
                f"{wait_s:g} s. If none is running (one killed without cleaning up leaves its slot taken), free it "
                f"with `prefect gcl update {name} --active-slots 0`; or raise lock_wait_s") from exc
        yield


def _with_features(obs: pl.DataFrame, store: FeatureStore) -> tuple[pl.DataFrame, set[str]]:
    """The observations whose job type and partner have layer features here, and the job types
    that have none (one such run made the whole retraining fail with a KeyError)."""
    unknown = set()
    for t in sorted(set(obs["job_type"]) | set(obs["partner"].drop_nulls())):
        try:
            store.get(t)
        except KeyError:
            unknown.add(t)
    if not unknown:
        return obs, unknown
    keep = ~pl.col("job_type").is_in(sorted(unknown)) & ~pl.col("partner").fill_null("").is_in(sorted(unknown))
    return obs.filter(keep), unknown


def _with_known_gpu_types(obs: pl.DataFrame) -> tuple[pl.DataFrame, set[str]]:
    """The observations on GPU types this process's catalog knows, and the types it does not: a
    type registered on another machine (``register_gpu_type``) reaches here through the shared
    store, and one such run made every retraining fail (a review)."""
    from gogh_flows.catalog import UnknownGpuTypeError, get_gpu_type

    foreign = set()
    for gpu_type in sorted(set(obs["gpu_type"])):
        try:
            get_gpu_type(gpu_type)
        except UnknownGpuTypeError:
            foreign.add(gpu_type)
    return (obs.filter(~pl.col("gpu_type").is_in(sorted(foreign))) if foreign else obs), foreign


#: a challenger's tag: a digest of what it was trained from (measurement keys, settings, champion)
INPUTS_TAG = "gogh.inputs"
#: the same, without the champion it was judged against
DATA_INPUTS_TAG = "gogh.data_inputs"
#: whether the challenger beat its champion by ``min_improvement`` (its promotion may not have happened)
BETTER_TAG = "gogh.better"
#: set on a challenger once it was made champion: a better one without it is a promotion that failed
#: half-way, finished by the next retraining; with it, one a person (or another retraining) replaced
#: since, which stays replaced (a review saw a hand rollback undone by the next quiet retraining)
PROMOTED_TAG = "gogh.promoted"


def _promote(registry: Any, name: str, alias: str, version: int) -> None:
    """Point ``alias`` at ``version`` and record that it was promoted (said, not fatal, if the tag fails:
    the alias is what placements follow)."""
    registry.set_alias(name, alias, version)
    try:
        registry.set_version_tag(name, version, PROMOTED_TAG, "true")
    except Exception as exc:  # noqa: BLE001 - the promotion itself happened
        log.warning("gogh: %s v%s was promoted but could not be tagged %s (%s); were it replaced by hand, the "
                    "next retraining would promote it again", name, version, PROMOTED_TAG, exc)


def _lineage(registry: Any, p1_name: str, p1_version: int | None) -> dict[str, str]:
    """The prior tag of the P1 a challenger refines, to carry on the challenger (none: none)."""
    if p1_version is None:
        return {}
    found = registry.version_tags(p1_name, p1_version).get(PRIOR_ID_TAG)
    return {PRIOR_ID_TAG: found} if found else {}


@flow(name="gogh-refine-predictors", log_prints=True)
def refine_predictors(
    registry: PredictorRegistry | str | None = None, measurements_dir: str | None = None, min_measurements: int = 8,
    holdout_fraction: float = 0.25, epochs: int = 300, seed: int = 0, promote: bool = True,
    base_data: str = "prior", min_improvement: float = 0.01, lock_wait_s: float = 3600.0,
) -> dict[str, Any]:
    """Train a challenger P2 on logged measurements; promote it to champion only if it is better.

    ``registry`` names a saved PredictorRegistry block, or is one (as ``@gogh_placed(registry=...)``
    takes; a deployment's parameter is the name), None: the embedded default;
    ``measurements_dir`` is where placed runs log (default ``$GOGH_HOME/measurements``).
    ``base_data`` is what the challenger learns from besides the measurements, so a few
    dozen runs refine the refiner instead of replacing it: "prior" (the data the shipped
    prior was trained on), "synthetic", "gavel", or "none". ``min_improvement`` is the
    relative drop in holdout MAPE the challenger must show to be promoted (default 1%): a
    champion is not replaced for a difference in the last digits, which retraining on the
    same data can produce. ``lock_wait_s``: how long it waits for another retraining of the same
    refiner to finish (they take turns); then it fails with :class:`RetrainingBusy`.
    """
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction!r}")
    if not 0 <= min_improvement < 1:
        raise ValueError(f"min_improvement must be in [0, 1) (a relative MAPE drop), got {min_improvement!r}")
    if not lock_wait_s > 0:
        raise ValueError(f"lock_wait_s must be a number of seconds > 0, got {lock_wait_s!r}")
    if not min_measurements >= 2:
        raise ValueError(f"min_measurements must be at least 2 (one to train on, one to judge by), got "
                         f"{min_measurements!r}")
    if measurements_dir is not None and not Path(measurements_dir).is_dir():
        raise ValueError(f"measurements_dir {measurements_dir!r} is not a folder: give the folder placed runs log "
                         "to ($GOGH_HOME/measurements of the machine that placed them), or leave it out")
    logger = get_run_logger()
    block = load_block(PredictorRegistry, registry, PredictorRegistry())
    # one retraining of this refiner at a time, across processes and machines: two that overlap
    # (a scheduled run outlasting its interval, a manual run beside it) would each score against
    # the champion they read, and the later promotion would undo the earlier one unseen
    with one_retraining_at_a_time(block.p2_name, lock_wait_s):
        source = predictor_source(block)
        champion = source.get(force=True, bounded=False)
        versions = source.versions()
        # what the aliases named when this retraining began (the loaded versions can differ: a
        # champion that cannot be loaded is served by the last good one)
        alias_before = source.registry.version_for(block.p2_name, block.alias)
        p1_before = source.registry.version_for(block.p1_name, block.alias)
        stand_in = None
        if (versions["p1"], versions["p2"]) != (p1_before, alias_before):
            stand_in = source.refused(p1_before, alias_before)
            if stand_in is None:
                # not the champion, and not because it is broken (the registry did not answer when
                # it was read, another process's cache...): judged against a stand-in, a challenger
                # could replace a champion it was never scored against (a review reproduced it)
                loaded = f"P1 v{versions['p1']}, P2 v{versions['p2']} are"
                msg = (f"the champion the registry names (P1 v{p1_before}, P2 v{alias_before}) is not the one "
                       f"loaded here ({source.degraded_reason or loaded + ' loaded'}); nothing retrained: a "
                       "challenger judged against a stand-in could replace a champion it was never scored against. "
                       "The next retraining judges against it")
                logger.warning(msg)
                return {"promoted": False, "reason": msg, "champion_version": alias_before}
            logger.warning(f"{stand_in}: the challenger is judged against the last good version loaded here "
                           f"(P1 v{versions['p1']}, P2 v{versions['p2']})")
        root = Path(measurements_dir) if measurements_dir else state_dir() / "measurements"
        mlog = MeasurementLog(block.resolved_tracking_uri(), root)
        # this machine's measurements spooled through an MLflow outage go out first: only a placed
        # run's mirror sent them before, so a machine that placed nothing more kept them from the
        # rest of the team (and from their retrainings) for good
        flushed = mlog.flush_spool() if measurements_dir is None else 0
        if flushed:
            logger.info(f"sent {flushed} measurement(s) spooled on this machine through an MLflow outage to the "
                        "tracking store")
        # the team's other machines log to the same store from their own tables: theirs first
        # (into this machine's table; a measurements_dir given is read as it is, not written)
        pulled = mlog.pull() if measurements_dir is None else 0
        if pulled:
            logger.info(f"took {pulled} measurement(s) logged from other machines from the tracking store "
                        "into the table")
        frame = mlog.read().sort("started_at")
        obs = observations_from_measurements(frame, keys=True)
        store = FeatureStore(state_dir() / "jobs")
        obs, unknown = _with_features(obs, store)
        obs, foreign = _with_known_gpu_types(obs)
        if foreign:
            logger.warning(
                f"measurements on GPU type(s) this machine's catalog does not know are left out of this retraining: "
                f"{', '.join(sorted(foreign))} (added on another machine with register_gpu_type; register them "
                "here too to learn from them)")
        if unknown:
            logger.warning(
                f"{len(unknown)} job type(s) have no layer features on this machine and are left out of "
                f"this retraining: {', '.join(sorted(unknown)[:5])}{' ...' if len(unknown) > 5 else ''} (user "
                "models placed only from other machines; retrain where they were placed to learn them)")
        if obs.height < min_measurements:
            msg = (f"only {obs.height} usable measurements in {root}, with the tracking store's (need {min_measurements}); "
                   f"nothing retrained. Of the {frame.height} logged, runs whose company changed while they ran, "
                   "that shared with two partners, or that did too little to time a steady state (a failed run "
                   "counts by the steps it did before it failed; one with none, not at all) are kept in the table "
                   "but not learned from; place more runs, or lower min_measurements")
            logger.info(msg)
            return {"promoted": False, "reason": msg, "measurements": obs.height,
                    "champion_version": versions["p2"]}
        # what this challenger would be made of: a retraining with nothing new (an hourly schedule
        # on a quiet fleet) registered an identical version each time, about 140 KB apiece
        made_of = {"measurements": sorted(frame["key"].to_list()), "without_features": sorted(unknown),
                   "p1": versions["p1"], "epochs": epochs, "seed": seed, "base_data": base_data,
                   "holdout_fraction": holdout_fraction, "min_improvement": min_improvement, "promote": promote}
        data_inputs = hashlib.sha1(json.dumps(made_of).encode()).hexdigest()
        inputs = hashlib.sha1(json.dumps({**made_of, "champion": versions["p2"]}).encode()).hexdigest()
        last = source.registry.version_for(block.p2_name, CHALLENGER)
        last_tags = source.registry.version_tags(block.p2_name, last) if last is not None else {}
        # the last challenger, promoted, is the champion: retrained on the same data against itself it
        # registered a version identical to it (a new-user review: weights byte for byte the same)
        promoted_same = last == versions["p2"] and last_tags.get(DATA_INPUTS_TAG) == data_inputs
        replaced = last is not None and last != versions["p2"] and last_tags.get(PROMOTED_TAG) == "true"
        if (last is not None and last != versions["p2"] and last_tags.get(INPUTS_TAG) == inputs and promote
                and last_tags.get(BETTER_TAG) == "true" and stand_in is None and not replaced):
            # it beat this same champion, and its promotion did not happen (the registry failed between
            # registering it and moving the alias): a quiet fleet would never retrain, nor promote it
            _promote(source.registry, block.p2_name, block.alias, last)
            source.get(force=True, bounded=False)
            msg = (f"challenger v{last} beat champion v{versions['p2']} on the same {frame.height} measurements when it "
                   "was registered, and was not promoted then; promoted to champion now")
            logger.info(msg)
            return {"promoted": True, "reason": msg, "measurements": obs.height, "challenger_version": last,
                    "champion_version": last, "previous_champion_version": versions["p2"]}
        if last is not None and (last_tags.get(INPUTS_TAG) == inputs or promoted_same):
            msg = (f"nothing new since challenger v{last}, promoted to champion and since replaced by v{versions['p2']} "
                   f"(the alias moved by hand or by another retraining): the same {frame.height} measurements and "
                   "settings; nothing retrained, nor promoted again" if replaced else
                   f"nothing new since challenger v{last}: the same {frame.height} measurements, settings and "
                   f"champion (v{versions['p2']}); nothing retrained" if not promoted_same else
                   f"nothing new since challenger v{last}, promoted to champion: the same {frame.height} measurements "
                   "and settings; nothing retrained")
            logger.info(msg)
            return {"promoted": False, "reason": msg, "measurements": obs.height, "challenger_version": last,
                    "champion_version": versions["p2"]}
        # the champion is judged on runs it never learned, whatever their age (see split_recent)
        seen = trained_runs(champion.p2)
        train, test = split_recent(obs, holdout_fraction, seen)
        if test.is_empty():
            msg = (f"all {obs.height} usable measurements trained the champion v{versions['p2']}: none is left to "
                   "judge a challenger against it; nothing retrained (the next runs will be)")
            logger.info(msg)
            return {"promoted": False, "reason": msg, "measurements": obs.height,
                    "champion_version": versions["p2"]}
        learned = train.filter(_digest_expr().is_in(sorted(seen))).height if seen else 0
        unseen_text = f" the champion never learned ({learned} that it did only train)" if learned else ""
        features = {t: store.get(t) for t in sorted(set(obs["job_type"]) | set(obs["partner"].drop_nulls()))}
        gpu_types = sorted(set(obs["gpu_type"]))
        started = time.time()
        # a refitted challenger covers the GPU types this fleet measured (a type added later is
        # served by P1, and by the next retraining once measured); kept weights keep their layout
        base = base_measurements(base_data, block.prior, gpu_types)
        # never scored on `test` while it is fitted: `test` decides the promotion
        p2, n_val = fit_challenger(champion.p1, features, train, base=base, config=P2Config(epochs=epochs, seed=seed),
                                   gpu_types=gpu_types, validation_fraction=holdout_fraction,
                                   inherit=champion.p2.trained_on if champion.p2 is not None else None,
                                   champion=champion.p2, seen=seen)
        trust = p2.trust_scale
        challenger = ThroughputPredictor(champion.p1, p2)
        champ_score = score(champion, features, train, test)
        chall_score = score(challenger, features, train, test)
        # what the measurements would be predicted as with no refiner at all, for reference
        p1_score = score(ThroughputPredictor(champion.p1, None), features, train, test)
        better = chall_score["mape"] < champ_score["mape"] * (1 - min_improvement)
        trust_text = "in full" if trust is None else f"in proportion to P1's error up to {trust:g} (log)"
        if p2.trained_on.get("weights") == "the champion's":
            how = (f"Weights and trust scale ({trust_text}) are the champion's (v{versions['p2']}): "
                   f"{p2.trained_on.get('weights_reason', '')}; only its site offsets are new")
        else:
            how = f"Weights refitted; corrections applied {trust_text}, chosen on {n_val} validation measurements"
        offsets = {g: f"{math.expm1(v):+.1%}" for g, v in p2.trained_on.get(SITE_KEY, {}).get("unmeasured", {}).items()}
        card = (f"# P2 challenger\n\nTrained by the `gogh-refine-predictors` flow on {train.height} logged "
                f"measurements ({frame.height} runs), {time.strftime('%Y-%m-%d %H:%M:%S')}.\n"
                f"Held-out recent measurements{unseen_text}: {test.height}; MAPE challenger {chall_score['mape']:.4f}, "
                f"champion (v{versions['p2']}) {champ_score['mape']:.4f}, P1 alone {p1_score['mape']:.4f}.\n"
                f"{how}.\nThis fleet's boards against the prior's world, per type (site offsets): "
                f"{offsets or 'none learned'}.\n")
        with tempfile.TemporaryDirectory() as tmp:
            save_model(p2, Path(tmp) / "p2", card=card)
            version = source.registry.register(
                block.p2_name, Path(tmp) / "p2", alias=CHALLENGER,
                metrics={"holdout_mape": chall_score["mape"], "champion_holdout_mape": champ_score["mape"],
                         "p1_holdout_mape": p1_score["mape"], "train_measurements": float(train.height), "holdout_measurements": float(test.height)},
                tags={"trained_until": f"{float(frame['started_at'].max()):.3f}", "trained_by": "refine_predictors",
                      "p1_version": str(versions["p1"]), "trust_scale": "full" if trust is None else f"{trust:g}",
                      INPUTS_TAG: inputs, DATA_INPUTS_TAG: data_inputs, BETTER_TAG: str(bool(better)).lower(),
                      # the prior it descends from (its P1's), so no other prior's P1 is registered beside it
                      **_lineage(source.registry, block.p1_name, versions["p1"])},
                description=f"challenger from {train.height} measurements",
                p1_uri=f"models:/{block.p1_name}/{versions['p1']}")
        # the champion it beat must still be the champion (the lock keeps other retrainings out,
        # not a person moving the alias by hand meanwhile)
        now = source.registry.version_for(block.p2_name, block.alias)
        p1_now = source.registry.version_for(block.p1_name, block.alias)
        # the estimator it refines must still be the champion's too: promoted beside another P1, the
        # pair placements load was never trained (nor scored) together (a review)
        moved = now != alias_before or p1_now != p1_before
        promoted = bool(promote and better and not moved)
        if promoted:
            _promote(source.registry, block.p2_name, block.alias, version)
            source.get(force=True, bounded=False)
        result = {
            "promoted": promoted, "challenger_version": version,
            "champion_version": version if promoted else (now if moved else versions["p2"]),
            "previous_champion_version": versions["p2"],
            "challenger_mape": chall_score["mape"], "champion_mape": champ_score["mape"],
            "p1_mape": p1_score["mape"], "trust_scale": trust, "weights": p2.trained_on.get("weights"),
            # why the challenger kept the champion's weights, if it did (said in its model card too)
            **({"weights_reason": p2.trained_on["weights_reason"]} if p2.trained_on.get("weights_reason") else {}),
            # every outcome names how many measurements it read, as the ones that retrained nothing do
            "measurements": obs.height,
            "train_measurements": train.height, "holdout_measurements": test.height,
            "champion_trained_measurements": learned,
            "seconds": round(time.time() - started, 2),
        }
        # a challenger that did worse is said to have (a review read "not 1% better" of one 4% worse)
        c, h = chall_score["mape"], champ_score["mape"]
        short = (f"no better than the champion (holdout MAPE {c:.2%} against {h:.2%})" if not c < h else
                 f"{1 - c / h:.1%} better than the champion, less than the {min_improvement:.0%} required "
                 f"(holdout MAPE {c:.2%} against {h:.2%})")
        verdict = "promoted to champion" if promoted else (
            f"not promoted: {short}" if not better
            else "not promoted (promote=False)" if not promote
            else (f"not promoted: the champion moved from P1 v{p1_before}, P2 v{alias_before} to P1 v{p1_now}, "
                  f"P2 v{now} while this challenger was trained; the next retraining compares against it"))
        if stand_in is not None:
            verdict += (f" (the registry's champion P2 v{alias_before} cannot be loaded here, so it was judged "
                        f"against v{versions['p2']}, the last good version: {stand_in})")
        result["reason"] = verdict  # every outcome says why, as the too-little-data one does
        create_markdown_artifact(key="gogh-refiner-comparison", markdown="\n".join([
            f"### Refiner retraining: challenger v{version} {verdict}", "",
            "| model | holdout MAPE | measurements |", "| --- | ---: | ---: |",
            f"| challenger v{version} | {chall_score['mape']:.2%} | {chall_score['n']} |",
            f"| champion v{versions['p2']} | {champ_score['mape']:.2%} | {champ_score['n']} |",
            f"| P1 alone (no refiner, for reference) | {p1_score['mape']:.2%} | {p1_score['n']} |", "",
            f"Trained on {train.height} measurements, scored on the {test.height} most recent{unseen_text}, "
            "each predicted without the earlier measurements of its own entry (job, GPU type, partner), "
            "as a placement would. "
            f"{how}. Site offsets per type: "
            f"{', '.join(f'{g} {v}' for g, v in offsets.items()) if offsets else 'none learned'}.",
        ]))
        logger.info("refiner challenger v%s: MAPE %.2f%% vs champion v%s %.2f%% -> %s", version,
                    100 * chall_score["mape"], versions["p2"], 100 * champ_score["mape"], verdict)
        print(json.dumps(result))
        return result


def serve_refiner(name: str = "gogh-refine", *, cron: str | None = None,
                  interval_s: float | timedelta | None = None, parameters: dict | None = None) -> None:
    """Serve ``refine_predictors`` as a scheduled Prefect deployment (blocks until stopped).

    Checked before serving, since a served deployment that cannot run only shows at its first
    scheduled time, or never: the schedule needs a Prefect server's scheduler (an ephemeral,
    in-process server has none, and Prefect only logs a warning), and a named registry block
    must exist on that server.
    """
    from prefect.settings import PREFECT_API_URL

    if (cron is None) == (interval_s is None):
        raise ValueError("give exactly one schedule: cron='0 * * * *' or interval_s=3600")
    if interval_s is not None:
        if isinstance(interval_s, timedelta):
            seconds = interval_s.total_seconds()
        elif isinstance(interval_s, numbers.Real) and not isinstance(interval_s, bool):
            seconds = float(interval_s)
        else:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"the interval (interval_s=, gogh serve --interval) must be a positive number of "
                             f"seconds, e.g. 3600 for hourly; got {interval_s!r}")
    if cron is not None:  # checked by Prefect's own schedule model, before anything is served
        from prefect.client.schemas.schedules import CronSchedule
        from pydantic import ValidationError

        try:
            CronSchedule(cron=cron)
        except ValidationError:
            raise ValueError(f"cron {cron!r} is not a valid cron expression: five fields, minute hour day month "
                             "weekday, e.g. '0 * * * *' for hourly or '30 2 * * *' for 02:30 every day") from None
    if not PREFECT_API_URL.value():
        raise ValueError(
            "serving on a schedule needs a running Prefect server, and PREFECT_API_URL is not set: this "
            "process would use an ephemeral in-process server, which schedules nothing, so no retraining "
            "would ever run. Start one (`prefect server start`) and set PREFECT_API_URL="
            "http://127.0.0.1:4200/api, or call refine_predictors() directly")
    require_prefect_server()  # set, but nothing answers there: say so, not httpx's traceback
    if (parameters or {}).get("registry") is not None:
        load_block(PredictorRegistry, parameters["registry"], PredictorRegistry())
    refine_predictors.serve(name=name, cron=cron, interval=interval_s, parameters=parameters or {})


__all__ = ["CHALLENGER", "fit_challenger", "refine_predictors", "serve_refiner", "split_recent"]
