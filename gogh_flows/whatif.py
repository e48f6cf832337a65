"""``gogh predict``: what placement would predict for a job on each GPU type, before placing it.

Why a command of its own: before decorating a flow a user wants to know which GPU types can
meet a requirement, what a step costs on each, and what a given neighbour would do to the
run. Those answers are only useful if they are the figures a placement would decide on, so
nothing here predicts or costs anything itself: the predicted table comes from the same
predictor call a placement makes (``ThroughputPredictor.predict_table`` of the registry's
champion, refined by the logged measurements, as ``gogh-place`` does in
:mod:`gogh_flows.flows.decorator`), and it is read through a
:class:`~gogh_flows.placement.problem.PlacementProblem` with the energy model placement
builds, so activities, power and pair figures go through the very functions the optimiser's
option costing calls (:func:`~gogh_flows.placement.options.pair_figures`). A change to the
power model or the predictors shows up here without a change to this module.

What it cannot give: an interval. P1 and P2 are point estimators (neither has an ensemble,
a variance head or quantiles), so no interval is printed rather than an invented one; their
measured error by model family is in docs/predictors.md.

The pure part (:func:`predict_what_if`) takes the predictor and the observations as
arguments; only :func:`cmd_predict` reaches for the registry and the measurement log, the
way a placement does, so the core stays free of Prefect and MLflow.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from gogh_flows import catalog
from gogh_flows.placement.options import pair_figures
from gogh_flows.placement.problem import Gpu, Job, PlacementProblem

if TYPE_CHECKING:  # torch comes with these: not imported to build the `gogh` parser
    from gogh_flows.predict.service import ThroughputPredictor
    from gogh_flows.workloads.features import WorkloadFeatures

__all__ = ["ENERGY_SPLIT", "JobChoice", "WhatIf", "WhatIfRow", "add_parser", "cmd_predict",
           "predict_what_if", "resolve_job"]

#: How a shared board's energy is split, in words (help text, table caption, docs).
ENERGY_SPLIT = (
    "next to a partner, J/step is what placement charges a run that joins a running partner: "
    "the change in the board's energy, i.e. the pair's board power minus what the partner alone "
    "would draw for the progress it still makes (its alone power x its shared/isolated rate), "
    "per step of this job; the partner's own share is not in it")

NO_INTERVAL = ("These are point predictions; the refiner's calibrated intervals, when its models carry them "
               "(the shipped ones do), are what PlacementPolicy(risk_level=...) plans with, and their widths and "
               "coverage, with the measured error by model family, are in docs/predictors.md")

#: A requirement no prediction falls below: the what-if asks for the figures, not for a verdict
#: on a requirement, so placement's TOO_SLOW / HURTS_PARTNER checks must never reject a pair.
_ANY_RATE = sys.float_info.min

_WITH_BATCH = re.compile(r"\(\s*batch size\s+\d+\s*\)")


@dataclass(frozen=True)
class JobChoice:
    """A job the user named, resolved to its job type and layer features (as the decorator does)."""

    job_type: str
    features: WorkloadFeatures


@dataclass(frozen=True)
class WhatIfRow:
    """One GPU type's predicted figures for the job, alone or next to its partner.

    ``power_w`` is the board's power (with a partner: both jobs' load on it); ``fits`` is false
    where the predictions say the job (or the pair) does not fit the GPU's memory, and then the
    throughputs are 0.0 and power and energy are None.
    """

    gpu_type: str
    job_type: str
    partner: str | None
    throughput: float
    partner_throughput: float | None
    power_w: float | None
    energy_per_step_j: float | None
    fits: bool
    source: str  # "measured": a logged measurement of exactly this entry; else "predicted"
    note: str = ""


@dataclass(frozen=True)
class WhatIf:
    """Every row, and what the figures came from (predictor versions, measurements used)."""

    rows: tuple[WhatIfRow, ...]
    predictors: dict[str, Any] = field(default_factory=dict)
    measurements: int = 0

    def to_frame(self) -> pl.DataFrame:
        schema = {"gpu_type": pl.String, "job_type": pl.String, "partner": pl.String,
                  "throughput": pl.Float64, "partner_throughput": pl.Float64, "power_w": pl.Float64,
                  "energy_per_step_j": pl.Float64, "fits": pl.Boolean, "source": pl.String,
                  "note": pl.String}
        return pl.DataFrame([asdict(r) for r in self.rows], schema=schema)

    def to_json(self) -> dict[str, Any]:
        return {"predictions": [asdict(r) for r in self.rows], "predictors": dict(self.predictors),
                "measurements": self.measurements}


def _valid_jobs() -> str:
    from gogh_flows.workloads.zoo import DEFAULT_BATCH_SIZES, FAMILIES

    parts = []
    for fam in FAMILIES:
        sizes = DEFAULT_BATCH_SIZES[fam]
        parts.append(f"{fam} ({', '.join(map(str, sizes))})" if len(sizes) > 1 else f"{fam} (named '{fam}')")
    return ("A job is a zoo family and a batch size, 'FAMILY (batch size N)' or --model FAMILY --batch-size N; "
            f"the families, with the batch sizes Gavel measured: {'; '.join(parts)}; other batch sizes of a "
            "family work too (the predictors read layer features), and ' [inference]' after the name "
            "predicts a forward-only run")


def resolve_job(text: str | None = None, model: str | None = None, batch_size: int | None = None, *,
                flag: str = "--job") -> JobChoice:
    """A zoo job from its job-type name (``text``) or from a family and batch size.

    Features come from the zoo exactly as ``@gogh_placed(model=FAMILY, batch_size=N)`` gets
    them, so the prediction is the one that decorator's runs would be placed on. A family with
    several measured batch sizes must be given one: a silent default would answer for another job.
    """
    from gogh_flows.workloads.zoo import (
        DEFAULT_BATCH_SIZES,
        canonical_family,
        job_type_name,
        parse_job_kind,
        zoo_features,
    )

    model_flag = "--partner-model" if flag == "--partner" else "--model"
    if text is not None and model is not None:
        raise ValueError(f"give {flag} or {model_flag} with its batch size, not both")
    try:
        if text is not None:
            family, bs, kind = parse_job_kind(text)
            if not _WITH_BATCH.search(text) and len(DEFAULT_BATCH_SIZES[family]) > 1:
                raise ValueError(f"which batch size? {family} was measured at "
                                 f"{', '.join(map(str, DEFAULT_BATCH_SIZES[family]))}")
        elif model is not None:
            family, kind = canonical_family(model), "training"
            if batch_size is None:
                sizes = DEFAULT_BATCH_SIZES[family]
                if len(sizes) > 1:
                    raise ValueError(f"{model_flag} {family} needs its batch size "
                                     f"({model_flag.replace('model', 'batch-size')} N; Gavel measured "
                                     f"{', '.join(map(str, sizes))})")
                batch_size = sizes[0]
            bs = batch_size
        else:
            raise ValueError(f"say which job: {flag} 'ResNet-50 (batch size 64)' or {model_flag} ResNet-50 "
                             f"{model_flag.replace('model', 'batch-size')} 64")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"the batch size must be a whole number >= 1, got {bs!r}")
        return JobChoice(job_type_name(family, bs, kind), zoo_features(family, bs, kind))
    except ValueError as exc:
        if text is not None:
            what = f"{flag} {text!r} is not a job gogh can predict: "
        elif model is not None:
            sized = "" if batch_size is None else f" with batch size {batch_size}"
            what = f"{model_flag} {model!r}{sized} is not a job gogh can predict: "
        else:
            what = ""
        raise ValueError(f"{what}{exc}. {_valid_jobs()}") from None


def resolve_gpu_types(names: Sequence[str] | None) -> tuple[str, ...]:
    """The GPU types asked for, canonical and in order; every catalog type when none is given."""
    if not names:
        return tuple(g.name for g in catalog.gpu_types())
    out = []
    for name in names:
        try:
            out.append(catalog.get_gpu_type(name).name)
        except catalog.UnknownGpuTypeError:
            known = ", ".join(g.name for g in catalog.gpu_types())
            raise ValueError(f"unknown GPU type {name!r} in --gpu; the catalog's types are {known} "
                             "(comma-separated, e.g. --gpu h100,a100; omit --gpu for all of them)") from None
    return tuple(dict.fromkeys(out))


def _observed(observations: pl.DataFrame | None) -> set[tuple[str, str, str | None]]:
    if observations is None or observations.height == 0:
        return set()
    return {(j, g, p) for j, g, p in observations.select("job_type", "gpu_type", "partner").iter_rows()}


def predict_what_if(job: JobChoice, partner: JobChoice | None, gpu_types: Sequence[str],
                    predictor: ThroughputPredictor, observations: pl.DataFrame | None = None) -> tuple[WhatIfRow, ...]:
    """The job's predicted figures on each GPU type, alone or next to ``partner``.

    The table is predicted with the call ``gogh-place`` makes (the jobs' features, the GPU
    types, the observations), then read through a one-GPU-per-type ``PlacementProblem`` built
    as ``decide`` builds it, so activity, power and pair throughputs are placement's own.
    """
    types = tuple(gpu_types)
    feats = {job.job_type: job.features}
    if partner is not None:
        feats.setdefault(partner.job_type, partner.features)
    table = predictor.predict_table(feats, types, observations)
    me = Job("job", job.job_type, _ANY_RATE, 1.0)
    other = Job("partner", partner.job_type, _ANY_RATE, 1.0) if partner is not None else None
    problem = PlacementProblem.build([Gpu(f"{t}-0", t) for t in types], [me] + ([other] if other else []), table)
    thr, energy = problem.throughputs, problem.energy
    seen = _observed(observations)
    rows = []
    for t in types:
        iso = thr.isolated(me, t)
        if other is None:
            source = "measured" if (me.job_type, t, None) in seen else "predicted"
            if not iso > 0:
                rows.append(WhatIfRow(t, me.job_type, None, 0.0, None, None, None, False, source,
                                      "does not fit in memory"))
                continue
            power = energy.power_alone(t, thr.activity(me, t))
            rows.append(WhatIfRow(t, me.job_type, None, iso, None, power, power / iso, True, source))
            continue
        source = "measured" if (me.job_type, t, other.job_type) in seen else "predicted"
        if not iso > 0:  # placement rejects a join before costing it when the job cannot run there alone
            rows.append(WhatIfRow(t, me.job_type, other.job_type, 0.0, 0.0, None, None, False, source,
                                  "does not fit in memory"))
            continue
        reason, tj, tk, _, board = pair_figures(problem, me, other, t)
        if reason is not None:  # with no requirement to meet, only memory rejects a pair
            rows.append(WhatIfRow(t, me.job_type, other.job_type, 0.0, 0.0, None, None, False, source,
                                  "the pair does not fit in memory"))
            continue
        # the join's cost per step of this job: board power minus the partner's alone power for
        # the work it still does meanwhile (as options_for costs a join: E_pair - E_alone(partner))
        k_iso = max(thr.isolated(other, t), tk)
        partner_alone = energy.power_alone(t, thr.activity(other, t))
        per_step = (board - partner_alone * tk / k_iso) / tj
        rows.append(WhatIfRow(t, me.job_type, other.job_type, tj, tk, board, per_step, True, source))
    return tuple(_flag_unfamiliar(r, predictor, job, partner) for r in rows)


def _flag_unfamiliar(row: WhatIfRow, predictor: ThroughputPredictor, job: JobChoice,
                     partner: JobChoice | None) -> WhatIfRow:
    """Say where P1 had nothing of the kind to learn from: a GPU type or a model family it was
    not trained on (its figures there are extrapolations; docs/predictors.md has the errors)."""
    if not row.fits or row.source == "measured":
        return row
    seen = getattr(predictor.p1, "trained_on", None) or {}
    unfamiliar = []
    if seen.get("gpus") and row.gpu_type not in seen["gpus"]:
        near = predictor.p1.nearest_trained([row.gpu_type]).get(0)
        unfamiliar.append(f"GPU type new to P1: from {near}" if near else "GPU type not in P1's training")
    families = set(seen.get("families") or ())
    from gogh_flows.workloads.zoo import parse_job_kind

    for choice in (job, partner):
        try:
            fam = parse_job_kind(choice.job_type)[0] if choice is not None else None
        except ValueError:
            fam = None  # not a zoo job type
        if families and fam and fam not in families:
            unfamiliar.append(f"{fam} not in P1's training")
    return replace(row, note="; ".join(unfamiliar)) if unfamiliar else row


# -- the command ------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict", help="predicted steps/s, board power and energy per step of a job on each GPU type, "
        "alone or next to a partner, from the predictors placement uses",
        description="What placement would predict for a job before placing it: per GPU type, the "
        "predicted throughput (steps/s), board power (W) and energy per step (J), alone or next to a "
        "partner (then both runs' throughputs). The figures come from the registry's champion P1/P2, "
        "refined by the measurements logged under $GOGH_HOME, and placement's energy model. "
        f"Alone, J/step = board power / throughput; {ENERGY_SPLIT}. A GPU type whose memory the job "
        f"(or the pair) does not fit gets 0 steps/s and 'does not fit in memory'. {NO_INTERVAL}.")
    p.add_argument("--job", help="the job type, e.g. 'ResNet-50 (batch size 64)' (A3C and CycleGAN: the bare name)")
    p.add_argument("--model", help="a zoo family instead of --job, with --batch-size")
    p.add_argument("--batch-size", type=int, help="the batch size of --model")
    p.add_argument("--partner", help="a job type to run next to, e.g. 'Transformer (batch size 64)'")
    p.add_argument("--partner-model", help="the partner's zoo family instead of --partner")
    p.add_argument("--partner-batch-size", type=int, help="the batch size of --partner-model")
    p.add_argument("--gpu", help="comma-separated GPU types, e.g. h100,a100 (default: every catalog type, "
                   f"{', '.join(g.name for g in catalog.gpu_types())})")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--registry", help="a saved PredictorRegistry block (default: the embedded one, "
                   "MLflow on SQLite under $GOGH_HOME, as @gogh_placed uses without a registry)")
    p.add_argument("--predictors", metavar="DIR",
                   help="predict with these predictors instead of the registry's champion: a shipped prior's name "
                   "(synthetic, gavel) or the folder `gogh predictors train --out DIR` wrote (p1/, and p2/ if any), "
                   "to see what they would place before registering them")
    p.add_argument("--no-measurements", action="store_true",
                   help="do not refine with the logged measurements (as a PlacementPolicy with refine=False)")
    p.set_defaults(func=cmd_predict)


def _placement_predictors(registry_name: str | None, use_measurements: bool, folder: str | None = None):
    """The predictor and observations a placement would use now (``gogh-place``'s path), or with
    the predictors in ``folder`` in place of the registry's champion."""
    from gogh_flows.flows.blocks import PredictorRegistry, load_block, state_dir
    from gogh_flows.flows.observations import ObservationCache
    from gogh_flows.flows.predictors import predictor_source
    from gogh_flows.tracking.measurements import MeasurementLog

    if folder is not None and registry_name is not None:
        raise ValueError("give --predictors DIR or --registry NAME, not both: one says which predictors to use")
    registry = load_block(PredictorRegistry, registry_name, PredictorRegistry())
    if folder is not None:
        predictor, info = _folder_predictors(folder)
    else:
        source = predictor_source(registry)
        try:
            predictor = source.get()
        except RuntimeError as exc:  # no registry, no cache and no shipped prior
            raise ValueError(str(exc)) from None
        # a fall-back is logged once by the source (gogh's log handler writes it to stderr) and named
        # again under the table: printing it here too said it twice
        versions = source.versions()
        info = {"p1": registry.p1_name, "p1_version": versions["p1"], "p2": registry.p2_name,
                "p2_version": versions["p2"], "alias": registry.alias,
                "tracking_uri": registry.resolved_tracking_uri(), "degraded": source.degraded, "degraded_reason": source.degraded_reason, "using": source.using}
    observations = None
    if use_measurements:
        log = MeasurementLog(registry.resolved_tracking_uri(), state_dir() / "measurements")
        observations = ObservationCache(log).get()
    return predictor, observations, info


def _folder_predictors(folder: str):
    """The predictors of a shipped prior or a `gogh predictors train --out` folder, loaded as the
    registry's are (weights-only, checked against their config)."""
    from gogh_flows.predict.io import load_p1, load_p2, prior_dir
    from gogh_flows.predict.service import ThroughputPredictor

    base = prior_dir(folder)
    if not (base / "p1").is_dir():
        found = "does not exist" if not base.exists() else "has no p1/ folder"
        raise ValueError(f"--predictors {folder!r}: {base} {found}; give a shipped prior's name (synthetic, gavel) "
                         "or the folder `gogh predictors train --out DIR` wrote (it holds p1/ and p2/)")
    p2 = load_p2(base / "p2") if (base / "p2").is_dir() else None
    return ThroughputPredictor(load_p1(base / "p1"), p2), {"folder": str(base.resolve()), "refiner": p2 is not None}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def print_what_if(result: WhatIf, console: Any = None) -> None:
    """The rows as a rich table (the house style of ``gogh pool status``), with what they came from."""
    from rich.markup import escape
    from rich.table import Table

    from gogh_flows.progress import report_console

    first = result.rows[0] if result.rows else None
    partner = first.partner if first is not None else None
    title = (f"{first.job_type} " + (f"next to {partner}" if partner else "alone")) if first else "no GPU type"
    table = Table(title=escape(title))  # "[inference]" in a job type is text, not markup
    table.add_column("GPU")
    table.add_column("steps/s", justify="right")
    if partner:
        table.add_column("partner steps/s", justify="right")
    table.add_column("board W", justify="right")
    table.add_column("J/step", justify="right")
    table.add_column("source")
    for r in result.rows:
        cells = [r.gpu_type]
        if r.fits:
            cells.append(_fmt(r.throughput, ".4g"))
            if partner:
                cells.append(_fmt(r.partner_throughput, ".4g"))
            cells += [_fmt(r.power_w, ".0f"), _fmt(r.energy_per_step_j, ".4g"),
                      r.source + (f" ({r.note})" if r.note else "")]
        else:
            cells.append("0")
            if partner:
                cells.append("0")
            cells += ["-", "-", r.note]
        table.add_row(*(escape(c) for c in cells))
    console = console or report_console()
    console.print(table)
    p = result.predictors
    if "folder" in p:
        which = f"{p['folder']} (P1{' + P2' if p.get('refiner') else ' alone, no p2/'}; not the registry's)"
    elif p.get("degraded"):  # not the champion: say what was used instead, and why
        which = (f"{p.get('using')}, not the {p.get('alias')} at {p.get('tracking_uri')}: "
                 f"{p.get('degraded_reason') or 'it could not be used'}")
    else:
        which = f"{p.get('p1')} v{p.get('p1_version')} + {p.get('p2')} v{p.get('p2_version')} " \
                f"({p.get('alias')} at {p.get('tracking_uri')})"
    console.print(f"predictors: {which}; {result.measurements} logged measurement(s) refine them",
                  soft_wrap=True, highlight=False)
    split = "J/step: board power / throughput" if not partner else ENERGY_SPLIT[0].upper() + ENERGY_SPLIT[1:]
    console.print(f"{split}. {NO_INTERVAL}", soft_wrap=True, highlight=False)


def cmd_predict(args: argparse.Namespace) -> int:
    job = resolve_job(args.job, args.model, args.batch_size, flag="--job")
    partner = None
    if args.partner is not None or args.partner_model is not None:
        partner = resolve_job(args.partner, args.partner_model, args.partner_batch_size, flag="--partner")
    elif args.partner_batch_size is not None:
        raise ValueError("--partner-batch-size needs --partner-model FAMILY")
    if args.batch_size is not None and args.model is None:
        raise ValueError("--batch-size goes with --model FAMILY (a --job name carries its batch size)")
    gpus = resolve_gpu_types([g.strip() for g in args.gpu.split(",") if g.strip()] if args.gpu else None)
    predictor, observations, info = _placement_predictors(args.registry, not args.no_measurements, args.predictors)
    rows = predict_what_if(job, partner, gpus, predictor, observations)
    result = WhatIf(rows, info, 0 if observations is None else observations.height)
    print_what_if(result)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return 0
