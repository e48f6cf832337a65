"""``gogh predictors train|evaluate``: shipped priors and the leave-one-family-out report."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from gogh_flows.truth import TRUTH_HELP, readable_truth, recorded_truth

__all__ = ["add_parser", "check_epochs", "cmd_calibrate", "cmd_evaluate", "cmd_train", "format_report"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predictors", help="train and evaluate the throughput predictors (P1, P2)")
    ps = p.add_subparsers(dest="predictors", required=True)

    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config

    P1_EPOCHS, P2_EPOCHS = P1Config.epochs, P2Config.epochs  # noqa: N806 - the help's defaults

    def common(x: argparse.ArgumentParser, choose_encoder: bool = False, own_model: bool = False) -> None:
        """``own_model``: defaults are the trained model's own (``calibrate``), not training's."""
        own = " (default: the model's own, as its config.json records)"
        x.add_argument("--truth", default=None if own_model else "synthetic",
                       help=TRUTH_HELP.replace("; the default", "") + own if own_model else TRUTH_HELP)
        if own_model:
            x.add_argument("--encoder", default=None, choices=("gru", "ff", "transformer", "mean"),
                           help="P1 job encoder of the inner split's P1s" + own)
        elif choose_encoder:
            x.add_argument("--encoder", default="inner",
                           help="P1 job encoder: 'inner' (default) chooses per held-out family, on the inner split "
                                "(the training families only), between the mean of the gru, ff and transformer P1s "
                                "and the one of them the inner split picks; one name (gru, ff, transformer, mean) "
                                "fixes it; a comma-separated list chooses among those")
        else:
            x.add_argument("--encoder", default="transformer",
                           help="P1 job encoder: gru, ff, transformer (default), mean (one P1 per encoder, their "
                                "mean in log space), or 'inner': the mean or the single encoder, whichever the inner "
                                "split of the training families prefers, as `evaluate` chooses (a comma-separated "
                                "list chooses among those)")
        x.add_argument("--seed", type=int, default=0, help="seeds training (default 0)")
        x.add_argument("--gpu-types", help="comma-separated GPU types to keep (default: "
                       + ("the types the refiner was trained on)" if own_model else "all in the truth)"))
        x.add_argument("--p1-epochs", type=int, help="P1 epochs" + (own if own_model else f" (default {P1_EPOCHS})"))
        x.add_argument("--p2-epochs", type=int,
                       help="P2 epochs, fixed (default: chosen among 150, 300, 600 and 1200 per held-out family on the "
                            "inner split)" if choose_encoder else "P2 epochs" + (own if own_model else f" (default {P2_EPOCHS})"))

    t = ps.add_parser("train", help="train P1 and P2 on all data and write DIR/p1 and DIR/p2")
    common(t)
    t.add_argument("--out", required=True, help="directory to write p1/ and p2/ into")
    t.add_argument("--exclude-family", action="append", default=[],
                   help="leave this model family out of training entirely (repeatable)")
    t.set_defaults(func=cmd_train, out_is_folder=True)

    c = ps.add_parser("calibrate", help="choose the ensemble's weights for a trained refiner (DIR/p2) and "
                                        "calibrate its intervals, on the data it was trained on")
    common(c, own_model=True)
    c.add_argument("--model", required=True, help="directory holding p1/ and p2/ (as `train --out` wrote it)")
    c.add_argument("--exclude-family", action="append", default=[],
                   help="the families the model was trained without (default: as its config.json records)")
    c.set_defaults(func=cmd_calibrate)

    e = ps.add_parser("evaluate", help="leave-one-family-out errors of P1, P2 and the baselines")
    common(e, choose_encoder=True)
    e.add_argument("--holdout-family", default="all",
                   help="a family name, or 'all' (every family in turn; the default)")
    e.add_argument("--repeats", type=int, default=5,
                   help="random draws for the siblings metric (the other protocols reveal every entry in turn)")
    e.add_argument("--exclude-anomalies", action="store_true",
                   help="leave out the entries the data check flags as measurement artifacts (default: keep "
                        "them, and report them)")
    e.add_argument("--json", help="write the report to this file")
    e.set_defaults(func=cmd_evaluate)


def check_epochs(p1_epochs: int | None, p2_epochs: int | None) -> None:
    """``--p1-epochs`` and ``--p2-epochs`` (None: the default), named as given: P1Config's own
    check says 'P1 hidden must be >= 4, epochs >= 1 and lr > 0'."""
    for flag, value in (("--p1-epochs", p1_epochs), ("--p2-epochs", p2_epochs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a whole number of epochs >= 1, got {value}")


#: P2 epochs ``evaluate`` chooses from on the inner split unless ``--p2-epochs`` fixes them
P2_EPOCH_CHOICES = (150, 300, 600, 1200)


def encoder_candidates(value: str) -> tuple[str, ...]:
    """``--encoder`` of ``evaluate``: 'inner' (every encoder, chosen on the inner split), one
    name, or a comma-separated list, checked here so a typo stops before any training."""
    from gogh_flows.predict.p1 import KINDS

    if value.strip().casefold() == "inner":
        return KINDS
    names = tuple(dict.fromkeys(v.strip().casefold() for v in value.split(",") if v.strip()))
    unknown = [n for n in names if n not in KINDS]
    if not names or unknown:
        raise ValueError(f"--encoder {value!r}: expected 'inner', one of {', '.join(KINDS)}, or a comma-separated "
                         f"list of them" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return names


def _configs(args: argparse.Namespace):
    """P1's and P2's configurations from the options, and ``--encoder``'s candidates."""
    from dataclasses import replace

    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config

    check_epochs(args.p1_epochs, args.p2_epochs)
    candidates = encoder_candidates(args.encoder)
    # with a choice, the transformer (the product's default) wins ties
    p1 = P1Config(encoder="transformer" if "transformer" in candidates else candidates[0], seed=args.seed)
    if args.p1_epochs is not None:
        p1 = replace(p1, epochs=args.p1_epochs)
    p2 = P2Config(seed=args.seed)
    if args.p2_epochs is not None:
        p2 = replace(p2, epochs=args.p2_epochs)
    return p1, p2, candidates


def _data(args: argparse.Namespace, anomalies: list | None = None):
    """The truth as a MeasuredSet; ``anomalies`` (a list) receives what the data check flags."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.truth import load_truth
    from gogh_flows.truth.anomalies import find_anomalies, without_anomalies

    table = load_truth(args.truth)
    if args.gpu_types:
        keep = [g.strip() for g in args.gpu_types.split(",") if g.strip()]
        missing = [g for g in keep if g not in table.gpu_types]
        if missing:
            raise ValueError(f"--gpu-types {missing} not in the truth ({', '.join(table.gpu_types)})")
        table = table.restrict(gpu_types=keep)
    flagged = find_anomalies(table)
    if anomalies is not None:
        anomalies.extend(flagged)
    if flagged:
        print(f"data check: {len(flagged)} entr{'y' if len(flagged) == 1 else 'ies'} of {table.source} stand far "
              f"from the rest (a measurement artifact, or a job limited by what the others are not: "
              f"{flagged[0].detail}{' ...' if len(flagged) > 1 else ''}); "
              + ("left out (--exclude-anomalies)" if getattr(args, "exclude_anomalies", False)
                 else "kept (--exclude-anomalies leaves them out)" if hasattr(args, "exclude_anomalies")
                 else "kept: training uses every entry (`gogh predictors evaluate --exclude-anomalies` "
                      "scores without them)"), file=sys.stderr)
        if getattr(args, "exclude_anomalies", False):
            table = without_anomalies(table, flagged)
    return table, MeasuredSet.from_table(table)


def _excluding(full, families: list[str]):
    """``full`` without ``families``, refused while nothing is trained if that leaves fewer than
    the two families the refiner's training needs."""
    data = full.without(families) if families else full
    if len(data.families) < 2:
        raise ValueError(f"--exclude-family {', '.join(families)} leaves {len(data.families)} model "
                         f"famil{'y' if len(data.families) == 1 else 'ies'} of {', '.join(full.families)}; "
                         "training needs at least two (the refiner learns from P1s trained with each left out "
                         "in turn): exclude fewer")
    return data


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces this run, rebuilt from the parsed options (not sys.argv)."""
    parts = ["gogh", "predictors", "train", "--truth", args.truth, "--out", args.out,
             "--encoder", args.encoder, "--seed", str(args.seed)]
    for flag, value in (("--gpu-types", args.gpu_types), ("--p1-epochs", args.p1_epochs),
                        ("--p2-epochs", args.p2_epochs)):
        if value is not None:
            parts += [flag, str(value)]
    for fam in args.exclude_family:
        parts += ["--exclude-family", fam]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from gogh_flows.predict.ensemble import setting_name
    from dataclasses import replace

    from gogh_flows.predict.evaluate import (
        EvalConfig, calibrate_refiner, choose_encoder, in_sample_metrics, out_of_family_p1,
    )
    from gogh_flows.predict.io import save_model
    from gogh_flows.predict.layout import Layout
    from gogh_flows.predict.p1 import ENCODERS, MEAN, train_p1
    from gogh_flows.predict.p2 import train_p2

    torch.set_num_threads(1)  # tiny networks: threads only add contention
    p1_cfg, p2_cfg, candidates = _configs(args)
    table, full = _data(args)
    data = _excluding(full, args.exclude_family)
    from gogh_flows.progress import Progress

    start = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    # one unit per network trained: P1, one P1 per family left out (P2's inputs), P2, and the
    # ensemble's weights and the intervals (a P2 per family left out)
    units, done = 3 + len(data.families), 0
    with Progress() as bars:
        def step() -> None:
            nonlocal done
            done += 1
            bars.update("training", done, units)

        layout = Layout(data.gpus, data.names)
        if len(candidates) > 1:
            # as `evaluate` chooses for a held-out family, here on every training family
            trained = set(candidates) - {MEAN} | (set(ENCODERS) if MEAN in candidates else set())
            units += len(data.families) * (len(trained) - 1)
            encoder, oof, errors = choose_encoder(
                data, layout, dict(data.jobs), EvalConfig(p1=p1_cfg, p2=p2_cfg, encoders=candidates, seed=args.seed),
                log, done=step)
            p1_cfg = replace(p1_cfg, encoder=encoder)
            choice = {"chosen": encoder, "inner_male": errors}
        bars.update("training", done, units)
        p1 = train_p1(data, p1_cfg, log=log)
        step()
        if len(candidates) > 1:
            p1.trained_on["encoder_choice"] = choice
        else:
            oof = out_of_family_p1(data, layout, dict(data.jobs), p1_cfg, log, done=step)
        truth = layout.truth(data, data.names)
        p2 = train_p2(layout, oof, truth, p2_cfg, log=log)
        step()
        intervals, ensemble = calibrate_refiner(data, oof, EvalConfig(p1=p1_cfg, p2=p2_cfg, seed=args.seed))
        step()
    p2.trained_on.update(intervals=intervals.to_dict(), ensemble=ensemble.to_dict())
    metrics = in_sample_metrics(p1, p2, data, layout, oof)
    secs = time.perf_counter() - start
    source = table.source
    excluded = ", ".join(args.exclude_family) if args.exclude_family else "none"
    command = _command(args)
    data_lines = (
        f"- truth: `{args.truth}` ({source}); GPU types: {', '.join(data.gpus)}\n"
        f"- {len(data.names)} job types from families {', '.join(data.families)}; "
        f"{data.iso.height} isolated and {data.pairs.height} co-located measurements (one per side)\n"
        f"- families left out of training entirely: **{excluded}**\n"
    )
    out = Path(args.out)
    p1_card = (
        f"# P1 throughput estimator ({p1_cfg.encoder})\n\n"
        "Predicts a job's isolated throughput on every GPU type and its throughput next to any "
        "partner, from the job's layer features and the GPU type's catalog figures.\n\n"
        f"## Data\n\n{data_lines}\n## Command\n\n```\n{command}\n```\n\n"
        + (f"## Encoder, chosen on the inner split\n\n{p1_cfg.encoder}, by the mean absolute log error of P1s "
           "trained without each family, on that family (nothing observed; choosing one encoder scored nested): "
           + ", ".join(f"{k} {v:.3f}" for k, v in choice["inner_male"].items()) + "\n\n"
           if len(candidates) > 1 else "")
        + f"## Training metrics (on its own training data; see docs/predictors.md for held-out figures)\n\n"
        f"- loss (log-space MSE): first epoch {p1.trained_on['first_loss']:.4f}, last {p1.trained_on['final_loss']:.4f}\n"
        f"- in-sample isolated MAPE {metrics['p1_isolated_mape']:.1%}, co-located MAPE {metrics['p1_colocated_mape']:.1%}\n"
        f"- training time {secs:.0f} s (P1 + P2 together)\n\n"
        f"## Configuration\n\n```json\n{json.dumps(p1.config_dict()['p1'], indent=2)}\n```\n\n"
        "Load with `gogh_flows.predict.io.load_p1(path)` (safetensors + JSON, no pickle).\n"
    )
    p2_card = (
        "# P2 refiner\n\n"
        "Corrects P1's prediction vector of a job (every GPU type, every partner below) with "
        "whatever has been measured for it. Layout: "
        f"{len(layout.gpus)} GPU types x (1 + {len(layout.partners)} partners) = {layout.size} entries.\n\n"
        f"## Data\n\n{data_lines}"
        "- inputs: out-of-family P1 predictions (each job's vector from a P1 trained without its "
        "family), so the refiner learns P1's errors on unseen models\n\n"
        f"## Command\n\n```\n{command}\n```\n\n"
        "## Training metrics (jobs it was trained on; held-out figures are in docs/predictors.md)\n\n"
        f"- loss: first epoch {p2.trained_on['first_loss']:.4f}, last {p2.trained_on['final_loss']:.4f}\n"
        f"- isolated MAPE after 1 observation {metrics['p2_isolated_mape_1obs']:.1%} "
        f"(out-of-family P1 alone: {metrics['oof_p1_isolated_mape']:.1%})\n"
        f"- co-located MAPE after 1 observation {metrics['p2_colocated_mape_1obs']:.1%} "
        f"(out-of-family P1 alone: {metrics['oof_p1_colocated_mape']:.1%})\n\n"
        "## What placements predict with\n\n"
        "Not P2 alone: its predictions averaged in log space with the per-type mean (a job with nothing "
        "measured) or, for a measured job, the roofline ratio or the per-type mean shifted to its "
        "measurements, P2's weight and the baseline chosen on the inner split of these "
        "families (`trained_on.ensemble` in config.json): "
        + ", ".join(f"{case} {setting_name(w, ensemble.reaches.get(case, math.inf))}"
                    + (f" with the {ensemble.baseline(case).replace('_', '-')} row" if case.endswith("_1obs") else "")
                    for case, w in ensemble.weights.items())
        + " (`w<r`: a job farther than r from every training job, in P1's input space, gets the baseline "
        "alone). The intervals (`trained_on.intervals`) are the ensemble's. See docs/predictors.md.\n\n"
        f"## Configuration\n\n```json\n{json.dumps(p2.config_dict()['p2'], indent=2)}\n```\n\n"
        "Load with `gogh_flows.predict.io.load_p2(path)` (safetensors + JSON, no pickle).\n"
    )
    truth = recorded_truth(args.truth)  # readable from any folder a retraining or calibration runs in
    p1.trained_on.update({"truth": truth, "excluded_families": list(args.exclude_family)})
    p2.trained_on.update({"truth": truth, "excluded_families": list(args.exclude_family),
                          "p1_encoder": p1_cfg.encoder,
                          "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)}})
    save_model(p1, out / "p1", p1_card)
    save_model(p2, out / "p2", p2_card)
    print(json.dumps({"out": str(out), "seconds": round(secs, 1), "p1_encoder": p1_cfg.encoder,
                      **{k: round(v, 4) for k, v in metrics.items()}}, indent=2))
    return 0


def _same_table(given: str, recorded: str) -> bool:
    """Two names of one truth ("gavel" and the path it reads, a path written from elsewhere)."""
    from gogh_flows.truth import load_truth

    try:
        a = load_truth(given)
    except (OSError, ValueError):
        return False
    try:
        b = load_truth(readable_truth(recorded))
    except (OSError, ValueError):
        # a path recorded relative to where training ran: the file's name is the evidence left
        return Path(a.source).name == Path(recorded).name
    return a.job_types == b.job_types and a.gpu_types == b.gpu_types and a.isolated_frame().equals(b.isolated_frame())


def _same_data_as_trained(args: argparse.Namespace, trained_on: dict) -> None:
    """Intervals calibrated on other data than the refiner learned from would be stored as its
    own: the truth and the families left out default to the model's, and must match if given."""
    from gogh_flows.truth import load_truth

    truth, excluded = trained_on.get("truth"), trained_on.get("excluded_families")
    if args.truth is None:
        args.truth = readable_truth(truth) if truth else "synthetic"
        try:
            load_truth(args.truth)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the refiner in {args.model!r} was trained on {truth!r}, which cannot be read from "
                             f"here ({exc}); give that data with --truth (--truth gavel for Gavel's "
                             "simulation_throughputs.json, found through GOGH_GAVEL_DIR)") from None
    elif truth is not None and args.truth != truth and not _same_table(args.truth, truth):
        raise ValueError(f"--truth {args.truth!r}, but the refiner in {args.model!r} was trained on {truth!r}; "
                         "calibrate on its own data: give that data with --truth, or drop --truth where that "
                         "path can be read")
    if excluded is not None:
        if args.exclude_family and {f.lower() for f in args.exclude_family} != {f.lower() for f in excluded}:
            raise ValueError(f"--exclude-family {args.exclude_family}, but the refiner in {args.model!r} was "
                             + (f"trained without {excluded}" if excluded else "trained on every family")
                             + "; drop --exclude-family to use its own")
        args.exclude_family = list(excluded)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """The ensemble's weights and intervals for a refiner trained before they existed: the same
    inner split as ``train``."""
    import torch

    from dataclasses import replace

    from gogh_flows.predict.evaluate import EvalConfig, calibrate_refiner, out_of_family_p1
    from gogh_flows.predict.io import load_p1, load_p2, record_trained_on
    from gogh_flows.predict.layout import Layout

    torch.set_num_threads(1)
    check_epochs(args.p1_epochs, args.p2_epochs)
    model = Path(args.model) / "p2"
    p2 = load_p2(model)
    _same_data_as_trained(args, p2.trained_on)
    # the P1s of the inner split are trained as the model's own P1 was (its config.json), and P2s
    # as its P2: with the command's defaults instead, a model trained with other epochs or another
    # encoder got weights and intervals chosen for other models than its own
    p1_cfg = load_p1(Path(args.model) / "p1").config
    if args.encoder is not None:
        p1_cfg = replace(p1_cfg, encoder=args.encoder)
    if args.p1_epochs is not None:
        p1_cfg = replace(p1_cfg, epochs=args.p1_epochs)
    p2_cfg = p2.config if args.p2_epochs is None else replace(p2.config, epochs=args.p2_epochs)
    if not args.gpu_types:  # the GPU types the refiner was trained on, not all the truth has
        args.gpu_types = ",".join(p2.layout.gpus)
    _, full = _data(args)
    data = _excluding(full, args.exclude_family)
    layout = Layout(data.gpus, data.names)
    oof = out_of_family_p1(data, layout, dict(data.jobs), p1_cfg,
                           lambda s: print(s, file=sys.stderr, flush=True))
    intervals, ensemble = calibrate_refiner(data, oof, EvalConfig(p1=p1_cfg, p2=p2_cfg, seed=args.seed))
    stored, bounds = ensemble.to_dict(), intervals.to_dict()
    record_trained_on(model, {"ensemble": stored, "intervals": bounds})
    print(json.dumps({"model": str(model), "ensemble_weights": stored["weights"], "ensemble_reaches": stored["reaches"],
                      "ensemble_baselines": stored["baselines"], **bounds}, indent=2))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from gogh_flows.predict.evaluate import EvalConfig, leave_one_family_out

    torch.set_num_threads(1)
    p1_cfg, p2_cfg, candidates = _configs(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be a whole number of draws >= 1, got {args.repeats}")
    anomalies: list = []
    _, full = _data(args, anomalies)
    holdouts = None if args.holdout_family.strip().casefold() == "all" else [args.holdout_family]
    from gogh_flows.progress import Progress

    with Progress() as bars:
        report = leave_one_family_out(
            full, holdouts, EvalConfig(p1=p1_cfg, p2=p2_cfg, repeats=args.repeats, seed=args.seed,
                                       encoders=candidates if len(candidates) > 1 else (),
                                       p2_epochs=() if args.p2_epochs is not None else P2_EPOCH_CHOICES),
            log=lambda s: print(s, file=sys.stderr, flush=True), progress=bars.update,
        )
    report["truth"] = args.truth
    report["anomalies"] = {"excluded": bool(args.exclude_anomalies),
                           "entries": [a.as_dict() for a in anomalies]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        # strict JSON: a metric a family cannot have (no siblings in a one-job family) is null
        Path(args.json).write_text(json.dumps(_nan_to_none(report), indent=2, allow_nan=False) + "\n")
    print(format_report(report))
    return 0


def format_report(report: dict) -> str:
    """Per-family and mean figures, one row per (family, method): the mean absolute log error
    (primary) and MAPE (secondary, in %), isolated and co-located, with 0 and 1 observation."""
    from gogh_flows.predict.evaluate import HEADLINE, METHODS

    head = ["family", "method", *HEADLINE]
    rows = [head]
    means = [("MEAN (families)", report["mean"])]
    if "mean_over_jobs" in report:
        means.append(("MEAN (job types)", report["mean_over_jobs"]))
    for fam, by_method in [*report["families"].items(), *means]:
        for m in METHODS:
            rows.append([fam, m, *(_cell(k, by_method[m].get(k)) for k in HEADLINE)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + (f"\n(male: mean absolute log error; mape in %; {report.get('seconds', '?')} s)")


def _cell(metric: str, v: float | None) -> str:
    if "mape" in metric:
        return percent(v)
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.3f}"


def _nan_to_none(value):
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def percent(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.1f}"
