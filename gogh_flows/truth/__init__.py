"""Ground truth: measured (Gavel) or synthetic throughput tables behind one type."""

from __future__ import annotations

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


__all__ = ["TRUTH_HELP", "ThroughputTable", "load_truth"]
