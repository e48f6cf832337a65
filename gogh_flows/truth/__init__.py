"""Ground truth: measured (Gavel) or synthetic throughput tables behind one type."""

from __future__ import annotations

from gogh_flows.truth.table import ThroughputTable


def load_truth(spec: str) -> ThroughputTable:
    """``"synthetic"`` (the built-in fleet) or the path of a Gavel throughput JSON file.

    The one place the CLI's ``--truth`` option is interpreted.
    """
    from gogh_flows.truth.gavel import read_gavel_json
    from gogh_flows.truth.synthetic import synthetic_table

    return synthetic_table() if spec == "synthetic" else read_gavel_json(spec)


__all__ = ["ThroughputTable", "load_truth"]
