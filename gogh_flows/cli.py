"""The ``gogh`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

from gogh_flows.truth import TRUTH_HELP

__all__ = ["main"]


def cmd_bench_placement(args: argparse.Namespace) -> int:
    from gogh_flows.placement.bench import bench_placement
    from gogh_flows.truth import load_truth

    for flag, value, least in (("--gpus", args.gpus, 1), ("--running", args.running, 0),
                               ("--arrivals", args.arrivals, 1), ("--repeat", args.repeat, 1)):
        if value < least:
            raise ValueError(f"{flag} must be a whole number >= {least}, got {value}")
    if not args.time_limit > 0:
        raise ValueError(f"--time-limit must be a number of seconds > 0, got {args.time_limit:g}")
    if args.running >= 2 * args.gpus:  # two runs per GPU at most
        raise ValueError(f"--running {args.running} fills every slot of {args.gpus} GPUs (2 runs each): no arrival "
                         f"could be placed and the time would be that of a decision with nothing to decide; "
                         f"use --running below {2 * args.gpus}")

    result = bench_placement(
        load_truth(args.truth), gpus=args.gpus, running=args.running, arrivals=args.arrivals,
        repeat=args.repeat, seed=args.seed, time_limit_s=args.time_limit,
    )
    text = json.dumps(result, indent=2)
    if result["mean_placed"] == 0:
        print("note: no arrival was placed in any repeat (the running jobs left no slot that meets a "
              "requirement): the times are those of decisions that placed nothing", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


#: the full demo's waves and flow runs per wave
DEMO_WAVES = (3, 8)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gogh-flows")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.wave_only:
        from gogh_flows.demo import run_product_demo

        run_product_demo(seed=args.seed, out=Path(args.out) if args.out else None,
                         waves=DEMO_WAVES[0] if args.waves is None else args.waves,
                         wave_size=DEMO_WAVES[1] if args.wave_size is None else args.wave_size)
        return 0
    given = [flag for flag, v in (("--waves", args.waves), ("--wave-size", args.wave_size), ("--out", args.out))
             if v is not None]
    if given:
        raise ValueError(f"--wave-only places one fixed wave of zoo jobs and writes nothing; {', '.join(given)} "
                         "apply to the full demo. Drop them, or drop --wave-only")
    import polars as pl

    from gogh_flows.placement_demo import run_demo

    result = run_demo(seed=args.seed)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=220, fmt_str_lengths=60,
                   tbl_hide_dataframe_shape=True, float_precision=4):
        print("Placement of one wave of zoo jobs on a mixed synthetic fleet "
              "(3 x k80, p100, v100, t4, a100, h100; 2 jobs already running)\n")
        print(result.explanation)
        print("\nEnergy to completion of the same wave under each policy (one energy model;"
              " same_jobs = placed the same jobs as the optimiser):\n")
        print(result.comparison)
    return 0


def cmd_blocks_apply(args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    from gogh_flows.flows.blocks import REPO_BLOCKS, apply_block_documents

    folder = Path(args.folder) if args.folder is not None else (
        Path("blocks") if Path("blocks").is_dir() else REPO_BLOCKS)
    if args.folder is None:
        print(f"the block documents of {folder}")
    saved = apply_block_documents(folder)
    for kind, name in saved:
        print(f"saved {kind}/{name}")
    # where they went matters to a flow run on another machine, which reads its own server's
    api = PREFECT_API_URL.value()
    print(f"to the Prefect server at {api}" if api else
          f"to the database of a temporary Prefect server this process started (no PREFECT_API_URL; "
          f"PREFECT_HOME is {PREFECT_HOME.value()}); flow runs on other machines see them only through a "
          "shared server: set PREFECT_API_URL there and here, and apply them again")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from gogh_flows.flows.retrain import serve_refiner

    params = {"registry": args.registry} if args.registry else {}
    serve_refiner(args.name, cron=args.cron, interval_s=args.interval, parameters=params)
    return 0


def cmd_pool_status(args: argparse.Namespace) -> int:
    from distributed import Client
    from rich.table import Table

    from gogh_flows.progress import report_console
    from gogh_flows.runtime.leases import PoolLedger
    from gogh_flows.runtime.pool import discover_workers
    from gogh_flows.runtime.probe import SchedulerUnreachable, probe_scheduler

    if args.timeout <= 0:
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
    try:
        probe_scheduler(args.address, args.timeout)
    except SchedulerUnreachable as exc:
        raise ValueError(str(exc)) from None
    try:
        client = Client(args.address, timeout=args.timeout, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ValueError(f"cannot reach the Dask scheduler at {args.address!r} ({exc}); check the address "
                         "and that the scheduler runs") from None
    with client:
        if "gogh-ledger" not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins)):
            print(f"the scheduler at {args.address} has no gogh ledger yet: no run has been placed onto it "
                  "(start it with --preload gogh_flows.runtime.ledger, or place a run)")
            return 0
        ledger = PoolLedger(client, register=False)
        state = ledger.state()
        ledger.close()
        # what a placement would make of each worker: one that advertises no usable GPU is
        # left out of every pool (a warning above says why), so it is not an idle GPU
        try:
            usable = {d.worker for d in discover_workers(client, args.address)[0]}
        except ValueError:  # none usable: discover_workers' warnings named each
            usable = set()
    # a silent worker (hung) is also left out when it did not answer discovery: said as both
    left_out = sorted((set(state.workers) | state.silent_workers) - usable)
    if args.json:
        print(json.dumps({"now": state.now, "lease_timeout_s": state.lease_timeout_s,
                          "workers": sorted(state.workers), "left_out_workers": left_out,
                          "silent_workers": sorted(state.silent_workers), "counts": state.counts,
                          "lost_placer_runs_waiting": state.undelivered,
                          "leases": [lease.__dict__ for lease in state.leases]}, indent=2))
        return 0
    table = Table(title=f"GPU slots held on {args.address} (lease {state.lease_timeout_s:g} s)")
    for col in ("GPU", "run", "job type", "required steps/s", "claimed", "body", "last sign of life"):
        table.add_column(col)
    for gpu_id, leases in sorted(state.occupants().items()):
        for lease in leases:
            body = "queued" if lease.started_at is None else f"running {state.now - lease.started_at:.0f} s"
            if lease.cancel:
                body += " (stop asked)"
            table.add_row(gpu_id, lease.run_id, lease.job_type, f"{lease.required_throughput:g}",
                          f"{state.now - lease.claimed_at:.0f} s ago", body, f"{state.now - lease.seen_at:.1f} s ago")
    console = report_console()
    console.print(table)
    idle = sorted((usable & set(state.workers)) - {lease.worker for lease in state.leases})
    console.print(f"workers: {len(state.workers)} ({len(idle)} idle: {', '.join(idle) or '-'}"
                  + (f"; {len(left_out)} left out of the pool (misconfigured or not answering): {', '.join(left_out)}" if left_out else "")
                  + (f"; {len(state.silent_workers)} silent (no heartbeat lately: hung or overloaded; not placed on "
                     f"until heard from): {', '.join(sorted(state.silent_workers))}" if state.silent_workers else "")
                  + ")" + ("; " + ", ".join(f"{k} {v}" for k, v in sorted(state.counts.items()))
                           if state.counts else "; no claims yet"))
    if state.undelivered:
        console.print(f"{state.undelivered} run(s) whose placing process was lost wait for a placing process "
                      "logging to their tracking store to log their measurements and mark their flow runs Crashed")
    return 0


#: commands whose parsers live with their code; importing it costs seconds (torch, OR-Tools),
#: so only the command being run is imported, and all of them for ``gogh --help``
_COMMAND_MODULES = {
    "simulate": "gogh_flows.sim.cli",
    "predictors": "gogh_flows.predict.cli",
    "predict": "gogh_flows.whatif",
    "power": "gogh_flows.power_limits",
    "rltune": "gogh_flows.sim.rltune_train",
}
#: commands defined in this module
_OWN_COMMANDS = frozenset({"demo", "blocks", "serve", "pool", "bench"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``command``) one whose only other-module command is that one."""
    parser = argparse.ArgumentParser(
        prog="gogh", description="gogh-flows: energy-aware placement of Prefect flow runs on mixed GPU fleets, "
        "and the tools that evaluate it (simulation, predictors, power limits)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the whole loop: placed flow runs on an emulated fleet, "
                          "measurements, retraining, and the energy against greedy-fastest")
    demo.add_argument("--seed", type=int, default=0, help="seeds the jobs, their requirements and the emulated fleet (default 0; one seed's figures still move from run to run: the emulated GPUs run in wall-clock time)")
    demo.add_argument("--out", default=None, help="folder for summary.json and the plot (default: "
                      "$GOGH_HOME/demo, else .gogh/demo)")
    demo.add_argument("--waves", type=int, default=None, help=f"waves of flow runs (default {DEMO_WAVES[0]})")
    demo.add_argument("--wave-size", type=int, default=None, help=f"flow runs per wave (default {DEMO_WAVES[1]})")
    demo.add_argument("--wave-only", action="store_true",
                      help="only place one wave with the optimiser and every baseline (no Prefect)")
    demo.set_defaults(func=cmd_demo)

    blocks = sub.add_parser("blocks", help="Prefect blocks of gogh-flows")
    blocks_sub = blocks.add_subparsers(dest="blocks", required=True)
    ba = blocks_sub.add_parser("apply", help="validate and save every block document (*.json) of a folder, "
                               "or one document")
    ba.add_argument("folder", nargs="?", default=None, help="a folder of *.json block documents, or one of "
                    "them (default: ./blocks if there is one, else the examples installed with gogh-flows)")
    ba.set_defaults(func=cmd_blocks_apply)

    serve = sub.add_parser("serve", help="serve the refiner-retraining flow as a scheduled deployment")
    when = serve.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="cron schedule, e.g. '0 * * * *'")
    when.add_argument("--interval", type=float, help="seconds between runs")
    serve.add_argument("--name", default="gogh-refine")
    serve.add_argument("--registry", help="name of a saved PredictorRegistry block (default: embedded)")
    serve.set_defaults(func=cmd_serve)

    pool = sub.add_parser("pool", help="the shared GPU pool")
    pool_sub = pool.add_subparsers(dest="pool", required=True)
    ps = pool_sub.add_parser("status", help="who holds which GPU slot, from the pool's ledger")
    ps.add_argument("address", help="the Dask scheduler, e.g. tcp://10.0.0.5:8786")
    ps.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the scheduler (default 10)")
    ps.add_argument("--json", action="store_true", help="print the ledger's state as JSON")
    ps.set_defaults(func=cmd_pool_status)

    for name, module in _COMMAND_MODULES.items():
        if command is None or command == name:
            importlib.import_module(module).add_parser(sub)
        else:  # named, unimported: the usage line lists every command whichever was given
            sub.add_parser(name)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bp = bench_sub.add_parser("placement", help="decision time of the optimiser")
    bp.add_argument("--gpus", type=int, required=True, help="GPUs in the fleet (a mix of the truth's types)")
    bp.add_argument("--running", type=int, default=0, help="jobs already running on it (default 0)")
    bp.add_argument("--arrivals", type=int, default=1, help="jobs placed in one decision (default 1); mean_placed says how many found a GPU that meets their requirement")
    bp.add_argument("--repeat", type=int, default=10, help="decisions timed (default 10)")
    bp.add_argument("--seed", type=int, default=0, help="seeds the fleet, the jobs and their requirements (default 0)")
    bp.add_argument("--time-limit", type=float, default=2.0, help="CP-SAT time limit, seconds")
    bp.add_argument("--truth", default="synthetic", help=TRUTH_HELP)
    bp.add_argument("--json", help="write the figures to this file")
    bp.set_defaults(func=cmd_bench_placement)
    _name_subcommands(parser)
    return parser


def _name_subcommands(parser: argparse.ArgumentParser) -> None:
    """A group given without its command (`gogh power`) said "the following arguments are
    required: power", the group's own name; argparse names the choices when it has a metavar."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            if action.metavar is None and action.choices:
                action.metavar = "{" + ",".join(action.choices) + "}"
            for child in action.choices.values():
                _name_subcommands(child)


# options naming a file a command writes, and those naming a file or a folder it writes into
# (a command whose --out is a folder sets ``out_is_folder``; one whose --out is a file, ``out_is_file``)
_FILE_OUTPUTS = ("json", "plot")
_FOLDER_OUTPUTS = ("out",)


def check_outputs_writable(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before the command runs, not after.

    An evaluation can run for minutes; finding then that its ``--json`` lands in a read-only
    or missing place loses all of it. A missing parent folder is fine (commands create it), so
    the check walks up to the nearest folder that exists and asks whether it can be written.
    """
    for name in _FILE_OUTPUTS + _FOLDER_OUTPUTS:
        value = getattr(args, name, None)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        option = f"--{name}"
        if name in _FILE_OUTPUTS and path.is_dir():
            suffix = "png" if name == "plot" else "json"
            raise ValueError(f"{option} {value!r} is a folder; give a file name in it (e.g. {path / ('out.' + suffix)})")
        if name == "out" and getattr(args, "out_is_file", False) and path.is_dir():
            raise ValueError(f"{option} {value!r} is a folder; give a file name in it (e.g. {path / 'out.json'})")
        if name in _FOLDER_OUTPUTS and getattr(args, "out_is_folder", False) and path.exists() and not path.is_dir():
            raise ValueError(f"{option} {value!r} is a file; it names a folder to write into (one that does not "
                             "exist yet is made)")
        if name == "plot":
            from matplotlib.backend_bases import FigureCanvasBase

            formats = FigureCanvasBase.get_supported_filetypes()
            if path.suffix and path.suffix.lstrip(".").lower() not in formats:  # none: a PNG
                raise ValueError(f"{option} {value!r}: the plot's format comes from its file name's suffix, and "
                                 f"{path.suffix!r} is not one matplotlib writes; use .png (or "
                                 f"{', '.join('.' + f for f in sorted(formats) if f != 'png')})")
        if path.is_file() and not os.access(path, os.W_OK):
            raise ValueError(f"{option} {value!r} exists and cannot be written; choose another path")
        existing = path if name in _FOLDER_OUTPUTS and path.is_dir() else path.parent
        while not existing.exists():
            existing = existing.parent
        try:  # a file made and removed: permissions, read-only mounts and pseudo-filesystems alike
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            raise ValueError(f"{option} {value!r} cannot be written: nothing can be created in {str(existing)!r} "
                             f"({exc.strerror or exc}); choose another path") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `gogh pool status` need not import torch: 0.5 s instead of 5 (an unknown or no command
    # gets the whole parser, so its error and --help list every command)
    first = argv[0] if argv and not argv[0].startswith("-") else None
    known = first in _OWN_COMMANDS or first in _COMMAND_MODULES
    args = build_parser(first if known else None).parse_args(argv)
    try:
        check_outputs_writable(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError, ConnectionError) as exc:  # TrackingUnavailableError too
        print(f"gogh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
