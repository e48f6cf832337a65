"""Checks on the runs' own records (measurements): who shared a GPU, and whether knowingly."""

from __future__ import annotations

import json


def run_records(frame) -> list[dict]:
    """Each run's own record: GPU, body start and end, and the runs its decision saw there."""
    out = []
    for row in frame.iter_rows(named=True):
        extra = json.loads(row["extra"]) if isinstance(row["extra"], str) else dict(row["extra"] or {})
        out.append({"run": row["run_id"], "gpu": row["gpu_id"], "start": float(extra["body_started_at"]),
                    "end": float(extra["body_ended_at"]), "required": row["required_throughput"],
                    "predicted": row["predicted_throughput"],
                    "saw": [r for r in extra.get("placed_next_to", "").split(",") if r],
                    "partner_predicted": [float(x) for x in extra.get("partner_predicted", "").split(",") if x],
                    "partner_required": [float(x) for x in extra.get("partner_required", "").split(",") if x]})
    return out


def assert_shared_only_knowingly(records: list[dict]) -> int:
    """Two runs overlap on a GPU only if the later one's decision saw the earlier and the pair
    meets both requirements by the predictions used; returns how many pairs shared."""
    shared = 0
    for a in records:
        for b in records:
            if a["run"] >= b["run"] or a["gpu"] != b["gpu"]:
                continue
            if a["start"] < b["end"] and b["start"] < a["end"]:  # both bodies ran at once
                # the later *placed* one must have seen the other (bodies may start in either order)
                first, second = (a, b) if a["run"] in b["saw"] else (b, a)
                assert first["run"] in second["saw"], f"{a['run']} and {b['run']} shared {a['gpu']} unseen"
                i = second["saw"].index(first["run"])
                assert second["predicted"] >= second["required"]
                assert second["partner_predicted"][i] >= second["partner_required"][i]
                shared += 1
    return shared
