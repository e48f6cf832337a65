"""Prefect Blocks: where a team declares its fleet, its model registry and its placement rules.

Blocks live on the Prefect server next to the flows that use them, so a fleet is declared
once (in the UI, with ``gogh blocks apply blocks/``, or in code) and every decorated flow
refers to it by name. Each block validates its fields when it is built, so a typo in a
fleet (an unknown GPU type, a capacity of 3) fails where it is written, not at run time.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from prefect.blocks.core import Block
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from gogh_flows.catalog import get_gpu_type
from gogh_flows.datapaths import shipped
from gogh_flows.placement import POLICIES
from gogh_flows.runtime.power_cap import check_cap_request

#: The example block documents shipped with the repository (and installed with the package).
REPO_BLOCKS = shipped("blocks")

#: URI schemes MLflow can track to (its SQLAlchemy stores, a server, a file store, Databricks)
TRACKING_SCHEMES = frozenset({"sqlite", "http", "https", "file", "postgresql", "mysql", "mssql", "databricks",
                              "databricks-uc"})

#: The embedded default fleet: four generations of the synthetic fleet, two of each.
DEFAULT_FLEET: dict[str, int] = {"k80": 2, "v100": 2, "t4": 2, "a100": 2}


def state_dir() -> Path:
    """Where local state lives (MLflow SQLite, the ledger, measurements): ``$GOGH_HOME`` or ./.gogh.

    Made here if missing, so that a path that cannot be a folder is said as ``GOGH_HOME``'s fault
    (it surfaced as a bare FileExistsError or "No such file or directory" from deep inside).
    """
    given = os.environ.get("GOGH_HOME")
    root = Path(given or ".gogh").resolve()
    what = f"GOGH_HOME={given!r}" if given else f"the default state folder {str(root)!r} (GOGH_HOME unset)"
    if root.exists() and not root.is_dir():
        raise ValueError(f"{what} is a file, not a folder: point GOGH_HOME at a folder for gogh's local state "
                         "(MLflow's SQLite store, measurements, caches)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what} cannot be made ({exc.strerror or exc}): point GOGH_HOME at a writable "
                         "folder") from None
    return root


def _refuse_unknown_fields(cls: type[Block], data: Any) -> Any:
    """A misspelt field (``"flet"``) must not be saved silently with the default in its place."""
    if isinstance(data, dict):
        unknown = sorted(k for k in data if k not in cls.model_fields and not str(k).startswith("_")
                         and k != "block_type_slug")
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {', '.join(map(repr, unknown))}; its fields are "
                             f"{', '.join(sorted(cls.model_fields))}")
    return data


class GpuCluster(Block):
    """A GPU fleet as a Dask pool: emulated (a laptop or CI), local CUDA GPUs, or a remote scheduler."""

    _block_type_name: ClassVar[str] = "GOGH GPU Cluster"
    _block_type_slug: ClassVar[str] = "gogh-gpu-cluster"
    _description: ClassVar[str] = "A mixed GPU fleet that @gogh_placed flow runs are placed on."

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data)

    mode: Literal["emulated", "local-cuda", "remote"] = Field(
        default="emulated", description="emulated: one Dask worker per declared GPU on this machine; "
        "local-cuda: one worker per local NVIDIA GPU (dask-cuda); remote: an existing Dask scheduler")
    fleet: dict[str, int] = Field(
        default_factory=lambda: dict(DEFAULT_FLEET),
        description="emulated mode: GPU type -> count, e.g. {'v100': 2, 't4': 4}")
    address: str | None = Field(default=None, description="remote mode: scheduler address, tcp://host:8786")
    capacity: int = Field(default=2, ge=1, le=2, description="jobs per GPU: 1 exclusive, 2 may share")
    truth: str = Field(default="synthetic", description="emulated mode: 'synthetic', 'gavel' or a Gavel "
                       "throughput JSON the emulated GPUs run at")
    boards: dict[str, str] = Field(
        default_factory=dict, description="emulated mode, synthetic truth: GPU type -> the board variant its "
        "GPUs run as, e.g. {'a100': 'a100-pcie-40gb'} (gogh_flows.truth.synthetic.BOARD_VARIANTS); placement "
        "and the predictors still see the catalog type, as they would at a site with those boards")
    time_scale: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="emulated mode: wall seconds per "
                              "emulated second (0 = do not sleep)")
    seed: int = Field(default=0, description="emulated mode: seeds the synthetic truth and the emulated "
                      "runs")
    lease_timeout_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False, description="a GPU slot whose holder stops "
                                   "refreshing it (placing process or worker died) is freed after this "
                                   "many seconds; a shared scheduler keeps the value it was started with")
    power_cap_w: float | None = Field(default=None, gt=0.0, description="local-cuda mode, off by default: "
                                      "cap every board's power limit at this many watts while the pool's "
                                      "workers live (restored when they stop). It changes the board for every "
                                      "user of the machine and needs root; never on a shared machine")
    power_cap_fraction: float | None = Field(default=None, gt=0.0, le=1.0, description="local-cuda mode, "
                                             "off by default: cap every board at this fraction of its default "
                                             "power limit (0 < f <= 1) instead of power_cap_w")
    run_power_limits: bool = Field(default=False, description="local-cuda mode, off by default: set each "
                                   "board to the power limit its runs' placements chose (PlacementPolicy."
                                   "power_limit_levels), put back when the board empties and when the pool stops. "
                                   "Needs root, as `nvidia-smi -pl` does (checked when the pool starts); without it "
                                   "chosen limits are logged and not applied")

    @field_validator("fleet", mode="before")
    @classmethod
    def _fleet_text(cls, fleet: Any) -> Any:
        """``"v100=2,t4=1"``, as ``emulated_pool`` and ``gogh simulate --cluster`` take it."""
        if isinstance(fleet, str):
            from gogh_flows.runtime.devices import parse_fleet

            return parse_fleet(fleet)
        return fleet

    @field_validator("fleet")
    @classmethod
    def _known_types(cls, fleet: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, count in fleet.items():
            gpu = get_gpu_type(name)  # unknown type -> error listing the catalog
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"fleet count for {name!r} must be an integer >= 1, got {count!r}")
            if gpu.name in out:  # {"T4": 1, "t4": 1}: refused, as the string form is (parse_fleet)
                raise ValueError(f"GPU type {gpu.name!r} appears twice in the fleet; name each type once, with "
                                 f"its total count (e.g. '{gpu.name}': {out[gpu.name] + count})")
            out[gpu.name] = count
        return out

    @field_validator("truth")
    @classmethod
    def _truth_spec(cls, truth: str) -> str:
        """A misspelt name is refused here; a path is only read where the pool starts (its machine)."""
        spec = truth.strip()
        if spec in ("synthetic", "gavel") or spec.endswith(".json") or "/" in spec or "\\" in spec:
            return spec
        raise ValueError(f"truth {truth!r} is neither 'synthetic', 'gavel' nor the path of a Gavel throughput "
                         "JSON (a '.json' file, or a folder holding simulation_throughputs.json)")

    @field_validator("boards")
    @classmethod
    def _board_type_names(cls, boards: dict[str, str]) -> dict[str, str]:
        """Type names as the fleet's are: {"V100": ...} is the v100 (unknown names: said below)."""
        from gogh_flows.catalog import UnknownGpuTypeError

        out: dict[str, str] = {}
        for name, variant in boards.items():
            try:
                key = get_gpu_type(name).name
            except UnknownGpuTypeError:
                key = name
            if key in out:  # {"V100": ..., "v100": ...}: refused, as the fleet's are
                raise ValueError(f"GPU type {key!r} appears twice in boards; name each type once")
            out[key] = variant.strip().lower() if isinstance(variant, str) else variant
        return out

    @model_validator(mode="after")
    def _mode_needs(self) -> GpuCluster:
        if self.mode == "remote" and not self.address:
            raise ValueError("a remote GpuCluster needs address='tcp://HOST:PORT' of a Dask scheduler "
                             "whose workers advertise their GPU (docs/runtime.md)")
        if self.mode == "emulated" and not self.fleet:
            raise ValueError("an emulated GpuCluster needs a fleet, e.g. fleet={'v100': 2, 't4': 2}")
        check_cap_request(self.power_cap_w, self.power_cap_fraction, run_power_limits=self.run_power_limits)
        if self.boards:
            if self.mode != "emulated" or self.truth != "synthetic":
                raise ValueError(f"boards applies to mode='emulated' with truth='synthetic' (this cluster is "
                                 f"{self.mode!r} with truth {self.truth!r}): a real or measured fleet's boards are "
                                 "what they are")
            from gogh_flows.truth.synthetic import check_boards

            check_boards(self.fleet, self.boards)
        if self.run_power_limits and self.mode != "local-cuda":
            raise ValueError(f"run_power_limits applies to mode='local-cuda' only (this cluster is {self.mode!r}): "
                             "an emulated GPU enacts chosen limits anyway, and a remote pool's boards belong to "
                             "their hosts")
        if (self.power_cap_w is not None or self.power_cap_fraction is not None) and self.mode != "local-cuda":
            raise ValueError(f"power caps apply to mode='local-cuda' only (this cluster is {self.mode!r}): a "
                             "remote pool's boards belong to their hosts (cap them there with `nvidia-smi -pl`), "
                             "and the emulated fleet enacts the limits placements choose, not a fixed cap: to run "
                             "it below full power, set PlacementPolicy(power_limit_levels=...)")
        return self

    def key(self) -> str:
        """Identity of the fleet this block describes (two equal blocks share one pool)."""
        return json.dumps(self.model_dump(mode="json", exclude={"block_type_slug"}), sort_keys=True)


def _absolute_sqlite(uri: str) -> str:
    """``sqlite:///mlflow.db`` made absolute (``sqlite:////<cwd>/mlflow.db``).

    A relative SQLite path is relative to each process's working folder: a block saved with one
    gave the placements run from one folder and the retraining run from another two registries,
    and the champion promoted in one was never seen by the other (a new-user review). Stored
    absolute, like ``prior``: a block is loaded by processes started elsewhere."""
    head, sep, rest = uri.partition(":///")
    if not sep or head.split("+", 1)[0].lower() != "sqlite":
        return uri
    path, q, query = rest.partition("?")
    if not path or path.startswith("/") or path == ":memory:":
        return uri
    return f"{head}:///{Path(path).expanduser().resolve()}{q}{query}"


class PredictorRegistry(Block):
    """Where P1/P2 live: an MLflow tracking/registry URI, the model names and the alias to load."""

    _block_type_name: ClassVar[str] = "GOGH Predictor Registry"
    _block_type_slug: ClassVar[str] = "gogh-predictor-registry"
    _description: ClassVar[str] = "MLflow model registry holding the GOGH throughput predictors."

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data)

    tracking_uri: str | None = Field(default=None, description="MLflow tracking URI; None = "
                                     "$MLFLOW_TRACKING_URI when set, else sqlite under $GOGH_HOME (./.gogh)")
    p1_name: str = "gogh-p1"
    p2_name: str = "gogh-p2"
    alias: str = "champion"
    prior: str | None = Field(default="synthetic", description="predictors to register on first use "
                              "when the registry is empty: a shipped prior under models/ ('synthetic' or "
                              "'gavel') or the folder `gogh predictors train --out DIR` wrote; None = the "
                              "models must already be registered")
    refresh_s: float = Field(default=30.0, ge=0.0, description="how long a loaded alias is trusted "
                             "before the registry is asked again")
    timeout_s: float = Field(default=10.0, gt=0.0, description="how long a placement waits for the "
                             "registry (alias lookup and download) before it places with the last good "
                             "predictors; a late answer is still taken for the next placement")

    registry_uri: str | None = Field(default=None, description="MLflow model registry URI, where it is not "
                                     "the tracking store; None = $MLFLOW_REGISTRY_URI when set, else the "
                                     "tracking URI")

    @field_validator("tracking_uri", "registry_uri")
    @classmethod
    def _known_scheme(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _mlflow_uri(info.field_name or "tracking_uri", value)

    @field_validator("prior")
    @classmethod
    def _shipped_prior(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from gogh_flows.flows.predictors import models_dir

        shipped = sorted(p.name for p in models_dir().glob("*") if (p / "p1").is_dir())
        if value in shipped:  # a shipped name wins over a folder of that name here (give ./NAME for that)
            return value
        folder = Path(value).expanduser()
        if (folder / "p1").is_dir() and (folder / "p2").is_dir():
            # stored absolute: a block is loaded by processes started elsewhere (a Prefect worker)
            return str(folder.resolve())
        if shipped:  # no models folder here: said when a run needs it
            raise ValueError(f"prior {value!r} is neither a shipped prior ({', '.join(shipped)}: folders of "
                             f"{models_dir()}) nor a folder holding p1/ and p2/ as `gogh predictors train "
                             "--out DIR` writes them; or None when the models are already registered")
        return value

    def resolved_tracking_uri(self) -> str:
        """The block's URI, else ``MLFLOW_TRACKING_URI`` (what an MLflow user already set), else
        SQLite under ``$GOGH_HOME``; an environment URI is checked like the block's."""
        return _usable(self.tracking_uri or self._from_env("MLFLOW_TRACKING_URI", "tracking_uri")
                       or f"sqlite:///{state_dir() / 'mlflow.db'}")

    def resolved_registry_uri(self) -> str:
        """Where the models are registered: the block's ``registry_uri``, else
        ``MLFLOW_REGISTRY_URI`` (MLflow's own setting for a registry apart from the tracking
        store; a review found it ignored), else the tracking URI."""
        return _usable(self.registry_uri or self._from_env("MLFLOW_REGISTRY_URI", "registry_uri")
                       or self.resolved_tracking_uri())

    def _from_env(self, variable: str, field_name: str) -> str | None:
        """An MLflow URI from the environment, checked like the block's own."""
        env = os.environ.get(variable, "").strip()
        if not env:
            return None
        try:
            return _mlflow_uri(field_name, env)
        except ValueError as exc:
            raise ValueError(f"{variable}: {exc}; fix or unset it, or set "
                             f"PredictorRegistry({field_name}=...)") from None


def _mlflow_uri(what: str, value: str) -> str:
    """``value`` checked to be an MLflow tracking or registry URI (a SQLite path made absolute)."""
    scheme = value.split(":", 1)[0].split("+", 1)[0].lower() if ":" in value else ""
    if scheme not in TRACKING_SCHEMES:
        databases = ", ".join(sorted(s for s in TRACKING_SCHEMES if s not in ("http", "https", "file")))
        raise ValueError(f"{what} {value!r} is not an MLflow tracking or registry URI; use one of "
                         f"sqlite:///path/mlflow.db, http(s)://host:port, or a database URI ({databases})")
    return _absolute_sqlite(value)


def _usable(uri: str) -> str:
    """``uri``, unless it is one MLflow will refuse here: said before anything runs on it."""
    if uri.lower().startswith("file:") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in (
            "true", "1"):  # what MLflow reads as true
        raise ValueError(f"{uri} is an MLflow file store, which MLflow 3 keeps in maintenance mode and refuses "
                         "unless MLFLOW_ALLOW_FILE_STORE=true is set in every process that uses it; use "
                         "sqlite:///path/mlflow.db instead (or set that variable)")
    return uri


class PlacementPolicy(Block):
    """How runs are placed: the policy, the solver budget and how long a run may wait for a GPU."""

    _block_type_name: ClassVar[str] = "GOGH Placement Policy"
    _block_type_slug: ClassVar[str] = "gogh-placement-policy"
    _description: ClassVar[str] = "Rules for placing @gogh_placed flow runs."

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _refuse_unknown_fields(cls, data)

    policy: str = Field(default="optimizer", description="'optimizer' (GOGH) or a baseline: "
                        + ", ".join(sorted(p for p in POLICIES if p != "optimizer")))
    solver_time_limit_s: float = Field(default=2.0, gt=0.0)
    wait_timeout_s: float = Field(default=600.0, ge=0.0, description="how long a run waits for a "
                                  "GPU that meets its requirement before it fails")
    poll_s: float = Field(default=1.0, gt=0.0, description="how often a waiting run retries")
    placement_timeout_s: float = Field(default=60.0, gt=0.0, description="the longest a run may spend "
                                       "deciding where to go (reading the pool's ledger, predicting, "
                                       "solving, claiming), apart from waiting for a busy fleet; also "
                                       "bounds each call to the pool's scheduler")
    allow_migration: bool = Field(default=False, description="reserved: running flow runs are "
                                  "never moved today (a Python process cannot be migrated)")
    refine: bool = Field(default=True, description="correct predictions with P2 from the "
                         "measurements logged so far")
    power_limit_levels: list[float] = Field(default_factory=list, description="power limits the "
                                            "optimiser (policy='optimizer' only) may set on a GPU with a run, as fractions of its type's "
                                            "range (0 = lowest, 1 = maximum; e.g. [0, 0.25, 0.5, 0.75]); empty: "
                                            "every GPU stays at its maximum. The emulated fleet enacts them; real "
                                            "GPUs with GpuCluster(mode='local-cuda', run_power_limits=True), else a "
                                            "chosen limit is logged and not applied")
    limit_trials: bool = Field(default=True, description="with power_limit_levels and refine: a run of a job "
                               "type whose runs met their requirement at a lowered limit may be placed one level "
                               "below the best they measured, to find the limit that suits it; if it falls "
                               "short the worker lifts its limit (on a real GPU only for a flow body that "
                               "reports its steps) and the level is not offered again. False: only the model's "
                               "choice and levels already measured")
    risk_level: float | None = Field(default=None, ge=0.5, le=0.95, description="plan with the lower end "
                                     "of the refiner's calibrated interval at this level instead of the point "
                                     "prediction (0.9: on model families the predictors never saw, 90% of "
                                     "measured throughputs were above it): a wide margin for a job with nothing "
                                     "measured, a narrower one once it has run, none for an entry measured "
                                     "itself; None: point predictions (with headroom)")
    headroom: float = Field(default=0.1, ge=0.0, le=1.0, description="plan as if every requirement "
                            "were this fraction higher: predictions of unmeasured placements err, and "
                            "the cheapest slot that barely meets a requirement on paper misses it "
                            "whenever the prediction was optimistic")
    headroom_wait_s: float = Field(default=30.0, ge=0.0, description="how long a run may wait for a GPU "
                                   "that clears its requirement with the headroom while one that meets the "
                                   "requirement itself is free (0: never; it takes that one at once; at most half of wait_timeout_s). After "
                                   "it, and at once when no GPU type of the fleet could clear it, the run is "
                                   "planned against its requirement itself")
    wait_for_efficiency_s: float = Field(default=0.0, ge=0.0, description="how long a new run may wait for "
                                         "a GPU type that would run it for at least efficiency_min_saving less "
                                         "energy than the GPU free now (0: never; it then takes the best GPU "
                                         "free). Its requirement is a rate while it runs, so waiting costs only "
                                         "completion time. Must be below wait_timeout_s")
    efficiency_min_saving: float = Field(default=0.1, gt=0.0, lt=1.0, description="the share of energy a "
                                         "busy GPU type must save, by the predictions, for a run to wait for it")
    wait_within_reach: bool = Field(default=False, description="wait for an efficient GPU type only when "
                                    "a run on it is predicted to end before wait_for_efficiency_s runs out "
                                    "(its steps left estimated from its declared work_steps, its requirement "
                                    "and its elapsed time); each run decides alone, not seeing other runs "
                                    "waiting for the same type. Else a run waits whenever the type is busy")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown placement policy {value!r}; choose one of {sorted(POLICIES)}")
        return value

    @field_validator("power_limit_levels")
    @classmethod
    def _levels_in_range(cls, value: list[float]) -> list[float]:
        bad = [v for v in value if not 0.0 <= v <= 1.0]
        if bad:
            raise ValueError(f"power_limit_levels are fractions of each GPU type's limit range in [0, 1] "
                             f"(0 = its lowest limit, 1 = its maximum), got {bad}")
        return value

    @model_validator(mode="after")
    def _wait_within_timeout(self) -> PlacementPolicy:
        if self.power_limit_levels and self.policy != "optimizer":
            raise ValueError(
                f"power_limit_levels are chosen by the optimiser; policy={self.policy!r} is a baseline that "
                "places at each GPU's current limit (it stands for a scheduler that does not choose limits). "
                "Use policy='optimizer' with power_limit_levels, or leave power_limit_levels empty")
        if self.wait_for_efficiency_s > 0 and self.wait_for_efficiency_s >= self.wait_timeout_s:
            raise ValueError(
                f"wait_for_efficiency_s={self.wait_for_efficiency_s:g} s must be below wait_timeout_s="
                f"{self.wait_timeout_s:g} s: no run waits longer than wait_timeout_s, so the rest of that wait "
                "would never happen. Raise wait_timeout_s, or lower wait_for_efficiency_s")
        if self.wait_within_reach and self.wait_for_efficiency_s <= 0:
            raise ValueError(
                "wait_within_reach=True says when a run waits for an efficient GPU, and "
                "wait_for_efficiency_s=0 lets no run wait: set wait_for_efficiency_s (seconds), or leave "
                "wait_within_reach out")
        # a headroom wait given outright is checked; the default's is cut to fit a short wait_timeout_s.
        # "Given" is a value other than the default: a saved block loads with every field set, and
        # the default it was saved with must load as it was saved
        default_headroom = type(self).model_fields["headroom_wait_s"].default
        if self.headroom_wait_s != default_headroom and self.headroom_wait_s > self.wait_timeout_s / 2:
            raise ValueError(
                f"headroom_wait_s={self.headroom_wait_s:g} s is at most half of wait_timeout_s={self.wait_timeout_s:g} s "
                "(the rest is left to wait for any GPU that meets the requirement itself); it would be cut to "
                f"{self.wait_timeout_s / 2:g} s. Lower headroom_wait_s, or raise wait_timeout_s")
        return self

    @field_validator("allow_migration")
    @classmethod
    def _no_migration(cls, value: bool) -> bool:
        if value:
            raise ValueError("allow_migration=True is not supported for flow runs: a running Python "
                             "process cannot be moved to another GPU (the simulator models migration)")
        return value


BLOCK_TYPES: dict[str, type[Block]] = {
    "gpu-cluster": GpuCluster,
    "predictor-registry": PredictorRegistry,
    "placement-policy": PlacementPolicy,
}


def read_block_document(path: Path) -> tuple[str, Block]:
    """A JSON document ``{"type": ..., "name": ..., "data": {...}}`` -> (name, validated block)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8-sig"))  # a BOM an editor added is fine
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8 JSON") from exc
    if not isinstance(doc, dict) or not {"type", "name", "data"} <= set(doc) or not isinstance(doc["data"], dict):
        raise ValueError(f"{path}: a block document is an object with keys 'type', 'name' and 'data' (an object "
                         "of the block's fields)")
    kind = doc["type"]
    if kind not in BLOCK_TYPES:
        raise ValueError(f"{path}: unknown block type {kind!r}; known types: {sorted(BLOCK_TYPES)}")
    try:
        block = BLOCK_TYPES[kind](**doc["data"])
    except ValueError as exc:
        raise ValueError(f"{path}: invalid {kind} block {doc['name']!r}: {exc}") from exc
    return str(doc["name"]), block


class PrefectServerUnreachable(ValueError):
    """``PREFECT_API_URL`` names a server that does not answer."""


def server_unreachable(exc: BaseException) -> PrefectServerUnreachable:
    """The error a user sees instead of httpx's traceback when the configured server is down."""
    from prefect.settings import PREFECT_API_URL

    return PrefectServerUnreachable(
        f"no Prefect server answers at PREFECT_API_URL={PREFECT_API_URL.value()} ({type(exc).__name__}: {exc}); "
        "start it (`prefect server start`) or point PREFECT_API_URL at one that runs")


def require_prefect_server() -> None:
    """Refuse at once when ``PREFECT_API_URL`` is set and nothing answers there."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return
    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        raise server_unreachable(failure)


def apply_block_documents(folder: Path, *, overwrite: bool = True) -> list[tuple[str, str]]:
    """Validate every ``*.json`` in ``folder`` (or the one document ``folder`` names) first, then
    save them all: (type, name) per block."""
    if Path(folder).is_file():
        if Path(folder).suffix.lower() != ".json":
            raise ValueError(f"{folder} is not a block document (*.json); give one, or the folder that holds "
                             "them, e.g. blocks/")
        paths = [Path(folder)]
    elif not Path(folder).is_dir():
        raise FileNotFoundError(f"{folder} does not exist; give the folder that holds your *.json block "
                                "documents or one of them, or run `gogh blocks apply` with no folder (./blocks if "
                                f"there is one, else the documents gogh-flows ships: {REPO_BLOCKS})")
    else:
        paths = sorted(Path(folder).glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no block documents (*.json) in {folder}")
    docs = [read_block_document(p) for p in paths]  # all-or-nothing: validate before saving
    saved = []
    for name, block in docs:
        try:
            block.save(name, overwrite=overwrite)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise server_unreachable(exc) from None
        saved.append((block.get_block_type_slug(), name))
    return saved


#: what Prefect accepts as a block document's name (``prefect.types.names``)
_BLOCK_NAME = re.compile(r"^[a-z0-9-]+$")


def check_block_name(kind: type[Block], value: str, where: str) -> None:
    """Refuse a name no block can be saved under, before anything runs, and say what was meant.

    Without this, ``cluster="v100=1,t4=1"`` (the text form of a fleet, which the fleet field
    takes) passed the decorator and failed at run time with "save one under that name", a
    name Prefect refuses.
    """
    if _BLOCK_NAME.match(value):
        return
    hint = ""
    if kind.__name__ == "GpuCluster" and "=" in value:
        hint = (f" That looks like a fleet: pass GpuCluster(fleet={value!r}), or save that block under a "
                "name and give the name.")
    raise ValueError(f"{where}: {value!r} is not the name of a saved {kind.__name__} block; block names hold only "
                     f"lowercase letters, numbers and dashes (e.g. 'lab-fleet').{hint}")


def load_block(kind: type[Block], value: Any, default: Block) -> Block:
    """A block given by instance, by saved name, or the embedded default (``None``)."""
    if value is None:
        return default
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        check_block_name(kind, value, f"a {kind.__name__} by name")
        try:
            # _sync: an async flow's body runs in a worker thread that Prefect may still take for
            # an async context, and would hand back a coroutine instead of the block
            return kind.load(value, _sync=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # a busy server's ReadTimeout is not this
            raise server_unreachable(exc) from None
        except ValueError as exc:
            other = _saved_as_other_kind(kind, value)
            if other is not None:  # e.g. cluster="energy-first", the name of a saved PlacementPolicy
                raise ValueError(
                    f"{value!r} is the name of a saved {other} block, and a {kind.__name__} is wanted here: "
                    f"pass it where a {other} goes, or give a {kind.__name__}'s name") from exc
            raise ValueError(
                f"no {kind.__name__} block named {value!r} on the Prefect server ({exc}). Save one "
                f"with `gogh blocks apply blocks/` or {kind.__name__}(...).save({value!r})"
                + _policy_name_hint(kind, value) + _no_server_hint()
            ) from exc
        except RuntimeError as exc:  # Prefect's "failed validation": the saved values no longer pass
            cause = exc.__cause__
            if not isinstance(cause, ValidationError):
                raise
            # what is wrong, not the saved values (a tracking URI may hold credentials)
            why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the block'}: {e['msg']}" for e in cause.errors())
            raise ValueError(
                f"the saved {kind.__name__} block {value!r} does not validate: {why}. Save it again with "
                f"valid values: `gogh blocks apply blocks/` (from its document) or {kind.__name__}(...)"
                f".save({value!r}, overwrite=True)"
            ) from exc
    raise TypeError(f"expected a {kind.__name__}, the name of a saved one, or None; got {value!r}")


def _policy_name_hint(kind: type[Block], value: str) -> str:
    """``policy="greedy-fastest"``: the name of a placement policy given where a block's goes."""
    from gogh_flows.placement import POLICIES

    if kind.__name__ != "PlacementPolicy" or value not in POLICIES:
        return ""
    return f"; {value!r} is the name of a placement policy: to place with it, pass PlacementPolicy(policy={value!r})"


def _no_server_hint() -> str:
    """Why a block saved on the team's server is missing here, when that is the likely reason."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return ""
    return ("; or, if it was saved on your team's Prefect server, set PREFECT_API_URL to that server: this "
            "process has none set and looked on a temporary server of its own")


def _saved_as_other_kind(kind: type[Block], name: str) -> str | None:
    """The other gogh block type saved under ``name``, if any (only to word an error)."""
    for other in BLOCK_TYPES.values():
        if other is kind:
            continue
        try:
            other.load(name, _sync=True)
        except Exception:  # noqa: BLE001 - not saved as that type (or unreadable): keep looking
            continue
        return other.__name__
    return None


__all__ = [
    "BLOCK_TYPES", "DEFAULT_FLEET", "REPO_BLOCKS", "GpuCluster", "PlacementPolicy", "PredictorRegistry",
    "apply_block_documents", "load_block", "read_block_document", "state_dir",
]
