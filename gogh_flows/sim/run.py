"""Run several policies on one identical job stream and compare them.

Every policy sees the same jobs, the same fleet, the same truth and the same
seed, in one process, so differences between them are the policies' alone.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gogh_flows.catalog import get_gpu_type
from gogh_flows.energy import EnergyModel
from gogh_flows.placement import POLICIES, GoghOptimizer, Gpu, get_policy
from gogh_flows.placement.baselines import CappedGreedyFastest
from gogh_flows.placement.patience import Patience
from gogh_flows.placement.problem import TableThroughputs, Throughputs
from gogh_flows.sim.engine import SimConfig, SimJob, SimResult, simulate
from gogh_flows.sim.gavel import GAVEL_POLICIES, make_gavel_policy
from gogh_flows.sim.hadar import HADAR_POLICIES, make_hadar_policy
from gogh_flows.sim.rounds import RoundConfig, simulate_rounds
from gogh_flows.sim.traces import assign_requirements
from gogh_flows.truth.table import ThroughputTable

#: Policies the simulator knows: ``oracle`` is the optimiser planning with the
#: true throughputs (the reference); the others are the placement baselines.
SIM_POLICIES = ("oracle", "greedy-fastest", "greedy-min-power", "greedy-efficiency", "first-fit",
                "first-fit-interleaved", "random")
#: ``greedy-fastest+cap``: greedy-fastest with every board at ``CAP_FRACTION`` of its type's limit
#: range, lifted to the lowest level that meets a job's requirement when it measures short: the
#: simple baseline for ``+limits``, named with them (not in the default list, whose runs it would
#: change: a capped fleet finishes later and lengthens every policy's common window)
CAP_POLICIES = ("greedy-fastest+cap",)
#: chosen by ``benchmarks/static_cap.py`` on seeds no report uses: 0, each type's lowest limit,
#: on three of its four scenarios (0.125 on the modern mixed fleet); one fraction for every fleet here
CAP_FRACTION = 0.0
#: The learned policies (they need predictors, see ``sim.holdout``): ``gogh`` plans with P1
#: refined online by P2 from every monitoring observation; ``gogh-p1`` with P1 alone.
LEARNED_POLICIES = ("gogh", "gogh-p1")
#: Modifiers of an optimiser policy (``oracle``, ``gogh``, ``gogh-p1``), in this order:
#: ``+limits`` chooses each GPU's power limit too, from these fractions of the type's range
#: (docs/energy.md); ``+fleet`` re-solves the running jobs together every ``FLEET_REOPT_S``
#: seconds and when GPUs free up (placement.reoptimize); ``+wait`` holds a new job up to
#: ``WAIT_S`` for a GPU type that runs it for ``WAIT_SAVING`` less energy (placement.patience).
LIMITS_SUFFIX, FLEET_SUFFIX, WAIT_SUFFIX = "+limits", "+fleet", "+wait"
OPTIMIZER_POLICIES = ("oracle", *LEARNED_POLICIES)
LIMIT_POLICIES = tuple(f"{p}{LIMITS_SUFFIX}" for p in OPTIMIZER_POLICIES)
FLEET_POLICIES = tuple(f"{p}{m}{FLEET_SUFFIX}" for p in OPTIMIZER_POLICIES for m in ("", LIMITS_SUFFIX))
WAIT_POLICIES = tuple(f"{p}{WAIT_SUFFIX}" for p in (*OPTIMIZER_POLICIES, *LIMIT_POLICIES, *FLEET_POLICIES))
#: the limit levels of the ``+limits`` policies (fractions of each type's range; the maximum is
#: always offered): 16 steps of 0.0625, chosen over 4 and 8 by ``benchmarks/limit_levels.py`` on seeds no
#: report uses (tests/test_docs.py checks it)
DEFAULT_LIMIT_LEVELS = tuple(i / 16 for i in range(16))
FLEET_REOPT_S = 1800.0
#: the patience chosen by ``benchmarks/wait_tradeoff.py`` on seeds no report uses (the least
#: always-on energy of 0-48 h over (b), (d), (f) and (f, noise); tests/test_docs.py checks it);
#: 10% saved, fixed before that choice
WAIT_S, WAIT_SAVING = 48 * 3600.0, 0.1
#: The peers (issue: the peers, side by side), run in rounds with time slicing
#: (``sim.rounds``); each reconstructs a published system, see its module.
PEER_POLICIES = GAVEL_POLICIES + HADAR_POLICIES + ("rltune",)
ALL_POLICIES = SIM_POLICIES + CAP_POLICIES + LEARNED_POLICIES + LIMIT_POLICIES + FLEET_POLICIES + WAIT_POLICIES + PEER_POLICIES


def base_policy(name: str) -> str:
    """The policy a modified name builds on: ``gogh+limits+fleet+wait`` -> ``gogh``."""
    return name.removesuffix(WAIT_SUFFIX).removesuffix(FLEET_SUFFIX).removesuffix(LIMITS_SUFFIX)


def parse_cluster(spec: str, capacity: int = 2) -> list[Gpu]:
    """``"v100=8,p100=16,k80=24"`` -> 48 GPUs with ids ``v100-0`` ... ``k80-23``."""
    gpus: list[Gpu] = []
    seen: set[str] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"([A-Za-z0-9_]+)\s*=\s*(\d+)", part)
        if not m or int(m.group(2)) < 1:
            raise ValueError(
                f"bad cluster entry {part!r} in {spec!r}: write TYPE=COUNT with COUNT >= 1, "
                "e.g. v100=8,p100=16,k80=24"
            )
        name = get_gpu_type(m.group(1)).name  # unknown type -> error naming it
        if name in seen:
            raise ValueError(f"GPU type {name!r} appears twice in cluster {spec!r}")
        seen.add(name)
        gpus += [Gpu(f"{name}-{i}", name, capacity) for i in range(int(m.group(2)))]
    if not gpus:
        raise ValueError(f"cluster {spec!r} declares no GPUs; e.g. v100=8,p100=16,k80=24")
    return gpus


def best_isolated(truth: ThroughputTable, gpus: Sequence[Gpu]) -> Callable[[str, int], float]:
    """Best isolated throughput of (job type, GPU count) on the GPU types of this fleet.

    A type counts only when the fleet has at least that many GPUs of it, so a
    requirement derived from it (DESIGN §6) can be met somewhere in this fleet.
    """
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.gpu_type] = counts.get(g.gpu_type, 0) + 1

    def best(job_type: str, num_gpus: int) -> float:
        return max((truth.isolated(job_type, t, num_gpus) for t, n in counts.items()
                    if n >= num_gpus and truth.has(job_type, t, num_gpus)), default=0.0)

    return best


def reference_throughput(truth: ThroughputTable, gpu_type: str) -> Callable[[str, int], float]:
    """Isolated steps/s of (job type, GPU count) on one type: how Gavel sizes a job's work."""

    def tput(job_type: str, num_gpus: int) -> float:
        has = truth.has(job_type, gpu_type, num_gpus)
        return truth.isolated(job_type, gpu_type, num_gpus) if has else 0.0

    return tput


def prepare_jobs(jobs: Sequence, truth: ThroughputTable, gpus: Sequence[Gpu], *, seed: int,
                 q_low: float = 0.2, q_high: float = 0.9) -> list:
    """Jobs with requirements for this fleet (DESIGN §6).

    A job that no GPU type of the fleet can run at its GPU count (too few GPUs
    of a type that can, or no throughput entry) could never start: it is
    dropped with a warning that counts it, never silently.
    """
    best = best_isolated(truth, gpus)
    keep = [j for j in jobs if best(j.job_type, j.num_gpus) > 0]
    if len(keep) < len(jobs):
        warnings.warn(f"dropped {len(jobs) - len(keep)} of {len(jobs)} jobs that no GPU type of "
                      "the cluster can run at their GPU count (too few GPUs of a type that "
                      "can, or no throughput entry)", stacklevel=2)
    return assign_requirements(keep, best, seed=seed, q_low=q_low, q_high=q_high)


@dataclass(frozen=True)
class SimPolicy:
    name: str
    policy: object
    planning: Throughputs
    reoptimize_s: float = 0.0  # fleet-level re-optimisation period (0: per arrival only)
    patience: Patience | None = None  # new jobs may wait for an efficient GPU (``+wait``)
    rounds: bool = False  # a round-based allocator (sim.rounds) rather than a placement policy


def make_peer(name: str, seed: int = 0, rltune_model=None):
    """A fresh round-based allocator for the peer called ``name`` (see ``PEER_POLICIES``);
    ``rltune_model``: the ``rltune`` agent's directory (default: the shipped one)."""
    if name in HADAR_POLICIES:
        return make_hadar_policy(name)
    if name == "rltune":  # the shipped agent (models/rltune), trained by `gogh rltune train`
        from gogh_flows.sim.rltune import make_rltune

        return make_rltune(rltune_model)
    if name in GAVEL_POLICIES:
        return make_gavel_policy(name, seed)
    raise ValueError(f"unknown peer policy {name!r}; choose from: {', '.join(PEER_POLICIES)}")


def make_policy(name: str, truth: ThroughputTable, seed: int = 0,
                time_limit_s: float = 2.0, predictors=None, gpu_types=None,
                risk_level: float | None = None, rltune_model=None, patience: Patience | None = None,
                limit_levels: Sequence[float] | None = None, gpu_counts: Mapping[str, int] | None = None,
                ) -> SimPolicy:
    """``predictors`` (a ``sim.learned.Predictors``, or ``sim.unseen.UnseenFamilies`` to plan every
    job with predictors trained without its family) is needed by the learned policies only;
    ``patience``, by the ``+wait`` policies (default ``WAIT_S``, ``WAIT_SAVING``);
    ``limit_levels``, by the ``+limits`` policies (default ``DEFAULT_LIMIT_LEVELS``);
    ``gpu_counts`` (the fleet's GPUs per type), by the learned policies' feasibility floor.

    A learned policy gets a fresh planning view for every simulation: what it learned
    from one run's observations never leaks into another.
    """
    if name in WAIT_POLICIES:
        inner = make_policy(name.removesuffix(WAIT_SUFFIX), truth, seed, time_limit_s, predictors, gpu_types,
                            risk_level, limit_levels=limit_levels, gpu_counts=gpu_counts)
        return dataclasses.replace(inner, name=name, policy=dataclasses.replace(inner.policy, name=name),
                                   patience=patience or Patience(WAIT_S, WAIT_SAVING))
    if name in FLEET_POLICIES:
        inner = make_policy(name.removesuffix(FLEET_SUFFIX), truth, seed, time_limit_s, predictors, gpu_types,
                            risk_level, limit_levels=limit_levels, gpu_counts=gpu_counts)
        return SimPolicy(name, dataclasses.replace(inner.policy, name=name), inner.planning, FLEET_REOPT_S)
    if name in LIMIT_POLICIES:
        base = make_policy(name[: -len(LIMITS_SUFFIX)], truth, seed, time_limit_s, predictors, gpu_types,
                           risk_level, gpu_counts=gpu_counts)
        return SimPolicy(name, dataclasses.replace(base.policy, name=name,
                                                   power_limit_levels=tuple(DEFAULT_LIMIT_LEVELS if limit_levels is None
                                                                            else limit_levels)), base.planning)
    if name in LEARNED_POLICIES:
        if predictors is None:
            raise ValueError(f"policy {name!r} needs trained predictors: pass --predictors DIR "
                             "or --holdout-family F (gogh simulate), or predictors=... here")
        from gogh_flows.sim.unseen import planning_view

        types = list(gpu_types) if gpu_types is not None else list(truth.gpu_types)
        refine = name == "gogh"
        # the intervals are calibrated on the refiner's (the ensemble's) errors; P1 alone errs far
        # more, so for gogh-p1 they would not be intervals at any level: it plans with its points
        return SimPolicy(name, GoghOptimizer(time_limit_s=time_limit_s, name=name),
                         planning_view(predictors, types, refine=refine, risk_level=risk_level if refine else None,
                                       gpu_counts=gpu_counts))
    if name in PEER_POLICIES:
        return SimPolicy(name, make_peer(name, seed, rltune_model), TableThroughputs(truth), rounds=True)
    if name == "oracle":
        return SimPolicy(name, GoghOptimizer(time_limit_s=time_limit_s, name="oracle"),
                         TableThroughputs(truth))
    if name == "greedy-fastest+cap":
        levels = tuple(DEFAULT_LIMIT_LEVELS if limit_levels is None else limit_levels)
        return SimPolicy(name, CappedGreedyFastest(cap_fraction=CAP_FRACTION, power_limit_levels=levels),
                         TableThroughputs(truth))
    if name in POLICIES and name != "optimizer":
        policy = get_policy(name, seed=seed) if name == "random" else get_policy(name)
        return SimPolicy(name, policy, TableThroughputs(truth))
    mods = [m for m in (LIMITS_SUFFIX, FLEET_SUFFIX, WAIT_SUFFIX) if m in name]
    hint = (f" (the modifiers {', '.join(mods)} apply to {', '.join(OPTIMIZER_POLICIES)} only, in the order "
            f"{LIMITS_SUFFIX}{FLEET_SUFFIX}{WAIT_SUFFIX}, e.g. oracle+limits+fleet+wait)" if mods else "")
    raise ValueError(f"unknown simulation policy {name!r}{hint}; choose from: {', '.join(ALL_POLICIES)}")


def round_config(config: SimConfig) -> RoundConfig:
    """The round-based engine's settings that a ``SimConfig`` carries (Gavel's round and reset)."""
    return RoundConfig(seed=config.seed, noise=config.noise, park_idle=config.park_idle,
                       horizon_s=config.horizon_s)


def run_policies(
    jobs: Sequence[SimJob],
    gpus: Sequence[Gpu],
    truth: ThroughputTable,
    names: Sequence[str],
    *,
    config: SimConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    predictors=None,
    risk_level: float | None = None,
    rltune_model=None,
    patience: Patience | None = None,
    limit_levels: Sequence[float] | None = None,
    energy: EnergyModel | None = None,
) -> dict[str, SimResult]:
    """Simulate each named policy on the identical stream; results keyed by policy name.

    ``predictors`` (``sim.learned.Predictors``) serve the learned policies (``gogh``,
    ``gogh-p1``); each of their runs starts from the predictors alone. ``risk_level``: ``gogh``
    plans with the lower end of the refiner's interval at that level (``gogh-p1`` with P1's points).
    ``patience``: how long the ``+wait`` policies let a new job wait, for what saving;
    ``limit_levels``: the levels the ``+limits`` policies choose among (default ``DEFAULT_LIMIT_LEVELS``);
    ``energy``: the energy model the policies decide with (``simulate``'s; the boards' draw is the
    same whatever its idle accounting).
    """
    if not names:
        raise ValueError(f"name at least one policy: {', '.join(ALL_POLICIES)}")
    config = config or SimConfig()
    types = sorted({g.gpu_type for g in gpus})
    counts = Counter(g.gpu_type for g in gpus)
    policies = [make_policy(n, truth, config.seed, predictors=predictors, gpu_types=types, risk_level=risk_level,
                            rltune_model=rltune_model, patience=patience, limit_levels=limit_levels,
                            gpu_counts=counts)
                for n in names]  # validate all first
    out: dict[str, SimResult] = {}
    for p in policies:
        cb = (lambda done, total, name=p.name: progress(name, done, total)) if progress else None
        if p.rounds:
            out[p.name] = simulate_rounds(jobs, gpus, truth, p.policy, config=round_config(config),
                                          progress=cb)
        else:
            out[p.name] = simulate(jobs, gpus, truth, p.policy, planning=p.planning, config=config,
                                   progress=cb, reoptimize_s=p.reoptimize_s, patience=p.patience, energy=energy)
    return out


__all__ = ["PEER_POLICIES", "make_peer", "round_config", "ALL_POLICIES", "CAP_FRACTION", "CAP_POLICIES", "DEFAULT_LIMIT_LEVELS", "FLEET_POLICIES", "FLEET_REOPT_S", "LEARNED_POLICIES", "WAIT_POLICIES", "WAIT_S", "WAIT_SAVING",
           "LIMIT_POLICIES", "base_policy", "SIM_POLICIES", "SimPolicy", "best_isolated", "prepare_jobs", "reference_throughput", "make_policy", "parse_cluster", "run_policies"]
