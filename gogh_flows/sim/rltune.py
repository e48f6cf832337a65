"""An RLTune-style allocator for ``sim.rounds``: a RECONSTRUCTION of RLTune, not RLTune.

RLTune (SoCC'25; public code dshruti20/RLTune, read to understand, nothing copied) orders
a heterogeneous cluster's queue with a PPO agent and places the chosen job with a MILP
over node assignments. What is kept, from its description:

* **State**: the first ``QUEUE`` (128) waiting jobs, sorted by a baseline priority (here
  first come, first served), 7 features each: wait (capped at 12 h, normalised), GPUs
  requested, demand over supply in the job's pool, GPUs of the pool freeing within the
  next 600 s, the pool's fragmentation, the number of GPU types the job fits on now, and
  whether it can start now.
* **Action**: which of those jobs starts next, or the padding index: wait, until the next
  arrival or completion or 600 s at most, when the agent decides again.
* **Reward**: sparse, at the end of a 256-job sequence: ``(baseline - agent) /
  max(baseline, agent, 1)`` of the total bounded slowdown ``max(1, (wait + run) /
  max(run, 10))``, the baseline being FCFS with the same placement on the same sequence.
* **Placement**: among the GPU types with room, the node assignment minimising
  ``1.0 * (partly free nodes) + 0.3 * (free_max - free_min) - 0.5 * (nodes where the next
  queued job would fit)``, solved as an integer program with OR-Tools' CP-SAT (one per
  type; the least objective wins, ties to the faster type).
* No per-type speed model and no energy model: the type is chosen for fragmentation only.

What is ours: a "pool" is the set of GPU types a job can run on (our traces do not pin a
job to one type); fragmentation of a pool is 1 - (most free GPUs on one node) / (free
GPUs); nodes hold ``NODE_SIZE`` (8) GPUs of one type; a started job runs to completion
(no preemption), its GPUs held in this allocator's node map. The network scores each
queued job with one small MLP shared across slots (and the wait action from the pooled
features), with a value head for PPO. Trained by ``gogh rltune train`` on generated job
streams (``train_rltune``); weights are safetensors with a JSON config, as the predictors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from ortools.sat.python import cp_model
from safetensors.torch import load_file, save_file
from torch import nn

from gogh_flows.sim.rounds import AllocationState

__all__ = ["FEATURES", "QUEUE", "RLTuneAllocator", "RLTuneNet", "bounded_slowdown", "default_dir",
           "fcfs_chooser", "load_rltune", "make_rltune", "net_chooser", "one_thread", "save_rltune"]

FEATURES = 7
QUEUE = 128
NODE_SIZE = 8
MAX_WAIT_S = 12 * 3600.0
LOOKAHEAD_S = 600.0
MAX_HOLD_S = 600.0  # RLTune's wait action holds at most this long
FORMAT_VERSION = 1
WEIGHTS, CONFIG = "weights.safetensors", "config.json"


class RLTuneNet(nn.Module):
    """Scores every queued job with one shared MLP; the wait action and the value come from
    the features pooled over the queue."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = hidden
        self.job = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 1))
        self.wait = nn.Sequential(nn.Linear(FEATURES + 1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.value = nn.Sequential(nn.Linear(FEATURES + 1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        with torch.no_grad():  # start rarely waiting: an idle GPU is rarely worth holding
            self.wait[-1].bias.fill_(-3.0)

    def forward(self, obs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs (B, QUEUE, FEATURES); mask (B, QUEUE + 1), True where an action is allowed."""
        filled = (obs.abs().sum(-1) > 0).float()  # (B, QUEUE)
        count = filled.sum(-1, keepdim=True).clamp(min=1.0)
        pooled = torch.cat([(obs * filled.unsqueeze(-1)).sum(1) / count, count / QUEUE], -1)
        logits = torch.cat([self.job(obs).squeeze(-1), self.wait(pooled)], -1)
        logits = logits.masked_fill(~mask, -1e9)
        return logits, self.value(pooled).squeeze(-1)


def bounded_slowdown(arrival_s: float, placed_s: float, finished_s: float) -> float:
    """RLTune's per-job figure: ``max(1, (wait + run) / max(run, 10 s))``."""
    run = finished_s - placed_s
    return max(1.0, (finished_s - arrival_s) / max(run, 10.0))


@lru_cache(maxsize=65536)
def _place_on_type(free: tuple[int, ...], size: tuple[int, ...], need: int, nxt: int) -> tuple[float, tuple[int, ...]] | None:
    """RLTune's placement objective on one type's nodes, as a CP-SAT integer program.

    Returns (objective, GPUs taken per node), or None when the type lacks room. Scaled by 10
    so the weights 1.0 / 0.3 / 0.5 are integers. Memoised: node states repeat a lot.
    """
    if sum(free) < need:
        return None
    m = cp_model.CpModel()
    take = [m.NewIntVar(0, f, f"g{n}") for n, f in enumerate(free)]
    m.Add(sum(take) == need)
    left = [free[n] - take[n] for n in range(len(free))]
    partly, fits = [], []
    for n, cap in enumerate(size):
        # partly free: 0 < left < cap, as two indicators
        some = m.NewBoolVar(f"some{n}")
        m.Add(left[n] >= 1).OnlyEnforceIf(some)
        m.Add(left[n] == 0).OnlyEnforceIf(some.Not())
        full_free = m.NewBoolVar(f"whole{n}")
        m.Add(left[n] == cap).OnlyEnforceIf(full_free)
        m.Add(left[n] <= cap - 1).OnlyEnforceIf(full_free.Not())
        p = m.NewBoolVar(f"partly{n}")
        m.AddBoolAnd([some, full_free.Not()]).OnlyEnforceIf(p)
        m.AddBoolOr([some.Not(), full_free]).OnlyEnforceIf(p.Not())
        partly.append(p)
        f = m.NewBoolVar(f"fits{n}")
        m.Add(left[n] >= nxt).OnlyEnforceIf(f)
        m.Add(left[n] <= nxt - 1).OnlyEnforceIf(f.Not())
        fits.append(f)
    hi, lo = m.NewIntVar(0, max(size), "hi"), m.NewIntVar(0, max(size), "lo")
    for x in left:
        m.Add(hi >= x)
        m.Add(lo <= x)
    m.Minimize(10 * sum(partly) + 3 * (hi - lo) - 5 * sum(fits))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 5.0
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return solver.ObjectiveValue() / 10.0, tuple(int(solver.Value(t)) for t in take)


Chooser = Callable[[np.ndarray, np.ndarray], int]


def fcfs_chooser(obs: np.ndarray, mask: np.ndarray) -> int:
    """The baseline: the first queued job that can start now, else wait."""
    allowed = np.flatnonzero(mask[:QUEUE])
    return int(allowed[0]) if allowed.size else QUEUE


@contextmanager
def one_thread():
    """Torch on one thread: the agent's tensors are tiny, and on a few cores the thread pool
    costs ~10x the arithmetic (measured: 10 ms against 1 ms per decision on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def net_chooser(net: RLTuneNet, *, sample: bool = False, rng: torch.Generator | None = None,
                record: list | None = None) -> Chooser:
    """The agent: argmax of its scores, or (training) a sample, each step recorded."""

    def choose(obs: np.ndarray, mask: np.ndarray) -> int:
        o = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
        mk = torch.as_tensor(mask, dtype=torch.bool).unsqueeze(0)
        with torch.no_grad(), one_thread():
            logits, value = net(o, mk)
        if sample:
            logp = torch.log_softmax(logits, -1)[0]
            a = int(torch.multinomial(logp.exp(), 1, generator=rng))
            if record is not None:
                record.append((obs.copy(), mask.copy(), a, float(logp[a]), float(value)))
            return a
        return int(logits.argmax(-1))

    return choose


@dataclass
class RLTuneAllocator:
    """Started jobs hold their nodes until they end; at every arrival and completion the
    chooser picks queued jobs to start, one at a time, until it waits or nothing fits."""

    chooser: Chooser = fcfs_chooser
    name: str = "rltune"
    skips_unallocated: bool = True
    reset_s: float = 0.0
    node_size: int = NODE_SIZE
    _free: dict[str, list[int]] = field(default_factory=dict, init=False)  # type -> free per node
    _size: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False)
    _held: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict, init=False)
    wake_at_s: float = field(default=math.inf, init=False)  # read by the round engine

    def _nodes(self, state: AllocationState) -> None:
        if self._free:
            return
        for t, cap in zip(state.types, state.capacity):
            full, rest = divmod(int(cap), self.node_size)
            sizes = (self.node_size,) * full + ((rest,) if rest else ())
            self._size[t], self._free[t] = sizes, list(sizes)

    def allocate(self, state: AllocationState) -> np.ndarray:
        self._nodes(state)
        index = {j: i for i, j in enumerate(state.job_ids)}
        for j in [j for j in self._held if j not in index]:  # ended: give its GPUs back
            t, took = self._held.pop(j)
            self._free[t] = [f + k for f, k in zip(self._free[t], took)]
        queue = [i for i in np.argsort(state.arrival_s, kind="stable")
                 if state.job_ids[i] not in self._held and state.rate[i].max() > 0]
        self.wake_at_s = math.inf
        while queue:
            obs, mask = self.observe(state, queue, index)
            if not mask.any():
                break
            a = self.chooser(obs, mask)
            if a >= len(queue) or a >= QUEUE or not mask[a]:
                # wait: decide again at the next arrival or end, or after MAX_HOLD_S at most
                self.wake_at_s = state.now_s + MAX_HOLD_S
                break
            i = queue.pop(a)
            nxt = int(state.scale[queue[0]]) if queue else 1
            self._start(state, int(i), nxt)
        out = np.zeros(state.rate.shape)
        col = {t: c for c, t in enumerate(state.types)}
        for j, (t, _) in self._held.items():
            out[index[j], col[t]] = 1.0
        return out

    def _start(self, state: AllocationState, i: int, nxt: int) -> None:
        need = int(state.scale[i])
        best = None
        for c, t in enumerate(state.types):  # types in the round's order: fastest first on ties
            if state.rate[i, c] <= 0:
                continue
            got = _place_on_type(tuple(self._free[t]), self._size[t], need, nxt)
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], t, got[1])
        if best is None:
            raise RuntimeError(f"job {state.job_ids[i]!r} was chosen although no GPU type has room")
        _, t, took = best
        self._free[t] = [f - k for f, k in zip(self._free[t], took)]
        self._held[state.job_ids[i]] = (t, took)

    def observe(self, state: AllocationState, queue: Sequence[int],
                index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """The agent's view: (QUEUE, FEATURES) features and the (QUEUE + 1) action mask."""
        n = len(state.types)
        free = np.array([sum(self._free[t]) for t in state.types], dtype=float)
        most = np.array([max(self._free[t], default=0) for t in state.types], dtype=float)
        soon = np.zeros(n)
        for j, (t, took) in self._held.items():
            i, c = index[j], state.types.index(t)
            if state.rate[i, c] > 0 and state.remaining[i] / state.rate[i, c] <= LOOKAHEAD_S:
                soon[c] += sum(took)
        demand_by_mask: dict[int, float] = {}
        pools = {}
        for i in queue:
            mask_bits = sum(1 << c for c in range(n) if state.rate[i, c] > 0)
            pools[i] = mask_bits
            demand_by_mask[mask_bits] = demand_by_mask.get(mask_bits, 0.0) + state.scale[i]
        obs = np.zeros((QUEUE, FEATURES), dtype=np.float32)
        allowed = np.zeros(QUEUE + 1, dtype=bool)
        for slot, i in enumerate(queue[:QUEUE]):
            pool = [c for c in range(n) if pools[i] >> c & 1]
            supply = float(state.capacity[pool].sum())
            demand = sum(d for bits, d in demand_by_mask.items() if bits & pools[i])
            pool_free = float(free[pool].sum())
            fits_on = sum(1 for c in pool if free[c] >= state.scale[i])
            obs[slot] = (
                min(state.now_s - state.arrival_s[i], MAX_WAIT_S) / MAX_WAIT_S,
                min(state.scale[i] / NODE_SIZE, 1.0),
                min(demand / supply, 4.0) / 4.0 if supply > 0 else 1.0,
                float(soon[pool].sum()) / supply if supply > 0 else 0.0,
                1.0 - float(most[pool].max()) / pool_free if pool_free > 0 else 0.0,
                fits_on / n,
                1.0 if fits_on else 0.0,
            )
            allowed[slot] = fits_on > 0
        allowed[QUEUE] = bool(self._held) and allowed[:QUEUE].any()  # waiting needs a later event
        return obs, allowed


def save_rltune(net: RLTuneNet, directory: str | Path, trained_on: dict) -> Path:
    """Weights as safetensors, the rest as JSON (with the weights' SHA-256): nothing pickled."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / WEIGHTS
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(weights),
              metadata={"kind": "rltune", "format_version": str(FORMAT_VERSION)})
    config = {"kind": "rltune", "format_version": FORMAT_VERSION, "hidden": net.hidden,
              "features": FEATURES, "queue": QUEUE, "trained_on": trained_on,
              "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    # numpy scalars from a training summary become plain numbers (JSON holds no objects)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True,
                                         default=lambda x: x.item() if hasattr(x, "item") else str(x)) + "\n")
    return out


def default_dir() -> Path:
    """Where the shipped agent lives: ``models/rltune`` (or under ``$GOGH_MODELS_DIR``)."""
    from gogh_flows.predict.io import models_dir

    return models_dir() / "rltune"


def make_rltune(directory: str | Path | None = None) -> RLTuneAllocator:
    """The ``rltune`` peer: the trained agent choosing, argmax (no sampling)."""
    net, _ = load_rltune(directory or default_dir())
    return RLTuneAllocator(chooser=net_chooser(net))


def load_rltune(directory: str | Path) -> tuple[RLTuneNet, dict]:
    """Rebuild a saved agent; refuses a directory that is incomplete or whose weights changed."""
    d = Path(directory)
    if not (d / WEIGHTS).is_file() or not (d / CONFIG).is_file():
        raise FileNotFoundError(
            f"no trained RLTune agent in {str(d)!r} (expected {WEIGHTS} and {CONFIG}); train one "
            f"with `gogh rltune train --out {d}`")
    config = json.loads((d / CONFIG).read_text())
    if config.get("kind") != "rltune" or config.get("features") != FEATURES or config.get("queue") != QUEUE:
        raise ValueError(f"{d / CONFIG} does not describe an RLTune agent of this version "
                         f"(kind rltune, {FEATURES} features, queue {QUEUE}); re-train it")
    if hashlib.sha256((d / WEIGHTS).read_bytes()).hexdigest() != config.get("weights_sha256"):
        raise ValueError(f"{d / WEIGHTS} does not match the SHA-256 in {CONFIG}: re-train or restore it")
    net = RLTuneNet(hidden=int(config["hidden"]))
    net.load_state_dict(load_file(str(d / WEIGHTS)))
    net.eval()
    return net, config
