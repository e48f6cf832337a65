"""Ground truth: measured (Gavel) or synthetic throughput tables behind one type."""

from __future__ import annotations

import os
from pathlib import Path

from gogh_flows.truth.table import ThroughputTable

TRUTH_HELP = ("'synthetic' (the built-in fleet; the default), 'gavel' (simulation_throughputs.json in $GOGH_GAVEL_DIR, "
              "default ../shared/data/gavel here or beside the checkout) or the path of a Gavel throughput JSON")


def load_truth(spec: str) -> ThroughputTable:
    """``"synthetic"`` (the built-in fleet), ``"gavel"`` (Gavel's measured
    ``simulation_throughputs.json`` in ``$GOGH_GAVEL_DIR``, default ../shared/data/gavel here or beside the checkout)
    or the path of a Gavel throughput JSON file.

    The one place the CLI's ``--truth`` option is interpreted.
    """
    from gogh_flows.truth.gavel import gavel_dir, read_gavel_json
    from gogh_flows.truth.synthetic import synthetic_table

    if spec == "synthetic":
        return synthetic_table()
    if spec == "gavel":
        return read_gavel_json(gavel_dir() / "simulation_throughputs.json")
    return read_gavel_json(spec)


def recorded_truth(spec: str) -> str:
    """What a trained model records of the ``--truth`` it learned from: a name where there is one,
    else an absolute path.

    A path as typed is relative to where training ran: a retraining started from another folder (a
    ``gogh serve`` process, a Prefect worker) could not read ``../shared/data/...`` and learned from
    its logged runs alone, and calibrating from elsewhere was refused. ``gavel`` is found wherever
    the data lives (``GOGH_GAVEL_DIR``, the shared folder), so Gavel's file is recorded by that name.
    """
    from gogh_flows.truth.gavel import GAVEL_FILES, gavel_dir

    if spec in ("synthetic", "gavel"):
        return spec
    path = Path(os.path.abspath(Path(spec).expanduser()))  # absolute, its links kept (data/current -> v3)
    try:
        if path.samefile(gavel_dir() / GAVEL_FILES["simulation"]):
            return "gavel"
    except OSError:  # either file missing: the path is what there is to record
        pass
    return str(path)


def readable_truth(recorded: str) -> str:
    """A model's recorded truth as it can be read from here.

    Models trained before :func:`recorded_truth` (the shipped Gavel prior among them) hold the
    path as typed, relative to wherever training ran: one that does not exist from here but names
    a Gavel file in a ``gavel/`` folder is read from the Gavel data folder. Anything else is
    returned as recorded, so its error still names it.
    """
    from gogh_flows.truth.gavel import GAVEL_FILES, gavel_dir

    path = Path(recorded)
    if recorded in ("synthetic", "gavel") or path.is_absolute() or path.exists():
        return recorded
    if path.parent.name != "gavel" or path.name not in GAVEL_FILES.values():
        return recorded  # a file of one's own that happens to share a name with Gavel's is not Gavel's
    if path.name == GAVEL_FILES["simulation"]:
        return "gavel"
    return str(gavel_dir() / path.name) if (gavel_dir() / path.name).is_file() else recorded


__all__ = ["TRUTH_HELP", "ThroughputTable", "load_truth", "readable_truth", "recorded_truth"]
