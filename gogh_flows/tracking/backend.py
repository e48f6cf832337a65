"""Talking to an MLflow backend: reachability, experiments, artifact locations.

MLflow's HTTP client retries a dead server with exponential back-off for minutes before it
gives up, and a SQLite URI in a missing folder fails with an opaque SQLAlchemy message. Both
are bad at the moment a flow run finishes, so we probe first (one short HTTP request, or a
look at the file system) and fail fast with a message that says what to do.
"""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from filelock import FileLock
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from gogh_flows.tracking.errors import TrackingUnavailableError

START_HINT = (
    "start one with `mlflow server --host 127.0.0.1 --port 5000 "
    "--backend-store-uri sqlite:///mlflow.db --artifacts-destination ./mlartifacts` "
    "and point gogh at http://127.0.0.1:5000, or use a local store such as sqlite:///path/to/mlflow.db"
)


def _start_hint(uri: str) -> str:
    """How to start a server where ``uri`` points (its own host and port, not a stock one)."""
    at = urlparse(uri)
    if at.hostname not in ("127.0.0.1", "localhost", "::1") or at.port is None:
        return f"start it, or check the tracking URI (the PredictorRegistry block's tracking_uri); {START_HINT}"
    return (f"if a server should be running there, start it again with its own --backend-store-uri (a new store "
            f"would have none of its runs or models); for a new one, `mlflow server --host {at.hostname} --port "
            f"{at.port} --backend-store-uri sqlite:///mlflow.db --artifacts-destination ./mlartifacts`; or check the "
            "tracking URI (the PredictorRegistry block's tracking_uri), or use a local store such as "
            "sqlite:///path/to/mlflow.db")


def is_http(uri: str) -> bool:
    return urlparse(uri).scheme in {"http", "https"}


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI (None for other schemes or in-memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):]
    if not path or path == ":memory:":
        return None
    # sqlite:////abs/path keeps its leading slash after the prefix; sqlite:///rel/path is relative.
    return Path(path)


def check_reachable(uri: str, *, timeout: float = 3.0) -> None:
    """Raise TrackingUnavailableError unless the backend behind `uri` can be used now.

    For HTTP(S) servers this is one GET of /health; for SQLite it makes sure the folder of
    the database exists (creating it, as MLflow would create the file itself).
    """
    if is_http(uri):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http(s) only)
                if resp.status != 200:
                    raise TrackingUnavailableError(
                        f"MLflow tracking server at {uri} answered /health with HTTP {resp.status}; {START_HINT}"
                    )
        except TrackingUnavailableError:
            raise
        except urllib.error.HTTPError as exc:  # something answered: not an outage, a wrong address
            raise TrackingUnavailableError(
                f"the server at {uri} answered MLflow's /health with HTTP {exc.code} ({exc.reason}): it is not an "
                "MLflow tracking server (another service's address or port?). Check the tracking URI: the "
                "PredictorRegistry block's tracking_uri, or MLFLOW_TRACKING_URI"
            ) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingUnavailableError(
                f"MLflow tracking server at {uri} is unreachable ({reason}); {_start_hint(uri)}"
            ) from exc
        return
    db = sqlite_path(uri)
    if db is not None:
        _make_folder(uri, db)
        initialise_sqlite(uri, db)


def _make_folder(uri: str, db: Path) -> None:
    """The SQLite database's folder, made as MLflow would; a path that cannot be is the user's to change
    (the hint used to be "start a server", which a path problem is not)."""
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingUnavailableError(
            f"cannot create the folder {db.parent} for the MLflow database of {uri} ({exc.strerror or exc}): give a "
            "path where this user can write, in MLFLOW_TRACKING_URI or the PredictorRegistry block's tracking_uri "
            "(e.g. sqlite:///$HOME/gogh/mlflow.db), or a tracking server's http:// address"
        ) from None


def mlflow_client(tracking_uri: str, registry_uri: str | None = None) -> MlflowClient:
    """An MlflowClient, after a SQLite store's schema was created safely (MLflow creates it in
    the client's constructor, unlocked); other stores are not contacted here."""
    for uri in {tracking_uri, registry_uri or tracking_uri}:
        db = sqlite_path(uri)
        if db is not None:
            _make_folder(uri, db)
            initialise_sqlite(uri, db)
        else:
            _check_driver(uri)
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)


#: MLflow's database stores (its SQLAlchemy ones): their driver is imported on first use
_DATABASES = ("postgresql", "mysql", "mssql")


def _check_driver(uri: str) -> None:
    """A database store's driver, imported now: SQLAlchemy imports it on the store's first use, a
    bare ModuleNotFoundError from deep inside MLflow (a review), the registry's at its first call."""
    if urlparse(uri).scheme.split("+")[0] not in _DATABASES:
        return
    from sqlalchemy.engine.url import make_url

    try:
        make_url(uri).get_dialect().import_dbapi()
    except ModuleNotFoundError as exc:
        raise TrackingUnavailableError(
            f"the MLflow store {masked_uri(uri)} needs the Python package {exc.name!r}, which is not installed here: "
            "install its driver in this environment (for postgresql://, pip install psycopg2-binary; for mysql://, "
            "pip install pymysql with a mysql+pymysql:// address), or use an MLflow server's http:// address"
        ) from None
    except Exception:  # noqa: BLE001 - a malformed address: MLflow's own error says what is wrong with it
        return


def masked_uri(uri: str) -> str:
    """A store's address fit for a message: a password in it is masked."""
    return re.sub(r"//([^/@:]*):[^/@]*@", r"//\1:***@", uri)


_INITIALISED: set[str] = set()
_INIT_LOCK = threading.Lock()


def initialise_sqlite(uri: str, db: Path) -> None:
    """Create (or migrate) MLflow's schema in a SQLite store, one process at a time.

    MLflow creates its tables on first use without a lock: processes starting together on
    a fresh store race each other, and the losers fail ("table ... already exists"). A file
    lock next to the database makes the first use of each process wait its turn; later uses
    in the process skip it.
    """
    if uri in _INITIALISED:
        return
    # on a thread of its own, waited for: an exception raised into the caller's thread (Prefect's
    # timeout_seconds on a sync flow does that) stopped MLflow half-way through its migrations and
    # left a store that every later run failed on ("duplicate column name"); here the migration
    # finishes whatever happens to the caller, who gets the exception, and the next caller the store
    failure: list[BaseException] = []

    def work() -> None:
        try:
            _initialise(uri, db)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failure.append(exc)

    migrating = threading.Thread(target=work, name="gogh-mlflow-schema")
    migrating.start()
    migrating.join()
    if failure:
        raise failure[0]


def _initialise(uri: str, db: Path) -> None:
    with _INIT_LOCK:
        if uri in _INITIALISED:
            return
        with FileLock(str(db) + ".init.lock", timeout=300):
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)
        _INITIALISED.add(uri)


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts when the caller does not say.

    For a SQLite store we keep artifacts next to the database (`<db folder>/mlartifacts/`),
    because MLflow's own default is `./mlruns` relative to whatever the current directory
    happens to be. For a server we return None: the server decides (and may proxy them).
    """
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    return (db.parent.resolve() / "mlartifacts" / experiment).as_uri()


#: MLflow 3's UI opens an experiment by its kind; without it a run log opens on the GenAI
#: traces overview, and the runs table (what people look at here) is a click away
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """Experiment id of `name`, creating it once (safe when several processes race)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise MlflowException(
                f"MLflow experiment {name!r} exists but is deleted; restore it "
                f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or remove it for good "
                "(`mlflow gc`) so gogh can recreate it"
            )
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_TAGS)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        exp = client.get_experiment_by_name(name)
        if exp is None:  # pragma: no cover - vanished between the two calls
            raise
        return exp.experiment_id


def as_uri(location: str | Path | None) -> str | None:
    """Accept a path or a URI for an artifact location; MLflow wants a URI."""
    if location is None:
        return None
    text = str(location)
    scheme = urlparse(text).scheme
    if isinstance(location, Path) or len(scheme) <= 1:  # a path (a one-letter scheme is a Windows drive)
        return Path(location).resolve().as_uri()
    return text
