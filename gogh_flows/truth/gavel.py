"""Reader for Gavel's measured throughput files (OSDI'20 artifact, MIT licensed).

The files are read from where the user keeps them (``GOGH_GAVEL_DIR`` or
``../shared/data/gavel`` by default); the project never ships a copy.

Format: ``{worker_type: {"('<model>', <scale>)": {"null": isolated,
"('<partner>', <scale>)": [own, partner], ...}}}``. Keys are Python tuple
literals, parsed with :func:`ast.literal_eval` (literals only, never code).
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

from gogh_flows.datapaths import default_data, where_looked
from gogh_flows.truth.table import SCHEMA, ThroughputTable

GAVEL_FILES = {
    "simulation": "simulation_throughputs.json",
    "physical_cluster": "physical_cluster_throughputs.json",
}


class GavelFormatError(ValueError):
    """A throughput file that does not follow Gavel's layout."""


def gavel_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where the Gavel data lives: the argument, else ``$GOGH_GAVEL_DIR``, else ``../shared/data/gavel``
    from the working directory or beside the checkout (:func:`gogh_flows.datapaths.default_data`)."""
    if path is not None:
        return Path(path)
    env = os.environ.get("GOGH_GAVEL_DIR")
    return Path(env) if env else default_data("gavel")


def gavel_throughputs_path(
    which: str = "simulation", directory: str | os.PathLike[str] | None = None
) -> Path:
    if which not in GAVEL_FILES:
        raise ValueError(f"which must be one of {sorted(GAVEL_FILES)}, got {which!r}")
    return gavel_dir(directory) / GAVEL_FILES[which]


def _parse_key(key: str, where: str) -> tuple[str, int]:
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        value = None
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not isinstance(value[1], int)
        or value[1] < 1
    ):
        raise GavelFormatError(
            f"{where}: job key {key!r} is not a \"('<model>', <scale_factor>)\" tuple literal"
        )
    return value[0], value[1]


def _number(value: object, where: str) -> float:
    try:
        number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    except OverflowError:  # an integer too large for a float
        number = None
    if number is None or not 0 <= number < math.inf:
        raise GavelFormatError(f"{where}: expected a finite throughput >= 0, got {value!r}")
    return number


def parse_gavel_throughputs(
    data: object, *, source: str = "gavel", include_unconsolidated: bool = False
) -> ThroughputTable:
    """Turn the parsed JSON object into a :class:`ThroughputTable`.

    ``*_unconsolidated`` worker types (multi-GPU jobs spread across servers) are
    skipped unless asked for: Gavel's own simulator does not use them either.
    Pair entries for scale factors above 1 are all zeros in Gavel's data and are
    dropped, since co-location is only defined for single-GPU jobs.
    """
    if not isinstance(data, dict) or not data:
        raise GavelFormatError(
            f"{source}: expected a JSON object keyed by worker type (e.g. 'v100'), "
            f"got {type(data).__name__}"
        )
    rows: list[dict] = []
    for worker, jobs in data.items():
        if worker.endswith("_unconsolidated") and not include_unconsolidated:
            continue
        if not isinstance(jobs, dict):
            raise GavelFormatError(f"{source}: worker type {worker!r} must map to an object")
        for key, entry in jobs.items():
            where = f"{source}: {worker}/{key}"
            job, sf = _parse_key(key, where)
            if not isinstance(entry, dict) or "null" not in entry:
                raise GavelFormatError(
                    f"{where}: expected an object with a 'null' (isolated throughput) entry"
                )
            rows.append(
                {"job_type": job, "gpu_type": worker, "scale_factor": sf,
                 "throughput": _number(entry["null"], where)}
            )
            if sf != 1:
                continue
            for pkey, value in entry.items():
                if pkey == "null":
                    continue
                partner, psf = _parse_key(pkey, where)
                if psf != 1:
                    continue
                if not isinstance(value, list) or len(value) != 2:
                    raise GavelFormatError(
                        f"{where} with {pkey}: a pair must be [own, partner] throughputs, got {value!r}"
                    )
                rows.append(
                    {"job_type": job, "gpu_type": worker, "scale_factor": 1, "partner": partner,
                     "throughput": _number(value[0], where),
                     "partner_throughput": _number(value[1], where)}
                )
    if not rows:
        raise GavelFormatError(f"{source}: no throughput entries found")
    return ThroughputTable.from_rows(rows, source=source)


def read_gavel_json(
    path: str | os.PathLike[str] | None = None,
    *,
    which: str = "simulation",
    include_unconsolidated: bool = False,
) -> ThroughputTable:
    """Read one of Gavel's throughput JSON files.

    ``path`` may be the file itself or the folder holding it (then ``which``
    picks ``simulation`` or ``physical_cluster``).
    """
    p = Path(path) if path is not None else gavel_throughputs_path(which)
    if p.is_dir():
        p = p / GAVEL_FILES[which]
    if not p.exists():
        raise FileNotFoundError(
            f"Gavel throughput file not found: {p}"
            + (f" ({p.resolve()}, from the working directory {Path.cwd()})" if not p.is_absolute() else "")
            + f". Give a truth of 'synthetic', 'gavel' (the file in "
            f"GOGH_GAVEL_DIR, by default {where_looked('gavel')}) or the path of a Gavel throughput JSON "
            f"(a GpuCluster block's truth, or --truth on the command line); GOGH_GAVEL_DIR must be the "
            f"folder holding {GAVEL_FILES[which]}."
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise GavelFormatError(f"{p}: not valid JSON ({exc})") from exc
    return parse_gavel_throughputs(data, source=str(p), include_unconsolidated=include_unconsolidated)


__all__ = [
    "GAVEL_FILES", "GavelFormatError", "SCHEMA", "gavel_dir",
    "gavel_throughputs_path", "parse_gavel_throughputs", "read_gavel_json",
]
