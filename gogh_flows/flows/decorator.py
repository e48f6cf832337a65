"""``@gogh_placed``: a Prefect flow whose every run is placed on the right GPU of a mixed fleet.

A decorated flow is still an ordinary Prefect ``Flow`` (same name, signature, parameter
validation, retries, ``with_options``, deployments); only its body is wrapped:

1. a ``gogh-place`` task predicts the run's throughput on every GPU type and next to every
   run already on the fleet, solves the placement, claims the slot in the pool's ledger
   (compare-and-set on what the decision saw) and publishes the explanation as a markdown
   artifact;
2. the body runs on the Dask worker pinned to that GPU, inside the flow run's Prefect
   context (tasks it calls are children of the flow run);
3. the measurement (throughput, power, energy, partners) is logged to the local table and
   MLflow, on success *and* on failure, for every attempt; the worker frees the slot when the
   body has stopped, and every wait on the way is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from prefect import Flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, hydrated_context, serialize_context
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from gogh_flows.flows.blocks import GpuCluster, PlacementPolicy, PredictorRegistry, check_block_name, load_block
from gogh_flows.flows.body_dask import bodys_own_dask
from gogh_flows.flows.cancellation import PrefectCancellation
from gogh_flows.flows.current import _CURRENT, CurrentPlacement
from gogh_flows.flows.predictors import predictor_source
from gogh_flows.flows.run_logs import route_prints, send_warnings_to_run_logs
from gogh_flows.predict.intervals import NoIntervalsError
from gogh_flows.flows.session import Session, shared_session
from gogh_flows.flows.lost_runs import crash_flow_run, handling, take_workers_record
from gogh_flows.flows.measure import record_if_placer_lost, record_run
from gogh_flows.placement.patience import Patience
from gogh_flows.flows.placer import (
    InfeasibleRequirement,
    PlacementCancelled,
    PlacementTimeout,
    RunLost,
    RunPlacement,
    place_with_retry,
    with_point_prediction,
)
from gogh_flows.flows.spec import check_wait_timeout, check_warmup_steps, placed_job
from gogh_flows.runtime.context import GpuContext, RunCancelled, current_gpu, use_gpu
from gogh_flows.runtime.leases import PoolLedger
from gogh_flows.runtime.ledger import PLACER_GAVE_UP, PLACER_LOST
from gogh_flows.runtime.pool import CLIENT_TIMEOUT_S
from gogh_flows.runtime.probe import SchedulerUnreachable
from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS
from gogh_flows.workloads.job import JobSpec

log = logging.getLogger("gogh_flows")


@dataclass(frozen=True)
class _Settings:
    cluster: GpuCluster | str | None
    registry: PredictorRegistry | str | None
    policy: PlacementPolicy | str | None
    wait_timeout_s: float | None = None  # the decorator's override of the policy's
    warmup_steps: int = DEFAULT_WARMUP_STEPS  # steps before the run's steady-state window


def _check_block_arg(name: str, value: Any, kind: type) -> None:
    if value is not None and not isinstance(value, (str, kind)):
        raise TypeError(f"@gogh_placed({name}=...) must be the name of a saved {kind.__name__} "
                        f"block, a {kind.__name__}, or None (embedded default); got {value!r}")
    if isinstance(value, str):
        check_block_name(kind, value, f"@gogh_placed({name}=...)")


def gogh_placed(
    __fn: Callable | None = None, *, model: Any, batch_size: int, min_throughput: float,
    work_steps: int, cluster: GpuCluster | str | None = None,
    registry: PredictorRegistry | str | None = None, policy: PlacementPolicy | str | None = None,
    kind: str = "training", example_inputs: Any = None, job_name: str | None = None,
    wait_timeout_s: float | None = None, warmup_steps: int | None = None,
) -> Any:
    """Place every run of the decorated flow on the GPU that meets ``min_throughput`` at least energy.

    ``model`` is a zoo family name ("ResNet-50"), a zoo builder, your own ``nn.Module`` (or a
    function returning one, with ``example_inputs``), or ``WorkloadFeatures``. ``cluster``,
    ``registry`` and ``policy`` name saved blocks (or are block instances); ``None`` uses the
    embedded defaults: an emulated four-type fleet, MLflow on SQLite under ./.gogh, the
    optimiser. ``wait_timeout_s`` overrides the policy's wait for a GPU. ``warmup_steps``: the
    steps (reported through ``current_placement().report()``) before the run's steady-state
    measurement opens (default: 5, or fewer when the work is shorter); throughput and energy
    are logged from there to the last report, and the start-up apart.
    """
    job = placed_job(model=model, batch_size=batch_size, min_throughput=min_throughput,
                     work_steps=work_steps, kind=kind, example_inputs=example_inputs,
                     job_name=job_name)
    wait_s = check_wait_timeout(wait_timeout_s)
    warmup = check_warmup_steps(warmup_steps, job.work_steps)
    _check_block_arg("cluster", cluster, GpuCluster)
    _check_block_arg("registry", registry, PredictorRegistry)
    _check_block_arg("policy", policy, PlacementPolicy)
    if isinstance(policy, PlacementPolicy):  # a block named is checked when a run loads it
        _check_efficiency_wait(policy, wait_s)
    settings = _Settings(cluster, registry, policy, wait_s, warmup)

    def decorate(obj: Any) -> Flow:
        if isinstance(obj, Flow):
            base, fn = obj, obj.fn
        elif callable(obj):
            base, fn = None, obj
        else:
            raise TypeError(f"@gogh_placed decorates a function or a Prefect flow, got {obj!r}")
        if getattr(fn, "__gogh_placed__", None) is not None:
            raise ValueError(f"{fn.__name__} is already @gogh_placed; decorate it once")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # its body would run only as the caller iterates it, after the GPU was given back: placed,
            # measured as done, and nothing run there (a Prefect review)
            raise TypeError(f"@gogh_placed runs {fn.__name__}'s body once on its GPU and measures it; a generator "
                            "flow's body runs only while its caller iterates it, after the GPU is freed. Return "
                            "the results (a list) instead of yielding them")
        if base is not None:
            refuse_dask_task_runner(base)
        wrapper = _wrap(fn, job, settings)
        if base is None:
            return PlacedFlow(fn=wrapper)
        placed = base.with_options()
        placed.__class__ = PlacedFlow  # a Flow with one more behaviour (its __signature__ guard), no new state
        placed.fn = wrapper
        return placed

    return decorate(__fn) if __fn is not None else decorate


def refuse_dask_task_runner(flow: Flow) -> None:
    """A placed body runs on a Dask worker of the GPU pool; prefect-dask's task runner there finds
    the pool's own client and runs the flow's tasks on the pool's other GPUs, outside their slots,
    unmeasured (with one slot per GPU, waiting for ever behind the body): refused by name."""
    runner = type(getattr(flow, "task_runner", None))
    if runner.__name__ == "DaskTaskRunner" or runner.__module__.startswith("prefect_dask"):
        raise TypeError(
            f"flow {flow.name!r} uses {runner.__name__}, and @gogh_placed runs its body on a Dask worker of the "
            "GPU pool, where that runner would run the flow's tasks on the pool's other GPUs, outside their "
            "slots. Use Prefect's default task runner (tasks then run beside the body, on its GPU), or hand work "
            "to a cluster of your own inside the body: client = distributed.Client(address); client.compute(...)")


send_warnings_to_run_logs()


#: how long a placed flow's first call waits for Prefect's temporary server, unless set
EPHEMERAL_STARTUP_S = 180


def _patient_ephemeral_server() -> Any:
    """Prefect's settings with :data:`EPHEMERAL_STARTUP_S` as the temporary server's startup wait,
    unless it was set (environment, profile, prefect.toml: Prefect's ``set_defaults`` keeps those).

    With no ``PREFECT_API_URL`` the first flow call starts Prefect's temporary server and waits
    20 s for it; a first start also creates its database, which on a busy 2-core machine takes
    longer, so the README's first example failed on its first run ("Timed out while attempting
    to connect to ephemeral Prefect API server") and passed on the second. Scoped to the call:
    nothing else in the process sees the change. With a server configured nothing is changed:
    entering Prefect's settings context costs about 40 ms, too much for every call of a flow."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value():  # no temporary server to wait for
        return contextlib.nullcontext()
    return temporary_settings(set_defaults={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: EPHEMERAL_STARTUP_S})


_TEMPORARY_SERVER_LOCK = threading.Lock()
#: set once this process's temporary Prefect server answered (read without the lock)
_TEMPORARY_SERVER_READY = threading.Event()


def _start_temporary_server() -> None:
    """Start Prefect's temporary server once, under a lock, when no server is configured, and
    return when it answers.

    Prefect starts it from the first client of each thread without a lock: flow runs started
    together from threads (a thread pool fanning out, a review) each saw it not yet running and
    started one of their own (ports taken, "Server process did not start", and a server left
    running after the script exited, its stop registered for another), or saw it marked running
    (which Prefect does before its process answers) and failed to connect. Here the first call
    starts it and every other waits, under the lock, until its health check answers.
    """
    if _TEMPORARY_SERVER_READY.is_set():
        return
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    with _TEMPORARY_SERVER_LOCK:
        if _TEMPORARY_SERVER_READY.is_set():
            return
        server = SubprocessASGIServer()  # Prefect's own instance, the one its clients use
        if not server.running:
            server.start()  # returns once its health check answered
        else:  # started by Prefect itself (a client in another thread): wait until it answers
            _wait_until_healthy(server.api_url, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        _TEMPORARY_SERVER_READY.set()


def _wait_until_healthy(api_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            try:
                if client.get(f"{api_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's temporary server at {api_url} did not answer within {timeout_s:g} s; "
                                   "set PREFECT_API_URL to a running server (prefect server start)")
            time.sleep(0.1)


class PlacedFlow(Flow):
    """What ``@gogh_placed`` returns: a Prefect ``Flow``, which refuses to be wrapped by ``@flow``.

    ``@flow`` above ``@gogh_placed`` would make a flow whose function is this flow: its name,
    description and task runner overwritten by this flow's, and every run two flow runs (the
    outer and this one as its subflow); in a script's ``__main__`` Prefect fails outright with
    "module, class, method, function ... expected, got Flow". So when Prefect's ``Flow``
    constructor inspects this flow as its function, the decoration stops with what to do.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the call starts Prefect's temporary server when no server is configured: give it time
        if self.isasync:
            async def call() -> Any:
                with _patient_ephemeral_server():
                    await asyncio.to_thread(_start_temporary_server)  # its start-up wait blocks
                    return await super(PlacedFlow, self).__call__(*args, **kwargs)
            return call()
        with _patient_ephemeral_server():
            _start_temporary_server()
            return super().__call__(*args, **kwargs)

    def with_options(self, **options: Any) -> PlacedFlow:
        """Prefect's ``with_options``, still a placed flow (its copy is a plain ``Flow`` otherwise:
        it would place its runs, but lose the ``@flow``-on-top guard and the server's start-up wait)."""
        new = super().with_options(**options)
        new.__class__ = PlacedFlow  # the same state, this class's behaviour
        return new

    @property
    def __signature__(self) -> Any:
        # Prefect's Flow.__init__ asks inspect.signature(fn) before anything else can go wrong
        frame = sys._getframe(1)
        while frame is not None:
            if (frame.f_code.co_name == "__init__" and frame.f_locals.get("fn") is self
                    and isinstance(frame.f_locals.get("self"), Flow) and frame.f_locals.get("self") is not self):
                raise TypeError(
                    f"@flow is applied on top of @gogh_placed for {self.name!r}: put @gogh_placed outermost, "
                    "e.g.\n    @gogh_placed(model=..., ...)\n    @flow(name=..., retries=...)\n    def train(...): ...\n"
                    "(@gogh_placed keeps the inner flow's name, retries and other options)")
            frame = frame.f_back
        raise AttributeError("__signature__")  # anyone else: no override, the usual signature


def _wrap(fn: Callable, job: JobSpec, settings: _Settings) -> Callable:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            # asyncio.to_thread copies the context, so the flow run context goes along. A
            # cancellation of this coroutine (Prefect's timeout_seconds, asyncio.wait_for, a
            # task's cancel) cannot reach that thread by itself: it is told through ``stop``, and
            # this coroutine waits for it to have stopped the body, freed the slot and logged
            # what ran, as a sync flow's call does, before the cancellation goes on.
            stop = threading.Event()
            work = asyncio.ensure_future(asyncio.to_thread(run_placed, fn, job, settings, args, kwargs, stop))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                stop.set()
                await _settled(work)
                raise

        async_wrapper.__gogh_placed__ = job  # type: ignore[attr-defined]
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_placed(fn, job, settings, args, kwargs)

    wrapper.__gogh_placed__ = job  # type: ignore[attr-defined]
    return wrapper


async def _settled(work: asyncio.Future) -> None:
    """Wait for a cancelled run's thread to finish its way out (bounded there: the body's stop,
    the slot, the record), not cancellable again meanwhile; its own error is the run's record's.

    Shielded from anyio's cancel scopes (Prefect's ``timeout_seconds`` is one: it cancels the
    task again on every turn of the loop, which made this wait spin a core) and, by
    ``asyncio.shield``, from a plain ``task.cancel()``.
    """
    with anyio.CancelScope(shield=True):
        while not work.done():
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                if work.done():
                    break
            except Exception:  # noqa: BLE001 - the run's own error: recorded; the cancellation goes on
                break
    if work.done() and not work.cancelled():
        work.exception()  # retrieved: asyncio would otherwise log it as never retrieved


@task(name="gogh-place", cache_policy=NO_CACHE, persist_result=False)
def place_run(job: JobSpec, run_id: str, session: Session, registry: PredictorRegistry,
              policy: PlacementPolicy, wait_timeout_s: float, flow_name: str = "",
              stop: threading.Event | None = None) -> RunPlacement:
    """Predict, solve, reserve; publish the explanation as a markdown and a table artifact.

    The artifacts are keyed per flow (``gogh-placement-<flow>`` and ``...-options``), so each
    flow's page in the Prefect UI keeps the history of its own placements.

    Bounded apart from waiting for a busy fleet: the registry by the registry block's
    ``timeout_s`` (then the last good predictors), deciding by ``placement_timeout_s``. A
    ``stop`` set while it waits for the fleet (an async flow's caller was cancelled) ends the
    wait with :class:`PlacementCancelled` within a poll.
    """
    logger = get_run_logger()
    source = predictor_source(registry)
    predictor = source.get()
    if source.degraded:
        logger.warning(source.degraded)
    # what this pool's runs measured (for the refiner) and measured at lowered limits (no level a job
    # type was too slow at is offered again): read for every decision, so that a run that waited is
    # placed on what the runs before it measured meanwhile (the cache re-reads only a changed table)
    observations = session.observations.get if policy.refine else (lambda: None)
    evidence = session.observations.limit_evidence if policy.refine and policy.power_limit_levels else None
    if policy.risk_level is not None and predictor.intervals is None:
        raise NoIntervalsError(
            f"PlacementPolicy(risk_level={policy.risk_level:g}) plans with the refiner's calibrated intervals, and "
            f"the predictors in use (P1 v{source.versions().get('p1')}, P2 v{source.versions().get('p2')}) have none: "
            "add them with `gogh predictors calibrate --model DIR` (DIR as `gogh predictors train --out` wrote it) "
            "and use it as PredictorRegistry(prior=DIR) under new p1_name/p2_name (or a new tracking store: a "
            "registry that has a champion keeps it), or set risk_level=None")
    risk = policy.risk_level
    tables: dict[str, Any] = {}  # the last decision's tables without and with the risk level

    live: list = []  # the devices the decision being made places on

    def devices(state: Any) -> list:
        live[:] = session.pool.live_devices(state.workers)
        return list(live)

    def predict(feats: dict) -> Any:
        # the GPU types of this decision's pool: a worker of a type new to this process may have
        # joined since the placement began (a run waiting for a GPU failed with "not in the
        # throughput table" when one did)
        gpu_types = sorted({d.gpu_type for d in [*live, *session.pool.devices]})
        point, planned = predictor.predict_tables(feats, gpu_types, observations(), risk=risk)
        tables.update(point=point, planned=planned)
        return planned

    try:
        placement = place_with_retry(
            job, run_id, devices=devices, ledger=session.pool.ledger,
            predict=predict,
            features=session.features.get, policy=policy.policy, time_limit_s=policy.solver_time_limit_s,
            wait_timeout_s=wait_timeout_s, poll_s=policy.poll_s, versions=source.versions(),
            on_wait=logger.info, sleep=_stoppable(session.wait_for_release, stop, run_id, session.notify_released),
            headroom=policy.headroom, headroom_wait_s=policy.headroom_wait_s,
            placement_timeout_s=policy.placement_timeout_s, power_limit_levels=tuple(policy.power_limit_levels),
            limit_evidence=evidence, limit_trials=policy.limit_trials, measuring=session.measuring,
            patience=Patience(min(policy.wait_for_efficiency_s, wait_timeout_s), policy.efficiency_min_saving,
                              within_reach=policy.wait_within_reach)
            if policy.wait_for_efficiency_s > 0 else None,
        )
    except InfeasibleRequirement as exc:
        if risk is None or "point" not in tables:
            raise
        raise InfeasibleRequirement(f"{exc}{_at_risk_level(job, tables['point'], risk)}") from None
    if risk is not None and tables:
        placement = with_point_prediction(placement, tables["point"], tables["planned"], risk)
    key = artifact_key(flow_name)
    try:
        create_markdown_artifact(markdown=placement.explanation_md, key=key,
                                 description=f"Placement of {job.job_type} on {placement.gpu_id}")
        create_table_artifact(table=[dict(r) for r in placement.options], key=f"{key}-options",
                              description=f"Options for {job.job_type}: the chosen GPU and the runner-ups")
    except Exception as exc:  # the explanation is a convenience; the run must go on
        logger.warning("could not publish the placement artifacts: %s", exc)
    # the power limit chosen with the GPU is part of the decision: said where the GPU is
    limit = "" if placement.power_limit_w is None else f" at a {placement.power_limit_w:g} W power limit"
    if placement.limit_trial:  # offered at the rate measured one level up, without margin (at any risk level)
        predicted = (f"predicted {placement.predicted_throughput:.4g} steps/s (a trial one level below the best "
                     "limit measured, offered at the rate measured there: the run measures what the lower limit "
                     "costs, and its board is lifted if it falls short)")
    elif placement.risk_level is None:
        predicted = f"predicted {placement.predicted_throughput:.4g} steps/s"
    elif placement.point_throughput is not None and math.isclose(placement.point_throughput,
                                                                 placement.predicted_throughput, rel_tol=1e-9):
        # a measured entry has no interval: the figure is the run's own measurement
        predicted = (f"predicted {placement.predicted_throughput:.4g} steps/s (as measured: no margin at the "
                     f"{placement.risk_level:.0%} risk level)")
    else:  # the decision's figure is a bound: say so, beside the point prediction
        point = "n/a" if placement.point_throughput is None else f"{placement.point_throughput:.4g}"
        predicted = (f"predicted {point} steps/s (planned at {placement.predicted_throughput:.4g}, the lower end "
                     f"of its {placement.risk_level:.0%} interval)")
    logger.info("placed %s on %s (%s)%s: %s, required %.4g", job.job_type,
                placement.gpu_id, placement.gpu_type, limit, predicted, job.required_throughput)
    return placement


def _at_risk_level(job: JobSpec, point: Any, risk: float) -> str:
    """What an infeasible requirement's figure was at a risk level: the lower end of the interval,
    not what ``gogh predict`` shows (a review: told the fleet was too slow when the point prediction
    met the requirement)."""
    best = max((point.isolated(job.job_type, g) for g in point.gpu_types if point.has(job.job_type, g)),
               default=0.0)
    said = (f" (at PlacementPolicy(risk_level={risk:g}) that is the lower end of the refiner's {risk:.0%} interval; "
            f"the point prediction is {best:.4g} steps/s")
    if best >= job.required_throughput:
        return said + ": lower risk_level, or set it to None, to place on the point prediction)"
    return said + ", below the requirement too)"


def _stoppable(sleep: Callable[[float], object], stop: threading.Event | None, run_id: str,
               pass_on: Callable[[], object] = lambda: None) -> Callable[[float], object]:
    """``sleep`` that raises :class:`PlacementCancelled` once ``stop`` is set (after waking). A
    wake-up it took (a slot freed) is passed on first, to another waiting run."""
    if stop is None:
        return sleep

    def wait(seconds: float) -> object:
        if not stop.is_set():
            out = sleep(seconds)
            if not stop.is_set():
                return out
            pass_on()
        raise PlacementCancelled(f"run {run_id}'s flow was cancelled while it waited for a GPU; nothing ran")

    return wait


def artifact_key(flow_name: str) -> str:
    """``gogh-placement-<flow>``: Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9]+", "-", flow_name.lower()).strip("-")
    return f"gogh-placement-{slug}"[:100].rstrip("-") if slug else "gogh-placement"


def placement_tags(job: JobSpec, placement: RunPlacement) -> list[str]:
    """What a flow run is tagged with once placed: filter runs in the Prefect UI by where they ran."""
    return [f"gogh.gpu_type:{placement.gpu_type}", f"gogh.gpu:{placement.gpu_id}", f"gogh.job_type:{job.job_type}",
            f"gogh.policy:{placement.policy}"]


def _tag_flow_run(flow_run: Any, tags: list[str]) -> None:
    """Add ``tags`` to the flow run on the Prefect server (a run's tags are otherwise fixed when it is created)."""
    if flow_run is None:
        return
    every = sorted({*(flow_run.tags or ()), *tags})
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, tags=every)
    except Exception as exc:  # noqa: BLE001 - tags are for people filtering runs; the run goes on
        log.warning("gogh: could not tag flow run %s with its placement: %s", flow_run.id, exc)
    # ...and on this process's copy, the one the flow's state hooks are given: a hook routing on the
    # GPU did not see them (a Prefect user's review)
    try:
        flow_run.tags = every
    except Exception as exc:  # noqa: BLE001 - a read-only copy: the server has them
        log.debug("gogh: could not add the placement tags to the local flow run: %s", exc)


def _call_body(fn: Callable, args: tuple, kwargs: dict) -> Any:
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(*args, **kwargs))
    return fn(*args, **kwargs)


def _inside(gpu: Any, cur: CurrentPlacement, fn: Callable, args: tuple, kwargs: dict) -> Any:
    token = _CURRENT.set(cur)
    try:
        if gpu is None:
            return _call_body(fn, args, kwargs)
        with use_gpu(gpu):
            return _call_body(fn, args, kwargs)
    finally:
        _CURRENT.reset(token)


#: Bodies (and their serialised contexts, which hold the flow) handed to thread workers of
#: this process by token: Dask pickles task arguments even for in-process workers, and a
#: closure over a lock cannot be pickled.
_LOCAL_BODIES: dict[str, tuple] = {}


def _execute_local(token: str, placement: RunPlacement, work_steps: int) -> Any:
    """Thread worker of this process: the body and its context come by token, unpickled."""
    fn, args, kwargs, context = _LOCAL_BODIES.pop(token)
    return _execute_body(fn, args, kwargs, context, placement, work_steps)


def _execute_body(fn: Callable, args: tuple, kwargs: dict, context: dict, placement: RunPlacement,
                  work_steps: int) -> Any:
    """Runs on the pinned worker: the user's body inside the flow run's Prefect context.

    One path for every worker, in this process or another: the context is Prefect's own
    ``serialize_context()``, hydrated here, as prefect-dask ships task contexts.
    """
    gpu = current_gpu()
    cur = CurrentPlacement(placement=placement, device=gpu.torch_device if gpu else "cpu",
                           mode=gpu.mode if gpu else "unknown", _gpu=gpu)
    route_prints()
    with hydrated_context(context), bodys_own_dask():
        try:
            result = _inside(gpu, cur, fn, args, kwargs)
            meter = gpu.meter if gpu is not None else None
            if meter is not None and meter.steps == 0:
                # automatic timing: a body that reported nothing did its declared work (one that
                # reported is measured by its own count, never both); on an emulated GPU that work
                # runs now, and a stop asked meanwhile ends it as it ends a body
                if gpu.emulated:
                    gpu.advance(work_steps)
                else:
                    gpu.report(work_steps)
        except RunCancelled:
            if gpu is not None and gpu.stop_reason == PLACER_LOST:
                _mark_crashed_unless_placer_back(
                    gpu,
                    f"the process that placed this run was lost (killed) while its body ran on "
                    f"{placement.gpu_id}; the body was stopped at its next progress report and "
                    "the GPU freed. Its measurement is kept by the pool's ledger until a placing "
                    "process logging to the same tracking store logs it; retry the flow run")
            raise
    return result


#: How long a worker waits for a placing process whose connection dropped to come back before it
#: says in Prefect that the flow run crashed: as long as the placer's Dask client tries to
#: reconnect (its timeout; a blip is usually over in seconds), so a placer that is still
#: reconnecting is never marked crashed under its feet.
PLACER_BACK_GRACE_S = CLIENT_TIMEOUT_S
_PLACER_POLL_S = 0.5


def _mark_crashed_unless_placer_back(gpu: GpuContext, message: str) -> None:
    """Mark the flow run crashed, unless its placing process is connected again within the grace.

    Dask cancels a disconnected client's runs even when it is back within a second, and the
    ledger asks their bodies to stop as if the placer were lost. A placer that came back ends its
    flow run itself (``RunLost``, Failed), and a Crashed mark before that left the run
    Crashed -> Failed, which Prefect does not retry (it retries Running -> Failed only). The
    wait runs beside the worker, which frees the GPU meanwhile; unknown (no lease) marks at once.
    Only a run holding a lease, hence a ledger run id, has ``placer_connected``.
    A mark after the wait is taken only while that attempt still runs (``crash_flow_run``): a placer
    that gave the run up during a long blip may have had Prefect start its next attempt meanwhile.
    """
    placer_connected, run_id = gpu.placer_connected, gpu.run_id
    if placer_connected is None or not run_id:
        _mark_crashed(message)
        return
    context = contextvars.copy_context()  # the flow run's Prefect context, for the mark

    def watch() -> None:
        deadline = time.monotonic() + PLACER_BACK_GRACE_S
        while True:
            if placer_connected():
                log.info("gogh: the placing process is connected again; it ends its flow run itself")
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(_PLACER_POLL_S)
        context.run(crash_flow_run, run_id, message)

    threading.Thread(target=watch, name="gogh-placer-back", daemon=True).start()


def _mark_crashed(message: str) -> None:
    """Nobody is left to end this flow run: say in Prefect that it crashed (from its worker).

    The flow run context names the run and its attempt, which is what ``crash_flow_run`` needs
    to mark only this attempt (never one Prefect started after it). A Prefect runner or worker
    that launched the lost process says the same when it sees the process die; the state
    orchestration keeps whichever comes first.
    """
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    crash_flow_run(f"{ctx.flow_run.id}#{max(ctx.flow_run.run_count, 1)}", message)


def _done_event(future: Any) -> threading.Event:
    """An event set when ``future`` is done: what every bounded wait on a run waits on.

    Not ``Future.result(timeout)``: that call can fail with an UnboundLocalError inside
    distributed when the future is cancelled while it waits (seen when a worker group was
    killed under load, benchmarks/reliability.py).
    """
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def _lease_held(ledger: PoolLedger, run_id: str) -> bool:
    """Whether the ledger still holds ``run_id``'s slot (no: freed, unknown, or no answer)."""
    try:
        return ledger.get(run_id, timeout_s=_CLEANUP_TIMEOUT_S) is not None
    except Exception:  # noqa: BLE001 - unknown counts as not held: the run is lost either way
        return False


#: what the ledger's reason for dropping a run's lease means, in the run's error
_DROPPED = {
    "worker_left": "its worker left the pool (the process died or was stopped, or its machine was lost)",
    "client_left": "this process's connection to the pool's scheduler dropped",
}


def _lost_gpu(ledger: PoolLedger, run_id: str, gpu_id: str) -> str:
    """The error of a run whose lease is gone while its body ran, with why the ledger dropped it."""
    why = ledger.why_dropped(run_id)
    if why == "expired":
        what = (f"its worker stopped answering (the run's lease lapsed, {ledger.lease_timeout_s:g} s without a sign "
                "of life)")
    else:  # a ledger from before it kept reasons says nothing
        what = _DROPPED.get(why or "", "its worker left the pool or stopped answering (its lease is gone)")
    return (f"run {run_id} lost its GPU {gpu_id}: {what}, before the body returned. Its measurement is logged as "
            "failed; retry the flow run (Prefect retries place it again)")


def await_run(ledger: PoolLedger, future: Any, placement: RunPlacement, *, start_within_s: float,
              check_s: float = 1.0, cancelled_in_prefect: Callable[[], bool] | None = None,
              prefect_check_s: float = 5.0, stop: threading.Event | None = None) -> Any:
    """The run's outcome, with every wait bounded.

    Dask waits forever for a worker that died (the task is pinned to it), so the lease is
    checked every ``check_s``: gone means the worker left (or the lease lapsed) and the run
    is lost; not started within ``start_within_s`` means it queued in Dask for too long. A
    scheduler that does not answer is waited for up to :data:`_SILENT_SCHEDULER_S` (or two
    lease timeouts); one whose connection is lost ends the wait at once.
    Every ``prefect_check_s``, ``cancelled_in_prefect()`` (which must not block) is asked too: a cancellation
    reaches this process through its Prefect runner or worker, which can miss it (see
    :class:`PrefectCancellation`), and a body left running would hold its GPU to the end.
    ``stop`` set (an async flow's coroutine was cancelled) ends the wait with ``CancelledError``
    within ``check_s``: the caller's way out then stops the body and keeps what it measured.
    """
    run_id = placement.run_id
    start_by = time.monotonic() + start_within_s
    done = _done_event(future)
    next_prefect_check = time.monotonic() + prefect_check_s
    stop_asked = False
    say_waiting_at = time.monotonic() + _SAY_WAITING_S
    # how long a silent scheduler is waited for before the run is given up as lost
    patience_s = max(silent_scheduler_s(), 2 * ledger.lease_timeout_s)
    silent_since: float | None = None
    said_silent = False

    def outcome() -> Any:
        if future.status == "cancelled":
            # a client cut off from its scheduler cancels every future it holds, workers alive or
            # not; a lease still held says the worker lives: it stops the body and reports it
            if _lease_held(ledger, run_id):
                raise RunLost(f"run {run_id} on {placement.gpu_id} was cancelled by Dask before the body returned: "
                              "this process's connection to the pool's scheduler dropped, and Dask cancels a "
                              "disconnected client's runs. The body is stopped on its worker, whose record of "
                              "what it did is logged as the run's measurement (failed); retry the flow run",
                              worker_reports=True)
            why = ("its worker was lost" if future.client.status == "running"
                   else "the connection to the pool's scheduler was lost")
            raise RunLost(f"run {run_id} on {placement.gpu_id} was cancelled by Dask ({why}) "
                          "before the body returned; its measurement is logged as failed")
        return future.result()  # done: returns the outcome, or raises what the pool raised

    while True:
        if done.wait(check_s):
            return outcome()
        if stop is not None and stop.is_set() and not done.is_set():
            raise asyncio.CancelledError(f"run {run_id}'s flow was cancelled while its body ran on {placement.gpu_id}")
        try:
            # bounded: a scheduler that hangs must not hang the run (nor can it keep the lease)
            lease = ledger.get(run_id, timeout_s=ledger.lease_timeout_s)
        except (SchedulerUnreachable, TimeoutError) as exc:
            if done.is_set():
                return outcome()
            now = time.monotonic()
            if silent_since is None:
                silent_since = now - ledger.lease_timeout_s
            if isinstance(exc, TimeoutError) and now - silent_since < patience_s:
                # a silent scheduler (stopped, its event loop blocked) is not a lost run: the body
                # runs on its worker and its outcome comes through Dask once the scheduler answers,
                # and the ledger keeps its lease through its own stall. Given up at once, the run
                # failed with none of the steps its body did measured
                if not said_silent:
                    said_silent = True
                    log.warning("gogh: the pool's scheduler has not answered for %.0f s; run %s on %s waits for "
                                "it (up to %.0f s) while its body runs on", now - silent_since, run_id,
                                placement.gpu_id, patience_s)
                continue
            out_of_touch = f"run {run_id} on {placement.gpu_id} lost touch with its pool before the body returned"
            if isinstance(exc, SchedulerUnreachable):
                raise RunLost(f"{out_of_touch}: {exc}. Its measurement is logged as failed; retry the flow run once "
                              "the scheduler answers") from exc
            raise RunLost(f"{out_of_touch}: the pool's scheduler did not answer for {now - silent_since:.0f} s "
                          f"(waited up to {patience_s:.0f} s, ${SILENT_SCHEDULER_ENV}). It is logged as failed with "
                          "nothing measured for now; once the scheduler answers, the body is stopped and its worker's "
                          "record of what it did replaces that. Retry the flow run once the scheduler answers",
                          scheduler_silent=True) from exc
        if silent_since is not None:
            start_by += time.monotonic() - silent_since  # time the scheduler took does not count against the start
            if said_silent:  # at the warning's level: said where the warning was (a review saw only the warning)
                log.warning("gogh: the pool's scheduler answers again after %.0f s; run %s goes on",
                            time.monotonic() - silent_since, run_id)
            silent_since, said_silent = None, False
        if lease is None:
            # the body may have just ended (the worker frees the lease first): a moment's grace
            if done.wait(max(check_s, 2.0)):
                return outcome()
            raise RunLost(_lost_gpu(ledger, run_id, placement.gpu_id))
        if lease.started_at is not None:
            # its worker keeps the lease now: refreshed from here too, the lease of a hung worker
            # (stopped, its event loop blocked) lived on until Dask's worker-ttl removed it
            ledger.hand_over(run_id)
        if cancelled_in_prefect is not None and not stop_asked and time.monotonic() >= next_prefect_check:
            next_prefect_check = time.monotonic() + prefect_check_s
            if cancelled_in_prefect():
                # the body stops at its next report and its worker frees the slot; its outcome
                # (RunCancelled, with the steps done) comes back through the future as usual
                stop_asked = True
                log.warning("gogh: run %s was cancelled in Prefect without its process being told; asking its "
                            "body on %s to stop", run_id, placement.gpu_id)
                _quietly(ledger.cancel, run_id, "its flow run was cancelled in Prefect",
                         timeout_s=_CLEANUP_TIMEOUT_S)
        if lease.started_at is None and time.monotonic() > say_waiting_at:
            # not silent: a fresh worker builds a zoo model's features before its first run of the type
            say_waiting_at = math.inf
            log.info("gogh: run %s is placed on %s and waits for its worker to start it (a worker's first run of "
                     "a job type builds the model's layer features first, about 10 s)", run_id, placement.gpu_id)
        if lease.started_at is None and time.monotonic() > start_by:
            raise PlacementTimeout(
                f"run {run_id} was placed on {placement.gpu_id} but its body did not start within "
                f"{start_within_s:g} s (queued in Dask behind runs the ledger does not know of); "
                "raise wait_timeout_s, or check the worker's slot resource")


#: the host names of this machine: a pool or server there is reachable only from here
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _workers_prefect_url(pool_address: str, flow_run: Any) -> str | None:
    """The Prefect API a body on this pool's workers must be told to report to, or None.

    A body on another process's worker reports to the flow run's Prefect server through the
    settings shipped with its context. With no ``PREFECT_API_URL`` this process talks to a
    temporary server of its own, and those settings name none: each worker then quietly started a
    temporary server of its own, the run's logs went there and were lost, and the start-up (about
    10 s) was timed as the body's first steps, so the measurement that trains the refiner was
    wrong. Workers on this machine (a scheduler on loopback: a local-cuda pool) are given this
    process's temporary server, which they can reach; workers elsewhere cannot reach it, and the
    run is refused before anything is placed.
    """
    from urllib.parse import urlparse

    from prefect.settings import PREFECT_API_URL

    if flow_run is None or pool_address.startswith("inproc://"):
        return None
    configured = PREFECT_API_URL.value()
    if configured:
        _say_if_loopback_for_elsewhere(str(configured), pool_address)
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # this process's temporary server (one per process)
    if server.running and urlparse(pool_address).hostname in _LOOPBACK:
        return server.api_url
    raise RuntimeError(
        f"this flow run's GPU pool ({pool_address}) runs bodies in processes on other machines, which report "
        "to the flow run's Prefect server, but PREFECT_API_URL is not set: this process uses a temporary "
        "Prefect server that they cannot reach. Start a server (`prefect server start`) and set "
        "PREFECT_API_URL to it here, at an address the workers' machines can reach (docs/user-guide.md, remote pools)")


#: (Prefect API, pool) pairs already warned about
_LOOPBACK_SAID: set[tuple[str, str]] = set()


def _say_if_loopback_for_elsewhere(api_url: str, pool_address: str) -> None:
    """Warn when a loopback ``PREFECT_API_URL`` is sent to workers on other machines.

    The bodies report to the Prefect server this process names (its settings go with each run;
    the workers' own ``PREFECT_API_URL`` is not read), and on another machine 127.0.0.1 is that
    machine (an ssh tunnel here, a review noticed): their logs and states would go nowhere.
    Warned, not refused: each worker machine may forward the same port."""
    from urllib.parse import urlparse

    if urlparse(api_url).hostname not in _LOOPBACK or urlparse(pool_address).hostname in _LOOPBACK:
        return
    if (api_url, pool_address) in _LOOPBACK_SAID:
        return
    _LOOPBACK_SAID.add((api_url, pool_address))
    log.warning("gogh: PREFECT_API_URL here is %s, a loopback address, and it is sent with each run to the pool's "
                "workers at %s, where 127.0.0.1 is their own machine: unless each of them forwards that port to your "
                "Prefect server, set PREFECT_API_URL to an address the workers can reach", api_url, pool_address)


def _context_for_workers(api_url: str | None) -> dict:
    """Prefect's serialised context, naming ``api_url`` (see :func:`_workers_prefect_url`) if given."""
    if api_url is None:
        return serialize_context()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        return serialize_context()


def _runs_this(ctx: FlowRunContext, fn: Callable) -> bool:
    """Whether the flow run of ``ctx`` is a run of the placed flow whose body is ``fn``."""
    return getattr(getattr(ctx.flow, "fn", None), "__wrapped__", None) is fn


def run_placed(fn: Callable, job: JobSpec, settings: _Settings, args: tuple, kwargs: dict,
               stop: threading.Event | None = None) -> Any:
    if stop is not None and stop.is_set():  # cancelled before this thread began: nothing to undo
        raise PlacementCancelled("the flow was cancelled before its run was placed; nothing ran")
    ctx = FlowRunContext.get()
    # `.fn()` called inside another flow run or a task of one: the context is the caller's. Taken
    # for this run's, each call had the caller's run id, so a second call was refused by the table
    # as the first one logged again (its measurement lost) and calls at once shared one slot
    own = ctx is not None and _runs_this(ctx, fn)
    caller = ctx.flow_run if ctx is not None and not own else None  # cancelling it stops this body too
    if not own:
        ctx = None
    flow_run = ctx.flow_run if ctx else None
    run_id = str(flow_run.id) if flow_run else f"local-{uuid.uuid4().hex[:12]}"
    attempt = getattr(flow_run, "run_count", 1) if flow_run else 1
    cluster = load_block(GpuCluster, settings.cluster, GpuCluster())
    registry = load_block(PredictorRegistry, settings.registry, PredictorRegistry())
    policy = load_block(PlacementPolicy, settings.policy, PlacementPolicy())
    _check_efficiency_wait(policy, settings.wait_timeout_s)
    silent_scheduler_s()  # a bad $GOGH_SILENT_SCHEDULER_S is said before anything is placed
    session = shared_session(cluster, registry.resolved_tracking_uri())
    workers_api = _workers_prefect_url(session.pool.address, flow_run or caller)
    # a job type the truth lacks runs from its layer features (the worker's _learn_job)
    unknown = session.truth is None or not session.truth.knows(job.job_type)
    if session.truth is not None and unknown and job.features is None:
        raise ValueError(
            f"the emulated fleet runs at the throughputs of its truth table ({session.truth.source}), which "
            f"has no entry for {job.job_type!r}; emulated fleets run the job types of that table, e.g. "
            f"{', '.join(list(session.truth.job_types)[:6])} ...")
    session.features.put(job.job_type, job.features)
    # one run key for the ledger, the pool and the measurement: the flow run (and its attempt)
    ledger_id = run_id if attempt <= 1 else f"{run_id}#{attempt}"
    # quote(): Prefect must not walk these objects looking for futures (a pool, layer lists)
    ledger = session.pool.ledger
    wait_s = _wait_timeout(settings, policy)
    flow_name = ctx.flow.name if ctx else fn.__name__
    if ctx is not None:
        refuse_dask_task_runner(ctx.flow)  # set after decorating, through with_options
    try:
        placement = place_run(quote(job), ledger_id, quote(session), quote(registry), quote(policy), wait_s,
                              flow_name, quote(stop))
    except BaseException:
        # the claim may have been made before the task failed to report to Prefect (an API
        # error, an interrupt): free it, or this process would keep refreshing it for good
        _quietly(ledger.release, ledger_id, if_unstarted=True, timeout_s=_CLEANUP_TIMEOUT_S)
        raise
    started = time.time()
    _tag_flow_run(flow_run, placement_tags(job, placement))
    outcome, error, future = None, None, None
    in_process = session.pool.address.startswith("inproc://")  # thread workers of this process
    token = ""
    cancellation = PrefectCancellation.for_run(flow_run or caller)
    # this process ends the run itself: a delivery of its worker's record (after a dropped
    # connection) logs it but does not mark the flow run Crashed
    with handling(ledger_id):
        try:
            session.begin_measuring(job.job_type, placement.gpu_type)  # ended below, with the record
            if stop is not None and stop.is_set():  # cancelled as it was placed: nothing starts
                raise PlacementCancelled(f"run {ledger_id}'s flow was cancelled as it was placed on "
                                         f"{placement.gpu_id}; nothing ran")
            where = {"gpu_id": placement.gpu_id, "job_type": job.job_type, "run_id": ledger_id, "hold_lease": True,
                     "warmup_steps": settings.warmup_steps, "power_limit_w": placement.power_limit_w,
                     "required_throughput": placement.required_throughput,
                     # a job type the emulated fleet's truth may lack (a user's own model, a zoo model
                     # for inference): the worker computes its figures from these
                     "features": job.features if (job.family is None or unknown) else None}
            if in_process:
                token = uuid.uuid4().hex
                _LOCAL_BODIES[token] = (fn, args, kwargs, serialize_context())
                future = session.pool.submit(_execute_local, token, placement, job.work_steps, **where)
            else:
                # a shared pool outlives this process: if it is lost, the worker hands in the measurement
                lost = functools.partial(record_if_placer_lost, job, placement, started, flow_run, flow_name,
                                         session.pool.device(placement.gpu_id).where, session.measurements.store)
                context = _context_for_workers(workers_api)
                future = session.pool.submit(_execute_body, fn, args, kwargs, context, placement,
                                             job.work_steps, record_if_placer_lost=lost, **where)
            left = max(0.0, wait_s - placement.waited_s)
            outcome = await_run(ledger, future, placement, start_within_s=left + _START_GRACE_S,
                                cancelled_in_prefect=cancellation, stop=stop)
        except BaseException as exc:  # the pool failed, the worker left, or this process is interrupted
            error = exc
            raise
        finally:
            if in_process:
                _LOCAL_BODIES.pop(token, None)
            if outcome is None:
                # abandoned before the body returned (the flow run was cancelled, this process is
                # interrupted, the worker left): ask the body to stop at its next progress report
                # and keep what it measured up to there. The slot is freed now only if the body
                # never started; a running body keeps it until it has really stopped, then its
                # worker frees it.
                gave_up = isinstance(error, RunLost) and error.scheduler_silent
                reason = PLACER_GAVE_UP if gave_up else f"its flow run was stopped ({type(error).__name__})"
                asked = _quietly(ledger.cancel, ledger_id, reason, timeout_s=_CLEANUP_TIMEOUT_S)
                if not asked and gave_up:
                    _keep_asking_to_stop(ledger, ledger_id, reason)
                if future is not None:
                    # a scheduler still silent cannot say whether the body stopped: not waited on again
                    outcome = _stopped_outcome(ledger, ledger_id, future) if asked or not gave_up else None
                    if outcome is None:
                        future.cancel()
            _quietly(ledger.release, ledger_id, if_unstarted=True, timeout_s=_CLEANUP_TIMEOUT_S)
            # wake a waiting run now, not after the record (with many runs in flight, waiting on each
            # record's MLflow write stalled the queue: 80 s against 19 s for 40 runs); the run's
            # (job type, GPU type) stays marked until its record is in, so no trial is decided blind
            session.notify_released()
            try:
                if isinstance(error, RunLost) and error.worker_reports and not in_process:
                    # the worker's record has the steps the body did; this process's would have none
                    take_workers_record(ledger, session.measurements, f"{ledger_id}:{placement.gpu_id}",
                                        wait_s=ledger.lease_timeout_s / 4 + 5.0)
                if not (isinstance(error, PlacementCancelled) and future is None):  # nothing ran: nothing to log
                    recorded = record_run(session, job, placement, outcome, error, started=started,
                                          flow_run=flow_run, flow_name=flow_name)
                    if recorded and outcome is not None and not in_process:
                        # logged from the worker's own outcome: the copy its worker left with the ledger
                        # (in case this process died before its record was in) can go. Unsaid (the
                        # ledger's answer lost, or this run given up), the copy is handed out after a
                        # minute, and logged again by its key, which changes nothing or supersedes a
                        # record of a run given up
                        try:
                            ledger.logged([ledger_id], timeout_s=2.0)
                        except Exception as exc:  # noqa: BLE001 - see above
                            log.debug("gogh: could not tell the ledger run %s is logged: %s", ledger_id, exc)
            finally:
                session.end_measuring(job.job_type, placement.gpu_type)
            if cancellation is not None and cancellation.seen:
                cancellation.finish(f"gogh: cancelled; its body was stopped on {placement.gpu_id} and its GPU freed")
    return outcome.unwrap()


#: extra time a placed body may take to start in Dask beyond the run's remaining wait
_START_GRACE_S = 10.0
#: a placed body not started after this long is said to be waiting for its worker (once)
_SAY_WAITING_S = 3.0
#: a run whose pool's scheduler is silent this long (or two lease timeouts, if longer) is lost
_SILENT_SCHEDULER_S = 60.0
SILENT_SCHEDULER_ENV = "GOGH_SILENT_SCHEDULER_S"
#: how long a run given up on a silent scheduler keeps asking it to stop the body, in the background
_GAVE_UP_ASK_S = 600.0


def silent_scheduler_s() -> float:
    """How long a run waits for a silent scheduler: ``$GOGH_SILENT_SCHEDULER_S``, else 60 s."""
    from gogh_flows.runtime.settings import seconds

    return seconds(SILENT_SCHEDULER_ENV, _SILENT_SCHEDULER_S, "how long a run waits for a pool's scheduler that "
                   "does not answer")


def _keep_asking_to_stop(ledger: PoolLedger, run_id: str, reason: str) -> threading.Thread:
    """Ask again in the background until the scheduler answers (at most :data:`_GAVE_UP_ASK_S`).

    A run given up on a silent scheduler has a body that may run on: stopped by ``reason``
    (:data:`PLACER_GAVE_UP`), its worker hands in what it measured, which replaces the failed
    record this process logs now (``tracking.table``: a provisional row). If this process exits
    first, its Dask client leaves and the ledger asks the same of the body (a lost placer).
    """
    def ask() -> None:
        deadline = time.monotonic() + _GAVE_UP_ASK_S
        while time.monotonic() < deadline:
            try:
                ledger.cancel(run_id, reason, timeout_s=ledger.lease_timeout_s)
                log.warning("gogh: the pool's scheduler answers again; run %s's body, given up on, is asked to stop "
                            "and hand in its measurement", run_id)
                return
            except SchedulerUnreachable:
                return  # the connection is gone: the ledger treats the body as a lost placer's
            except Exception:  # noqa: BLE001 - silent still (or a transient error): ask again
                time.sleep(min(5.0, ledger.lease_timeout_s))
        log.warning("gogh: the pool's scheduler did not answer for %.0f s after run %s was given up; its body "
                    "was not asked to stop from here", _GAVE_UP_ASK_S, run_id)

    thread = threading.Thread(target=ask, name=f"gogh-stop-{run_id}", daemon=True)
    thread.start()
    return thread


#: how long a run's way out waits for the pool's scheduler (a hung one must not hang the run;
#: what it did not hear of lapses there on its own)
_CLEANUP_TIMEOUT_S = 10.0


def _stopped_outcome(ledger: PoolLedger, run_id: str, future: Any) -> Any:
    """The outcome of a body asked to stop, if it stops in time; ``None`` if it never started,
    its worker is gone, or it does not stop within a refresh of its lease (plus a grace)."""
    try:
        if future.done() and future.status == "finished":  # it ended as it was being stopped
            return future.result()
        lease = ledger.get(run_id, timeout_s=_CLEANUP_TIMEOUT_S)
        if lease is None or lease.started_at is None:
            return None
        if not _done_event(future).wait(ledger.lease_timeout_s / 4 + 5.0) or future.status != "finished":
            return None
        return future.result()
    except Exception:  # noqa: BLE001 - the run failed already; the reason stands as it is
        return None


def _check_efficiency_wait(policy: PlacementPolicy, wait_timeout_s: float | None) -> None:
    """The policy's wait for an efficient GPU ends before the decorator's ``wait_timeout_s``."""
    waits = policy.wait_for_efficiency_s
    if wait_timeout_s is not None and waits > 0 and waits >= wait_timeout_s:
        raise ValueError(
            f"the policy's wait_for_efficiency_s ({waits:g} s) must be below the decorator's wait_timeout_s "
            f"({wait_timeout_s:g} s), which overrides the policy's: a run that may wait for an efficient GPU "
            "must still have time to take a free one; raise wait_timeout_s or lower the wait")


def _wait_timeout(settings: _Settings, policy: PlacementPolicy) -> float:
    """How long a run may wait for a GPU: the decorator's ``wait_timeout_s``, else the policy's."""
    return settings.wait_timeout_s if settings.wait_timeout_s is not None else policy.wait_timeout_s


def _quietly(call: Callable, *args: Any, **kwargs: Any) -> bool:
    """Whether ``call`` went through; a failure is said, never raised."""
    try:
        call(*args, **kwargs)
        return True
    except Exception as exc:  # noqa: BLE001 - the scheduler is away
        name = getattr(call, "__name__", call)
        after = ("it is sent again in the background until the scheduler answers, and the lease lapses there if "
                 "this process goes first" if name == "release" else "the lease lapses on its own")
        log.warning("gogh: %s failed (%s): %s", name, after, exc)
        return False


__all__ = ["PlacedFlow", "artifact_key", "gogh_placed", "place_run", "placement_tags", "run_placed"]
