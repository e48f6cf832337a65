"""Model registry for gogh's predictors, on MLflow, without ever unpickling weights.

A registered model version is a plain directory (weights.safetensors + config.json +
optional MODEL_CARD.md) logged as the artifacts of one MLflow run in the "gogh-models"
experiment; the version points at that artifact folder. We deliberately avoid
`mlflow.pytorch.log_model`: it pickles the module (and MLflow 3 adds torch.export), so
loading it back would execute whatever the registry holds. Here loading is the job of
`gogh_flows.predict.io.load_model`, which only reads safetensors and JSON, and every
download is checked against that allow-list before it is handed out.

Aliases carry the promotion workflow: placements load `models:/<name>@champion`, the
retraining flow registers a `challenger` and moves `champion` when it wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from gogh_flows.tracking.backend import (
    as_uri,
    check_reachable,
    mlflow_client,
    default_artifact_location,
    get_or_create_experiment,
)
from gogh_flows.tracking.errors import ModelNotFoundError, UnsafeArtifactError
from gogh_flows.tracking.safety import verify_weights_only

log = logging.getLogger(__name__)

MODELS_EXPERIMENT = "gogh-models"
ARTIFACT_PATH = "model"  # sub-folder of the run's artifacts that holds the model directory
DEFAULT_ALIAS = "champion"
#: the tag a registered model carries while a process registers the shipped prior into it
PRIOR_TAG = "gogh.registering_prior"
#: how long a process waits for another one registering the shipped prior before doing it itself
PRIOR_WAIT_S = 120.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_MAX_LISTED = 20


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference: exactly one of alias / version is set."""

    name: str
    alias: str | None = None
    version: int | None = None


def parse_model_ref(name_or_uri: str, alias: str | None = DEFAULT_ALIAS) -> ModelRef:
    """Read `models:/NAME@ALIAS`, `models:/NAME/VERSION` or a bare NAME (which uses `alias`)."""
    text = str(name_or_uri).strip()
    if text.startswith("models:/"):
        body = text[len("models:/"):]
        if "@" in body:
            name, _, al = body.partition("@")
            _check_name(name)
            if not al:
                raise ValueError(f"model URI {text!r} has an empty alias; write models:/{name}@champion")
            return ModelRef(name, alias=al)
        name, sep, ver = body.partition("/")
        _check_name(name)
        if not sep:
            raise ValueError(
                f"model URI {text!r} names neither an alias nor a version; "
                f"write models:/{name}@champion or models:/{name}/<version>"
            )
        if not ver.isdigit() or int(ver) < 1:
            raise ValueError(
                f"model URI {text!r}: version must be a positive integer (stages such as "
                f"'Production' are not used by gogh; use an alias: models:/{name}@champion)"
            )
        return ModelRef(name, version=int(ver))
    _check_name(text)
    if not alias:
        raise ValueError(f"no alias given for model {text!r}; pass alias='champion' or a models:/ URI")
    return ModelRef(text, alias=alias)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid model name {name!r}: use letters, digits, '_', '.', '-' "
            "(no '/', '@' or quotes: they would make models:/ URIs ambiguous)"
        )


def _clean_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metric {key!r} must be a number, got {value!r}") from exc
        if not math.isfinite(number):
            raise ValueError(f"metric {key!r} must be finite, got {value!r}")
        out[str(key)] = number
    return out


def _listing(items: list[str]) -> str:
    if not items:
        return "none"
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _MAX_LISTED else "")


class ModelRegistry:
    """gogh's view of an MLflow model registry: directories in, verified directories out."""

    def __init__(
        self,
        tracking_uri: str,
        registry_uri: str | None = None,
        *,
        artifact_location: str | Path | None = None,
    ):
        """`artifact_location` applies when the "gogh-models" experiment is first created; by
        default a SQLite store keeps artifacts next to its database and a server decides."""
        if not tracking_uri:
            raise ValueError("tracking_uri is required, e.g. sqlite:///mlflow.db or http://127.0.0.1:5000")
        self.tracking_uri = str(tracking_uri)
        self.registry_uri = str(registry_uri or tracking_uri)
        self._artifact_location = as_uri(artifact_location)
        self._client = mlflow_client(self.tracking_uri, self.registry_uri)
        self._checked = False
        self._experiment_id: str | None = None

    # -- plumbing -------------------------------------------------------------------
    def _ready(self) -> MlflowClient:
        if not self._checked:
            check_reachable(self.tracking_uri)
            if self.registry_uri != self.tracking_uri:
                check_reachable(self.registry_uri)
            self._checked = True
        return self._client

    def _experiment(self) -> str:
        if self._experiment_id is None:
            location = self._artifact_location or default_artifact_location(self.tracking_uri, MODELS_EXPERIMENT)
            self._experiment_id = get_or_create_experiment(self._ready(), MODELS_EXPERIMENT, location)
        return self._experiment_id

    def _model_names(self) -> list[str]:
        return sorted(m.name for m in self._ready().search_registered_models(max_results=1000))

    def _get_model(self, name: str):
        _check_name(name)
        try:
            return self._ready().get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise ModelNotFoundError(
                f"no registered model {name!r} in {self.registry_uri}; registered models: "
                f"{_listing(self._model_names())}. Register one with ModelRegistry.register "
                "or `ensure_registered` (the shipped prior)."
            ) from exc

    def _version_numbers(self, name: str) -> list[int]:
        found = self._ready().search_model_versions(f"name='{name}'")
        return sorted(int(v.version) for v in found)

    def _ensure_model(self, name: str, tags: Mapping[str, str] | None = None) -> bool:
        """The registered model, created (with ``tags``) if missing; whether this call created it."""
        client = self._ready()
        try:
            client.get_registered_model(name)
            return False
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            client.create_registered_model(
                name, tags=dict(tags or {}),
                description="gogh-flows predictor (safetensors + JSON config; never pickled)")
            return True
        except MlflowException as exc:  # another process created it first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return False

    # -- public API -----------------------------------------------------------------
    def register(
        self,
        name: str,
        directory: Path,
        *,
        alias: str | None = None,
        metrics: Mapping[str, float] | None = None,
        tags: Mapping[str, str] | None = None,
        description: str | None = None,
        p1_uri: str | None = None,
    ) -> int:
        """Log `directory` as a new run's artifacts and make it a new version of `name`.

        The directory is checked to be weights-only first, so an unsafe model never enters
        the registry. Metrics go to the run (the evaluation that justified the version);
        tags go to both the run and the version. Returns the new version number.

        The version is also an MLflow model: an ``MLmodel`` file naming gogh's own pyfunc
        loader is added (``tracking/pyfunc_flavor.py``, no pickle), so
        ``gogh_flows.tracking.pyfunc_flavor.load_pyfunc("models:/<name>@<alias>")`` predicts (MLflow's
        loader, after the files are checked). A P2 refiner names the
        P1 it refines there: ``p1_uri`` (default ``models:/gogh-p1@champion``).
        """
        _check_name(name)
        directory = Path(directory)
        verify_weights_only(directory)
        staged = Path(tempfile.mkdtemp(prefix=f"gogh-register-{name}-"))
        try:
            return self._register(name, _with_mlmodel(directory, staged, p1_uri), alias=alias,
                                  metrics=metrics, tags=tags, description=description)
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def _register(self, name: str, directory: Path, *, alias: str | None, metrics: Mapping[str, float] | None,
                  tags: Mapping[str, str] | None, description: str | None) -> int:
        clean_metrics = _clean_metrics(metrics)
        clean_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        client = self._ready()
        experiment_id = self._experiment()
        run = client.create_run(
            experiment_id,
            run_name=f"register-{name}",
            tags={**clean_tags, "gogh.model_name": name, "gogh.source_dir": str(directory.resolve())},
        )
        run_id = run.info.run_id
        try:
            client.log_artifacts(run_id, str(directory), ARTIFACT_PATH)
            if clean_metrics:
                now = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in clean_metrics.items()])
        except BaseException:
            with contextlib.suppress(Exception):  # keep the original error, not a follow-up one
                client.set_terminated(run_id, "FAILED")
            raise
        client.set_terminated(run_id, "FINISHED")
        self._ensure_model(name)
        version = client.create_model_version(
            name,
            source=f"{run.info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}",
            run_id=run_id,
            tags={**clean_tags, "gogh.format": "safetensors+json"},
            description=description,
        )
        number = int(version.version)
        if alias:
            self.set_alias(name, alias, number)
        return number

    def set_alias(self, name: str, alias: str, version: int) -> None:
        """Point `alias` at `version` (moving it if it pointed elsewhere: that is a promotion)."""
        if not alias or not isinstance(alias, str):
            raise ValueError(f"alias must be a non-empty string, got {alias!r}")
        self._get_model(name)
        client = self._ready()
        try:
            client.get_model_version(name, str(int(version)))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise ModelNotFoundError(
                f"model {name!r} has no version {version}; versions: "
                f"{_listing([str(v) for v in self._version_numbers(name)])}"
            ) from exc
        try:
            client.set_registered_model_alias(name, alias, str(int(version)))
        except MlflowException as exc:
            if exc.error_code == "INVALID_PARAMETER_VALUE":
                raise ValueError(f"MLflow refused alias {alias!r} for model {name!r}: {exc.message}") from exc
            raise

    def set_version_tag(self, name: str, version: int, key: str, value: str) -> None:
        """Set one tag on a registered version (what happened to it since it was registered)."""
        self._ready().set_model_version_tag(name, str(int(version)), str(key), str(value))

    def version_identity(self, name: str, version: int) -> str:
        """What tells this version apart from another registry's version of the same number:
        its creation time, run and source. A registry deleted and made again (or a model
        deleted and registered anew) numbers from 1 again, so a number alone does not name a
        model's files (a review found a local cache serving the old registry's v1)."""
        mv = self._ready().get_model_version(name, str(int(version)))
        return hashlib.sha256(f"{mv.creation_timestamp}|{mv.run_id}|{mv.source}".encode()).hexdigest()[:16]

    def version_tags(self, name: str, version: int) -> dict[str, str]:
        """The tags of one registered version (those given to :meth:`register`, among others)."""
        return dict(self._ready().get_model_version(name, str(int(version))).tags or {})

    def version_for(self, name: str, alias: str) -> int | None:
        """The version `alias` points at, or None when the model or the alias does not exist."""
        _check_name(name)
        try:
            model = self._ready().get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        version = (model.aliases or {}).get(alias)
        return int(version) if version is not None else None

    def resolve(self, name_or_uri: str, *, alias: str = DEFAULT_ALIAS) -> tuple[str, int]:
        """(name, version) that a reference designates; ModelNotFoundError says what exists."""
        ref = parse_model_ref(name_or_uri, alias)
        model = self._get_model(ref.name)
        if ref.version is not None:
            versions = self._version_numbers(ref.name)
            if ref.version not in versions:
                raise ModelNotFoundError(
                    f"model {ref.name!r} has no version {ref.version}; versions: "
                    f"{_listing([str(v) for v in versions])}"
                )
            return ref.name, ref.version
        aliases = model.aliases or {}
        if ref.alias not in aliases:
            known = [f"{a} -> v{v}" for a, v in sorted(aliases.items())]
            raise ModelNotFoundError(
                f"model {ref.name!r} has no alias {ref.alias!r}; aliases: {_listing(known)}. "
                f"Set one with ModelRegistry.set_alias({ref.name!r}, {ref.alias!r}, <version>)."
            )
        return ref.name, int(aliases[ref.alias])

    def download(
        self, name_or_uri: str, *, alias: str = DEFAULT_ALIAS, dest: Path | None = None
    ) -> tuple[Path, int]:
        """Fetch a version's directory, verify it is weights-only, return (directory, version).

        The files land in a staging folder first and are only moved to `dest` once verified,
        so a refused model never appears where a loader might pick it up. `dest` must not
        exist or be empty; without it a fresh temporary directory is used.
        """
        name, version = self.resolve(name_or_uri, alias=alias)
        client = self._ready()
        mv = client.get_model_version(name, str(version))
        if dest is not None:
            dest = Path(dest)
            if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
                raise FileExistsError(
                    f"download destination {dest} already exists and is not empty; "
                    "pass a new or empty directory (or dest=None for a temporary one)"
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".gogh-{name}-v{version}-", dir=dest.parent))
        else:
            staging = Path(tempfile.mkdtemp(prefix=f"gogh-{name}-v{version}-"))
        try:
            local = Path(download_artifacts(artifact_uri=mv.source, dst_path=str(staging), tracking_uri=self.tracking_uri))
            try:
                verify_weights_only(local)
            except UnsafeArtifactError as exc:
                raise UnsafeArtifactError(
                    f"registered model {name!r} version {version} (source {mv.source}) is refused: {exc}"
                ) from None
            if dest is None:
                return local, version
            if dest.exists():
                dest.rmdir()
            os.replace(local, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return dest, version

    def versions(self, name: str) -> pl.DataFrame:
        """One row per version: version, aliases, run_id, metrics (struct), created, source, description."""
        model = self._get_model(name)
        client = self._ready()
        by_version: dict[int, list[str]] = {}
        for al, ver in (model.aliases or {}).items():
            by_version.setdefault(int(ver), []).append(al)
        rows = []
        for mv in client.search_model_versions(f"name='{name}'"):
            metrics: dict[str, float] = {}
            if mv.run_id:
                try:
                    metrics = dict(client.get_run(mv.run_id).data.metrics)
                except MlflowException as exc:  # run deleted: the version still exists
                    if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                        raise
            rows.append(
                {
                    "version": int(mv.version),
                    "aliases": sorted(by_version.get(int(mv.version), [])),
                    "run_id": mv.run_id,
                    "metrics": metrics,
                    "created": mv.creation_timestamp,
                    "source": mv.source,
                    "description": mv.description or None,
                }
            )
        schema = {
            "version": pl.Int64,
            "aliases": pl.List(pl.String),
            "run_id": pl.String,
            "created": pl.Int64,
            "source": pl.String,
            "description": pl.String,
        }
        metric_names = sorted({k for r in rows for k in r["metrics"]})
        metric_struct = pl.Struct({k: pl.Float64 for k in metric_names})
        for r in rows:
            r["metrics"] = {k: r["metrics"].get(k) for k in metric_names}
        frame = pl.DataFrame(rows, schema={**schema, "metrics": metric_struct})
        return (
            frame.with_columns(pl.from_epoch("created", time_unit="ms").dt.replace_time_zone("UTC"))
            .select("version", "aliases", "run_id", "metrics", "created", "source", "description")
            .sort("version")
        )

    def ensure_registered(self, name: str, directory: Path, *, alias: str = DEFAULT_ALIAS,
                          p1_uri: str | None = None, wait_s: float = PRIOR_WAIT_S,
                          tags: Mapping[str, str] | None = None) -> int:
        """Register the shipped prior the first time only; afterwards return the aliased version.

        Idempotent by alias, not by content: once `alias` exists we never overwrite it, so a
        champion promoted by retraining is not replaced by the prior on the next start.

        Processes on several machines may start on one empty registry at once, and a lock
        file spans one machine only: the registry decides. Whoever creates the registered model
        registers the prior into it, the model tagged :data:`PRIOR_TAG` meanwhile; the others
        wait (up to ``wait_s``) for its alias instead of registering a copy each (which left two
        versions of each model and a champion P1 from one host beside a champion P2 from
        another). A model that exists untagged without the alias (an alias deleted by hand) is
        registered into at once; one whose registering process died, after the wait. Every path
        sets the alias only where it is still unset, so a slow holder and a waiter that gave up on
        it never move each other's alias (each may leave one unaliased version). The claim is
        atomic on SQL-backed stores (SQLite, PostgreSQL, MySQL, and an ``mlflow server`` over one);
        MLflow's ``file:`` store creates a model without a transaction, and two processes can
        both believe they created it there.
        """
        existing = self.version_for(name, alias)
        if existing is not None:
            return existing
        others = [m for m in self._model_names() if m != name and _near(m, name)]
        # created here: this process registers the prior into it, tagged meanwhile (atomic where the store is)
        if not self._ensure_model(name, tags={PRIOR_TAG: f"{socket.gethostname()}:{os.getpid()}"}):
            waited = self._wait_for_alias(name, alias, wait_s)
            if waited is not None:
                return waited
        if others:  # a misspelt name starts a registry of its own, which no placement reads
            log.warning("registering the shipped prior as a new model %r in %s, which already holds %s: if %r is "
                        "a misspelling, fix the PredictorRegistry's name (its champion and retrainings live "
                        "under the name it gives)", name, self.tracking_uri, ", ".join(repr(m) for m in others), name)
        try:
            version = self.register(
                name, directory, alias=None,
                tags={"gogh.origin": "prior", "gogh.prior_dir": str(Path(directory).parent), **(tags or {})},
                description=f"prior from {Path(directory)}",
                p1_uri=p1_uri,
            )
            now = self.version_for(name, alias)
            if now is not None:  # set meanwhile (a holder slower than the wait): theirs stands
                log.warning("gogh: %r@%s was set to v%s while this process registered v%s; v%s stays unaliased",
                            name, alias, now, version, version)
                return now
            self.set_alias(name, alias, version)
            return version
        finally:
            with contextlib.suppress(MlflowException):  # a tag left behind only makes a first start wait
                self._ready().delete_registered_model_tag(name, PRIOR_TAG)

    def _wait_for_alias(self, name: str, alias: str, wait_s: float) -> int | None:
        """The version another process's registration of the prior points ``alias`` at, once it
        does; None if nobody is registering it (no tag) or the wait ran out."""
        client = self._ready()
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                model = client.get_registered_model(name)
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # deleted meanwhile: nobody is registering it
                    return None
                raise
            version = (model.aliases or {}).get(alias)
            if version is not None:
                return int(version)
            holder = (model.tags or {}).get(PRIOR_TAG)
            if holder is None:
                return None
            if time.monotonic() >= deadline:
                log.warning("gogh: %s (%s) began registering the shipped prior as %r in %s and has not set its alias "
                            "%r within %g s; registering it here", holder, PRIOR_TAG, name, self.tracking_uri, alias,
                            wait_s)
                return None
            if not said:
                log.info("gogh: waiting for %s, which is registering the shipped prior as %r", holder, name)
                said = True
            time.sleep(0.5)


def _near(a: str, b: str) -> bool:
    """Two model names one or two keystrokes apart (``gogh-p2`` and ``gogh-p2x``, ``gogh_p2``)."""
    import difflib

    if a[:-1] == b[:-1] and {a[-1:], b[-1:]} == {"1", "2"}:  # a P1 and its P2 (gogh-p1, gogh-p2)
        return False
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio() >= 0.8


def _with_mlmodel(directory: Path, staged: Path, p1_uri: str | None) -> Path:
    """A copy of the model directory with its pyfunc ``MLmodel`` (never changes the original)."""
    from gogh_flows.tracking.pyfunc_flavor import write_mlmodel

    out = staged / "model"
    out.mkdir(parents=True)
    for f in directory.iterdir():
        if f.is_file() and f.name not in ("MLmodel", "gogh_pyfunc.json"):
            shutil.copy2(f, out / f.name)
    kind = json.loads((directory / "config.json").read_text()).get("kind")
    write_mlmodel(out, p1_uri=(p1_uri or f"models:/gogh-p1@{DEFAULT_ALIAS}") if kind == "p2" else None)
    verify_weights_only(out)
    return out
