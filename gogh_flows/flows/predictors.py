"""The champion predictors of a registry, as placements use them: loaded once, reloaded when
the alias moves, and never a reason for a placement to stall or fail.

Sources are kept per process, one per registry block: a registry lookup costs tens of
milliseconds, a download more, and a flow run should pay neither.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from filelock import Timeout as FileLockTimeout
from mlflow.exceptions import MlflowException

from gogh_flows.durable import write_text
from gogh_flows.flows.blocks import PredictorRegistry, state_dir
from gogh_flows.flows.run_logs import RUN_LOG
from gogh_flows.flows.startup import starting
from gogh_flows.predict.io import ModelFormatError, load_p1, load_p2, models_dir, models_dir_problem, prior_dir
from gogh_flows.predict.service import ThroughputPredictor, stored_records
from gogh_flows.tracking.backend import check_reachable, is_http, masked_uri
from gogh_flows.tracking.errors import TrackingUnavailableError, UnsafeArtifactError, short_error
from gogh_flows.tracking.registry import PRIOR_WAIT_S, ModelRegistry

log = logging.getLogger("gogh_flows")

#: what a model that cannot be used raises when loaded (garbage, unsafe files, damaged weights,
#: stored records out of range: all ValueErrors), or a file missing from it
LOAD_ERRORS = (ValueError, FileNotFoundError)
#: the cache's record of the versions last loaded (the fall-back's first choice)
LAST_GOOD = "last-good.json"
#: kept in a cached version's folder: which registry version it is a copy of (``_fetch``)
CACHE_IDENTITY = "gogh-cache.json"


def _cached_identity(folder: Path) -> str | None:
    try:
        return str(json.loads((folder / CACHE_IDENTITY).read_text())["identity"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class PriorRegistrationBusy(Exception):
    """Another process of this machine has held the prior's registration lock too long."""


class PriorMissing(ValueError):
    """The prior to register is not where the block says: the setting's fault, not the registry's.
    A placement falls back (to the versions cached here) and says so."""


#: how long a process waits for another of this machine registering the prior: both halves' waits
#: for a host elsewhere (``PRIOR_WAIT_S`` each) and their uploads
_PRIOR_LOCK_WAIT_S = 2 * PRIOR_WAIT_S + 180.0
#: the longest pause between attempts to register a prior that failed (``ensure_prior``)
_PRIOR_RETRY_MAX_S = 900.0

#: the tag naming which prior (both halves, by their weights' checksums) a registered version is
PRIOR_ID_TAG = "gogh.prior_id"


def prior_id(base: Path) -> str:
    """One prior's identity: its P1's and P2's weights, by the checksums their configs record."""
    sums = [json.loads((base / sub / "config.json").read_text())["weights_sha256"] for sub in ("p1", "p2")]
    return hashlib.sha256(":".join(sums).encode()).hexdigest()[:16]


@dataclass
class PredictorSource:
    """P1/P2 from the registry by alias, reloaded when the alias moves (checked every refresh_s)."""

    block: PredictorRegistry
    registry: ModelRegistry = field(init=False)
    _loaded: tuple[int | None, int | None] = (None, None)
    _predictor: ThroughputPredictor | None = None
    _checked_at: float = -1e18
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: why the predictors in use are not the registry's current champion (None when they are)
    degraded: str | None = None
    #: why, alone (``degraded`` is the whole warning): for a one-line summary
    degraded_reason: str | None = None
    _using: str = ""
    _fell_back_to: str = ""
    #: champion versions (P1, P2) that could not be loaded, and why: not downloaded again
    #: while the alias stays on them, and said once, not at every refresh
    _refused: dict[tuple[int | None, int | None], str] = field(default_factory=dict)
    #: the open question to the registry: asked on a daemon thread, so a placement can stop
    #: waiting for it (and a process can exit while the registry stalls)
    _asking: Future | None = None
    _asked_at: float = 0.0
    _asking_lock: threading.Lock = field(default_factory=threading.Lock)
    #: what the open question is doing besides asking the registry, for a late answer's message
    _doing: str | None = None
    #: the last failed registration of the prior: (not again before, pause, the error)
    _prior_failed: tuple[float, float, BaseException] | None = None
    #: whether the champion's prior was compared with the block's (said once, not every refresh)
    _prior_compared: bool = False

    def __post_init__(self) -> None:
        self.registry = ModelRegistry(self.block.resolved_tracking_uri(), self.block.resolved_registry_uri())

    def ensure_prior(self) -> None:
        """Register the shipped prior under the alias if the registry has nothing there yet."""
        if not self.block.prior:
            return
        base = prior_dir(self.block.prior)
        if not self._unset():
            self._say_if_the_champion_is_another_priors(base)
            return
        pair = self._check_prior_loads(base)
        failed = self._prior_failed
        if failed is not None and time.monotonic() < failed[0]:
            # each attempt leaves a FAILED run in MLflow (an artifact root this user cannot write: a
            # review counted one per refresh, thousands a day); tried again after a growing pause
            raise failed[2]
        try:
            self._register_prior(base, pair)
        except (TrackingUnavailableError, PriorRegistrationBusy):
            raise  # nothing was written: asked again at the next refresh
        except (MlflowException, OSError) as exc:
            pause = min(_PRIOR_RETRY_MAX_S, 2 * failed[1]) if failed else max(self.block.refresh_s, 30.0)
            self._prior_failed = (time.monotonic() + pause, pause, exc)
            raise
        self._prior_failed = None

    def _register_prior(self, base: Path, pair: str) -> None:
        # Flow runs started together (threads or processes on this machine) would otherwise
        # each see an empty alias and register the prior once each: one registers, the others
        # find the alias set once they get the lock.
        # Processes on other machines have locks of their own: there the registry decides
        # (``ensure_registered``), and a half may be set by another host while this one waits.
        lock_dir = state_dir() / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        self._doing = "registering the shipped prior, or waiting for another process that is"
        lock = FileLock(str(lock_dir / f"registry-{self._uri_key()}.lock"), timeout=_PRIOR_LOCK_WAIT_S)
        try:
            with lock:
                for name, sub in ((self.block.p1_name, "p1"), (self.block.p2_name, "p2")):
                    if self.registry.version_for(name, self.block.alias) is not None:
                        continue  # set meanwhile, here or on another machine
                    self._say_unset_alias(name)
                    # a half may be added only beside the other half of the same prior
                    self._refuse_beside_another(base, pair, name)
                    self.registry.ensure_registered(
                        name, base / sub, alias=self.block.alias,
                        p1_uri=f"models:/{self.block.p1_name}@{self.block.alias}", tags={PRIOR_ID_TAG: pair})
        except FileLockTimeout:
            raise PriorRegistrationBusy(
                f"another process of this machine has been registering the prior in "
                f"{self.block.resolved_registry_uri()} for over {_PRIOR_LOCK_WAIT_S:g} s (its lock {lock.lock_file}); "
                "if none is running, remove that file") from None
        finally:
            self._doing = None

    def _say_if_the_champion_is_another_priors(self, base: Path) -> None:
        """A block's prior is registered only where its alias is empty: given to a registry whose
        champion came from another prior, it was ignored without a word, and the user believed it
        in use (a review). Said once per source; a champion of unknown lineage is not judged."""
        if self._prior_compared:
            return
        try:
            version = self.registry.version_for(self.block.p1_name, self.block.alias)
            theirs = (self.registry.version_tags(self.block.p1_name, version).get(PRIOR_ID_TAG)
                      if version is not None else None)
            ours = prior_id(base)
        except (MlflowException, OSError, ValueError, KeyError):
            return  # the registry or the prior cannot be read: asked again at the next refresh
        self._prior_compared = True
        if theirs and theirs != ours:
            log.warning("gogh: PredictorRegistry(prior=%r) is not what runs are placed with: %s already has a champion "
                        "under @%s (%s v%s), from another prior or a retraining of one, and a prior is registered only "
                        "where there is none. To place with this prior, give the block another alias or model names "
                        "(p1_name, p2_name) or another registry; to keep the champion, drop prior= or give the one it "
                        "came from", self.block.prior, masked_uri(self.block.resolved_registry_uri()), self.block.alias,
                        self.block.p1_name, version)

    def _unset(self) -> list[str]:
        """The model names whose alias is not set in the registry."""
        return [name for name in (self.block.p1_name, self.block.p2_name)
                if self.registry.version_for(name, self.block.alias) is None]

    def _check_prior_loads(self, base: Path) -> str:
        """Both halves of the prior load, before anything is registered; the pair's identity.

        Registered one after the other, a prior whose P2 was damaged left its P1 champion and
        no P2, and the next start with another prior gave that P1 a P2 it was not trained with,
        without a word (a review)."""
        for sub, load in (("p1", load_p1), ("p2", load_p2)):
            if not (base / sub).is_dir():
                # the setting's fault, not the registry's (a review read "the MLflow registry ... is
                # unreachable (FileNotFoundError: prior ...)"): said as it is, and fallen back from
                problem = models_dir_problem()
                raise PriorMissing(
                    f"the prior {self.block.prior!r} has no {sub}/ at {base.resolve()}; " + (
                        problem if problem else
                        f"the shipped priors are the folders of {models_dir()}: give a shipped prior's name, set "
                        "GOGH_MODELS_DIR to gogh-flows' models/ folder, or give the folder `gogh predictors train "
                        "--out DIR` wrote"))
            try:
                load(base / sub)
            except (ModelFormatError, UnsafeArtifactError, ValueError, OSError) as exc:
                raise ValueError(f"the prior {base} cannot be registered: its {sub}/ does not load "
                                 f"({short_error(exc)}); nothing was registered. Copy the folder again, or train it "
                                 "again with `gogh predictors train --out DIR`") from None
        return prior_id(base)

    def _refuse_beside_another(self, base: Path, pair: str, adding: str) -> None:
        """Refuse to register ``adding`` beside the other half if that one is another prior's."""
        other = self.block.p2_name if adding == self.block.p1_name else self.block.p1_name
        version = self.registry.version_for(other, self.block.alias)
        if version is None or self._of_prior(other, version, base, pair):
            return
        raise ValueError(
            f"{other} v{version} (@{self.block.alias}) in {self.block.resolved_registry_uri()} is not from this "
            f"PredictorRegistry's prior {base}: registering {adding} from it would pair models not trained "
            "together. Give the block the prior the registry holds, or register both halves of yours under new "
            "p1_name/p2_name")

    def _of_prior(self, name: str, version: int, base: Path, pair: str) -> bool:
        """Whether a registered version belongs with this prior: by its tag (a prior's halves, and
        the refiners retrained from them, carry it), else, for a prior's half registered before the
        tag, by its weights against the same half here; a version of unknown lineage is not judged."""
        tags = self.registry.version_tags(name, version)
        if PRIOR_ID_TAG in tags:
            return tags[PRIOR_ID_TAG] == pair
        if tags.get("gogh.origin") != "prior":
            return True
        sub = "p1" if name == self.block.p1_name else "p2"
        ours = json.loads((base / sub / "config.json").read_text())["weights_sha256"]
        theirs = json.loads((self._fetch(name, version) / "config.json").read_text()).get("weights_sha256")
        return theirs == ours

    def _say_if_not_trained_together(self, v1: int, v2: int | None) -> None:
        """Warn when the aliased P2 was trained with another P1 than the aliased one (its tags say
        which: a retrained challenger's ``p1_version``, a prior's or its descendants' prior id).
        Retraining checks the pair before promoting; a person moving one alias by hand can still
        make one, which placed with predictions no evaluation scored (a review). Said, not refused:
        both halves load, and the next retraining is judged on the pair as it is."""
        if v2 is None:
            return
        try:
            p2_tags = self.registry.version_tags(self.block.p2_name, v2)
            trained_with = p2_tags.get("p1_version")
            why = None
            if trained_with not in (None, "", "None") and trained_with != str(v1):
                why = f"it was trained with {self.block.p1_name} v{trained_with}"
            elif p2_tags.get(PRIOR_ID_TAG):
                p1_prior = self.registry.version_tags(self.block.p1_name, v1).get(PRIOR_ID_TAG)
                if p1_prior and p1_prior != p2_tags[PRIOR_ID_TAG]:
                    why = "it descends from another prior than that P1"
        except Exception:  # noqa: BLE001 - only words a warning
            return
        if why is not None:
            log.warning("gogh: the champion pair %s v%s and %s v%s were not trained together (%s); placements use "
                        "them as they are. Point the aliases at a pair trained together (a retrained refiner's "
                        "tag p1_version names its P1)", self.block.p1_name, v1, self.block.p2_name, v2, why)

    def _say_unset_alias(self, name: str) -> None:
        """A model with versions but no alias: a champion deleted (or its alias removed) by
        hand, which the shipped prior is about to replace; said, since the fleet then places
        with the prior and the next retraining is judged against it (a review found it silent)."""
        try:
            known = self.registry.versions(name)
        except Exception:  # noqa: BLE001 - only words a warning
            return
        if known.height:
            log.warning("gogh: %s in %s has %d version(s) but none under the alias %r (a champion deleted, or its "
                        "alias removed); the shipped prior %r is registered under it. To serve another version, "
                        "point the alias at it: ModelRegistry(uri).set_alias(%r, %r, <version>)", name,
                        self.block.resolved_registry_uri(), known.height, self.block.alias, self.block.prior, name,
                        self.block.alias)

    def _uri_key(self) -> str:
        """Short name of the registry URI for the files kept per registry (lock, model cache)."""
        return hashlib.sha1(self.block.resolved_registry_uri().encode()).hexdigest()[:10]

    def _cache_root(self) -> Path:
        return state_dir() / "model-cache" / self._uri_key()

    def _cache_folder(self, name: str, version: int) -> Path:
        return self._cache_root() / f"{name}-v{version}"

    def _is_cached(self, name: str, version: int | None) -> bool:
        """Whether a whole copy of the version is in the cache (None: no version, nothing to cache)."""
        return version is not None and (self._cache_folder(name, version) / "config.json").exists()

    def _pair_predictor(self, v1: int, v2: int | None, folder: Callable[[str, int], Path]) -> ThroughputPredictor:
        """P1 ``v1`` and P2 ``v2`` (None: no refiner), each loaded from ``folder(name, version)``."""
        return ThroughputPredictor(load_p1(folder(self.block.p1_name, v1)),
                                   None if v2 is None else load_p2(folder(self.block.p2_name, v2)))

    def _fetch(self, name: str, version: int) -> Path:
        """A registered version, downloaded (and verified weights-only) once into the local cache.

        Only a version that loads enters the cache: one cached when its files merely had the
        right types, then refused by the loader's checks (hash, shapes, finite values, stored
        records), became the fall-back of every later placement, which then failed on it.
        A cached copy is used only while it is the registry's version of that number (its
        creation time, run and source, kept beside it): a registry made again, or a model
        deleted and registered anew, numbers from 1 again, and the old copy was served in its
        place, unsaid (a review)."""
        dest = self._cache_folder(name, version)
        identity = self.registry.version_identity(name, version)

        def current() -> bool:  # a whole copy of the registry's version of this number is in the cache
            return self._is_cached(name, version) and _cached_identity(dest) == identity

        if current():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{os.getpid()}.{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.registry.download(f"models:/{name}/{version}", dest=tmp)
            self._check(name, tmp)
            write_text(tmp / CACHE_IDENTITY, json.dumps({"identity": identity}))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if current():
            shutil.rmtree(tmp, ignore_errors=True)  # another process cached this same version meanwhile
            return dest
        if dest.exists():  # another registry's (or an unmarked older) copy of this number: set aside
            stale = dest.parent / f".{dest.name}.stale.{os.getpid()}.{threading.get_ident()}"
            try:
                os.replace(dest, stale)
            except OSError:  # another process moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process cached it first (the same version: it checked the identity too)
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def _check(self, name: str, folder: Path) -> None:
        """Raise as loading would (``LOAD_ERRORS``) if ``folder`` does not hold a usable ``name``."""
        if name == self.block.p1_name:
            load_p1(folder)
        else:
            stored_records(load_p2(folder))

    def _load(self, v1: int, v2: int | None) -> ThroughputPredictor:
        """The champion's versions, from the cache or the registry; a cached copy damaged since it
        was checked (its weights no longer match their hash) is set aside and downloaded again."""
        pair = ((self.block.p1_name, v1), (self.block.p2_name, v2))
        try:
            return self._pair_predictor(v1, v2, self._fetch)
        except LOAD_ERRORS:
            damaged = self._set_aside_broken(pair)
            # a copy another process set aside (or replaced) while this one read it is gone, not a
            # refusal: fetched again. A registered version that fails its check never enters the
            # cache, so it fails the second fetch too, and is refused then.
            gone = [(n, v) for n, v in pair if v is not None and not self._is_cached(n, v)]
            if not damaged and not gone:
                raise
            if damaged:
                log.warning("gogh: the cached %s did not load any more (changed on disk since it was checked); "
                            "downloaded again", ", ".join(damaged))
            return self._pair_predictor(v1, v2, self._fetch)

    def _set_aside_broken(self, versions: Iterable[tuple[str, int | None]]) -> list[str]:
        """Remove the cached folders among ``versions`` that do not load; their names."""
        removed = []
        for name, version in versions:
            if not self._is_cached(name, version):
                continue
            folder = self._cache_folder(name, version)
            try:
                self._check(name, folder)
            except LOAD_ERRORS:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
        return removed

    def _remember_good(self, v1: int, v2: int | None) -> None:
        """The versions last loaded here: what a placement falls back to while the registry is
        away (not the newest cached of each, which may be a demoted champion, or a refiner not
        trained with that estimator)."""
        try:
            write_text(self._cache_root() / LAST_GOOD, json.dumps({"p1": v1, "p2": v2}))
        except OSError as exc:  # the fall-back then takes the newest cached: said, not fatal
            log.warning("gogh: could not record the predictors last loaded (%s)", exc)

    def versions(self) -> dict[str, int | None]:
        return {"p1": self._loaded[0], "p2": self._loaded[1]}

    def refused(self, v1: int | None, v2: int | None) -> str | None:
        """Why this pair of versions was refused as unloadable here (None: it was not)."""
        return self._refused.get((v1, v2))

    @property
    def using(self) -> str:
        """What the last placement's predictors were, in words: the champion's versions, the
        versions cached locally or the built-in prior (say it rather than "champion" when the
        registry is down or stalled)."""
        return self._fell_back_to if self.degraded else self._using

    def get(self, *, force: bool = False, bounded: bool = True) -> ThroughputPredictor:
        """The champion, reloaded when its alias moved; never a stall, never a failed placement.

        MLflow unreachable: the predictors already loaded, else the newest versions cached
        locally, else the built-in prior. A champion that cannot be loaded (garbage or
        missing artifacts): the last good version, else the built-in prior. A registry that
        answers its health check but then does not answer within the block's ``timeout_s``:
        the same fall-back, while the question stays open in the background and its answer is
        used by the next placement (one placement waits for a stalled registry, not every
        one). Either way the reason is kept in ``degraded`` for the run's log, and the
        registry is asked again after ``refresh_s``. ``bounded=False`` (retraining) waits for
        the registry's answer however long it takes.
        """
        if not force and self._fresh():
            return self._predictor  # type: ignore[return-value]
        while True:
            with self._asking_lock:
                open_question = self._asking if self._asking is not None and not self._asking.done() else None
                if open_question is None:
                    self._asking, self._asked_at = _in_background(self._ask_registry, force), time.monotonic()
                if open_question is None or not force:
                    asking, asked_at = self._asking, self._asked_at
                    break
            # a forced read must not be answered by an older question: wait for it (not under
            # the lock, so placements can still fall back meanwhile), then ask anew
            wait_for_futures((open_question,))
        if not bounded:
            return asking.result()
        try:  # whoever asked first, the registry gets timeout_s from the question to answer
            return asking.result(timeout=max(0.0, asked_at + self.block.timeout_s - time.monotonic()))
        except FuturesTimeout:
            return self._stalled()

    def _fresh(self) -> bool:
        return self._predictor is not None and time.monotonic() - self._checked_at < self.block.refresh_s

    def _stalled(self) -> ThroughputPredictor:
        """The registry has not answered in time: place with what is at hand, without waiting for it."""
        doing = self._doing  # a slow answer is not always a slow registry: say what it waits for
        reason = (f"the MLflow registry at {self.block.resolved_registry_uri()} did not answer within "
                  f"{self.block.timeout_s:g} s" + (f" (this process is {doing})" if doing else ""))
        # not under the lock: the open question holds it while it waits for the registry
        predictor, using = self._predictor, self._using
        if predictor is None:
            # the first question of this process is still open: the cache or the prior for
            # this placement only; the answer, when it comes, is kept
            predictor, _, using = self._fallback_predictor(reason)
        return self._fall_back_to(predictor, using, reason)

    def _ask_registry(self, force: bool) -> ThroughputPredictor:
        # one question is open at a time (``get``), so only the process's first load says so
        if self._predictor is not None:
            return self._ask(force)
        with starting("the predictors", f"{self.block.p1_name}/{self.block.p2_name} @{self.block.alias}"):
            return self._ask(force)

    def _ask(self, force: bool) -> ThroughputPredictor:
        with self._lock:
            if not force and self._fresh():
                return self._predictor  # type: ignore[return-value]
            self._checked_at = time.monotonic()
            uri = self.block.resolved_registry_uri()
            try:
                for probe in dict.fromkeys((self.block.resolved_tracking_uri(), uri)):
                    if is_http(probe):  # one short probe instead of MLflow's minutes of retries
                        check_reachable(probe, timeout=3.0)
                self.ensure_prior()
                v1 = self.registry.version_for(self.block.p1_name, self.block.alias)
                v2 = self.registry.version_for(self.block.p2_name, self.block.alias)
            except (PriorRegistrationBusy, PriorMissing) as exc:  # not the registry's fault: said as it is
                return self._fall_back(str(exc))
            except TrackingUnavailableError as exc:  # the tracking server's or the registry's: the error names it
                return self._fall_back(f"MLflow is unreachable ({short_error(exc)})")
            except (MlflowException, OSError) as exc:  # it answered, and failed (a review read "unreachable")
                return self._fall_back(f"the MLflow registry at {uri} failed ({short_error(exc)})")
            if v1 is None:
                raise ValueError(
                    f"no version of {self.block.p1_name!r} has alias {self.block.alias!r} in {uri}; register "
                    "one (gogh predictors train + the registry) or set prior='synthetic' on the "
                    "PredictorRegistry block")
            if self._predictor is None or (v1, v2) != self._loaded:
                if (v1, v2) in self._refused:
                    return self._fall_back(self._refused[(v1, v2)])
                try:
                    predictor = self._load(v1, v2)
                except LOAD_ERRORS as exc:
                    # garbage or missing artifacts: asking again will not help until the alias moves
                    self._refused[(v1, v2)] = (f"the champion ({self.block.p1_name} v{v1}, {self.block.p2_name} "
                                               f"v{v2}) cannot be loaded ({short_error(exc)})")
                    return self._fall_back(self._refused[(v1, v2)])
                except (MlflowException, OSError) as exc:  # the registry failed to serve them: asked again
                    return self._fall_back(f"the champion ({self.block.p1_name} v{v1}, {self.block.p2_name} "
                                           f"v{v2}) could not be downloaded ({short_error(exc)})")
                self._predictor = predictor
                self._loaded = (v1, v2)
                self._remember_good(v1, v2)
                self._say_if_not_trained_together(v1, v2)
                self._using = f"the predictors already loaded (P1 v{v1}, P2 v{v2})"
                log.info("gogh: loaded predictors %s v%s, %s v%s (alias %s)", self.block.p1_name, v1,
                         self.block.p2_name, v2, self.block.alias)
            self.degraded = self.degraded_reason = None
            return self._predictor

    def _fall_back(self, reason: str) -> ThroughputPredictor:
        """Keep what is loaded, else load the newest cached versions, else the prior (under the lock)."""
        if self._predictor is None:
            self._predictor, self._loaded, self._using = self._fallback_predictor(reason)
        return self._fall_back_to(self._predictor, self._using, reason)

    def _fallback_predictor(self, reason: str) -> tuple[ThroughputPredictor, tuple[int | None, int | None], str]:
        for v1, v2 in self._cached_pairs():
            try:
                predictor = self._pair_predictor(v1, v2, self._cache_folder)
            except LOAD_ERRORS as exc:
                # changed on disk since it was checked: set aside, the next candidate (or the prior) serves
                gone = self._set_aside_broken(((self.block.p1_name, v1), (self.block.p2_name, v2)))
                log.warning("gogh: the cached predictors P1 v%s, P2 v%s do not load (%s)%s", v1, v2, short_error(exc),
                            f"; set aside {', '.join(gone)}" if gone else "")
                continue
            return predictor, (v1, v2), f"the versions cached locally (P1 v{v1}, P2 v{v2})"
        base = prior_dir(self.block.prior or "synthetic")
        if not (base / "p1").is_dir():
            advice = "" if "GOGH_MODELS_DIR" in reason else "; set GOGH_MODELS_DIR to gogh-flows' models/"
            raise RuntimeError(f"{reason}, and there is no cached version nor built-in prior at "
                               f"{base} to place with{advice}")
        p2 = load_p2(base / "p2") if (base / "p2").is_dir() else None
        return ThroughputPredictor(load_p1(base / "p1"), p2), (None, None), f"the built-in prior {base.name!r}"

    def _fall_back_to(self, predictor: ThroughputPredictor, using: str, reason: str) -> ThroughputPredictor:
        self._fell_back_to = using
        message = (f"gogh: {reason}; placing with {using} until it is back (asked again every "
                   f"{self.block.refresh_s:g} s)")
        if message != self.degraded:
            log.warning(message, extra={RUN_LOG: False})  # a placement says it in its run's log itself
        self.degraded, self.degraded_reason = message, reason
        return predictor

    def _cached_pairs(self) -> Iterator[tuple[int, int | None]]:
        """Cached (P1, P2) versions to fall back to, best first: the pair last loaded here, then
        the newest P1 with the newest P2 (None: a P1 with no refiner cached). Each is looked up
        again when asked for, so a pair set aside as broken is not offered twice."""
        root = self._cache_root()

        def cached(name: str) -> list[int]:
            found = []
            for d in root.glob(f"{name}-v*"):
                suffix = d.name[len(name) + 2:]
                if suffix.isdigit() and (d / "config.json").exists():
                    found.append(int(suffix))
            return sorted(found, reverse=True)

        offered = set()
        try:
            good = json.loads((root / LAST_GOOD).read_text())
            last = (int(good["p1"]), None if good.get("p2") is None else int(good["p2"]))
        except (OSError, ValueError, KeyError, TypeError):
            last = None
        if (last is not None and self._is_cached(self.block.p1_name, last[0])
                and (last[1] is None or self._is_cached(self.block.p2_name, last[1]))):
            offered.add(last)
            yield last
        while True:
            p1s, p2s = cached(self.block.p1_name), cached(self.block.p2_name)
            pair = (p1s[0], p2s[0] if p2s else None) if p1s else None
            if pair is None or pair in offered:
                return
            offered.add(pair)
            yield pair


def _in_background(call, *args) -> Future:
    """``call(*args)`` on a daemon thread, its outcome in a future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="gogh-registry", daemon=True).start()
    return future


_SOURCES: dict[str, PredictorSource] = {}
_LOCK = threading.Lock()


def predictor_source(block: PredictorRegistry) -> PredictorSource:
    """The process's source for ``block`` (one per registry, shared by every run)."""
    key = block.model_dump_json()
    with _LOCK:
        src = _SOURCES.get(key)
        if src is None:
            src = _SOURCES[key] = PredictorSource(block)
        return src


def forget_predictor_sources() -> None:
    """Drop the loaded sources (the next run loads them again)."""
    with _LOCK:
        _SOURCES.clear()


__all__ = ["PredictorSource", "forget_predictor_sources", "models_dir", "predictor_source"]
