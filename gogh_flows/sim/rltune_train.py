"""Training the RLTune-style agent with PPO on generated job streams (``gogh rltune train``).

RLTune's training, as described: each episode is a 256-job sequence; the agent is
rewarded once, at the end, by how much it cut the total bounded slowdown against a
baseline scheduler on the *same* sequence (here FCFS with the same placement). The
streams are generated (seeded Poisson arrivals with Philly durations and GPU counts, job
types of the truth table), so an agent trained here never saw the traces it is evaluated
on (docs/peers.md). PPO: clipped objective (0.2), a value head as baseline, advantages
normalised per batch of episodes, an entropy bonus; every step of an episode gets its
terminal reward as return (no discounting: the reward is one number per sequence).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from gogh_flows.sim.engine import SimResult
from gogh_flows.sim.rltune import (QUEUE, RLTuneAllocator, RLTuneNet, bounded_slowdown, net_chooser, one_thread,
                                   save_rltune)
from gogh_flows.sim.rounds import RoundConfig, simulate_rounds

__all__ = ["TrainConfig", "add_parser", "evaluate_agent", "total_slowdown", "train_rltune"]


@dataclass(frozen=True)
class TrainConfig:
    episodes: int = 96
    jobs_per_episode: int = 256
    batch_episodes: int = 4
    ppo_epochs: int = 4
    clip: float = 0.2
    lr: float = 3e-3
    entropy: float = 0.01
    hidden: int = 32
    seed: int = 0
    cluster: str = "v100=8,p100=16,k80=24"
    rate_per_hour: float = 0.6  # ~1.25x the testbed's capacity in Philly GPU-hours: a queue forms

    def __post_init__(self) -> None:
        for name in ("episodes", "jobs_per_episode", "batch_episodes", "ppo_epochs", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.rate_per_hour > 0:
            raise ValueError(f"rate_per_hour must be > 0, got {self.rate_per_hour!r}")


def total_slowdown(result: SimResult) -> float:
    """Sum of bounded slowdowns; a job left unfinished counts as ending at the run's end."""
    total = 0.0
    for r in result.jobs.values():
        placed = r.placed_s if r.placed_s is not None else result.end_s
        total += bounded_slowdown(r.arrival_s, placed, r.finished_s if r.finished_s is not None else result.end_s)
    return total


def _streams(cfg: TrainConfig, truth, data_dir: Path):
    from gogh_flows.sim.run import parse_cluster, prepare_jobs, reference_throughput
    from gogh_flows.sim.traces import generate_arrivals, load_philly_distribution

    gpus = parse_cluster(cfg.cluster, capacity=1)
    dist = load_philly_distribution(data_dir / "traces" / "philly_job_distribution.csv")
    types = [j for j in truth.job_types if truth.has(j, "v100", 1)]

    def stream(k: int) -> list:
        jobs = generate_arrivals(cfg.jobs_per_episode, rate_per_hour=cfg.rate_per_hour, job_types=types,
                                 distribution=dist, seed=10_000 * (cfg.seed + 1) + k,
                                 throughput_of=reference_throughput(truth, "v100"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prepare_jobs(jobs, truth, gpus, seed=k)

    return gpus, stream


def check_training_fleet(cfg: TrainConfig, truth) -> None:
    """Refuse, before any episode, a fleet the truth cannot run: every generated job is dropped
    on a GPU type the table lacks, and the episodes would have no jobs at all."""
    from gogh_flows.sim.run import parse_cluster

    types = sorted({g.gpu_type for g in parse_cluster(cfg.cluster, capacity=1)})
    missing = [t for t in types if t not in truth.gpu_types]
    if missing:
        raise ValueError(f"--cluster GPU types {missing} are not in the truth table ({truth.source}); it covers "
                         f"{list(truth.gpu_types)}: train on a fleet of those types")
    if "v100" not in truth.gpu_types:
        raise ValueError(f"the truth table ({truth.source}) has no v100 entries, which the generated jobs' "
                         "requirements are scaled by; give a Gavel table with v100 measurements")


def train_rltune(truth, data_dir: Path, cfg: TrainConfig = TrainConfig(),
                 progress: Callable[[int, int, dict], None] | None = None) -> tuple[RLTuneNet, list[dict]]:
    """Train an agent; returns it and the training curve (one row per episode)."""
    with one_thread():
        return _train(truth, data_dir, cfg, progress)


def _train(truth, data_dir: Path, cfg: TrainConfig, progress) -> tuple[RLTuneNet, list[dict]]:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    net = RLTuneNet(hidden=cfg.hidden)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    gpus, stream = _streams(cfg, truth, data_dir)
    curve: list[dict] = []
    k = 0
    while k < cfg.episodes:
        batch = []
        for _ in range(min(cfg.batch_episodes, cfg.episodes - k)):
            jobs = stream(k)
            run = RoundConfig(seed=k)
            base = total_slowdown(simulate_rounds(jobs, gpus, truth, RLTuneAllocator(), config=run))
            record: list = []
            net.eval()
            agent_alloc = RLTuneAllocator(chooser=net_chooser(net, sample=True, rng=gen, record=record))
            agent = total_slowdown(simulate_rounds(jobs, gpus, truth, agent_alloc, config=run))
            reward = (base - agent) / max(base, agent, 1.0)
            batch.append((record, reward))
            row = {"episode": k, "reward": reward, "agent_slowdown": agent / len(jobs),
                   "fcfs_slowdown": base / len(jobs), "decisions": len(record)}
            curve.append(row)
            if progress is not None:
                progress(k + 1, cfg.episodes, row)
            k += 1
        _ppo_update(net, opt, batch, cfg)
    net.eval()
    return net, curve


def evaluate_agent(net: RLTuneNet, truth, data_dir: Path, cfg: TrainConfig, episodes: int = 8) -> dict:
    """The trained agent (argmax) against FCFS on sequences it never trained on (other seeds)."""
    gpus, stream = _streams(cfg, truth, data_dir)
    agent_total = fcfs_total = 0.0
    wins = 0
    with one_thread():
        for k in range(100_000, 100_000 + episodes):
            jobs, run = stream(k), RoundConfig(seed=k)
            base = total_slowdown(simulate_rounds(jobs, gpus, truth, RLTuneAllocator(), config=run))
            agent = total_slowdown(simulate_rounds(jobs, gpus, truth, RLTuneAllocator(chooser=net_chooser(net)),
                                                   config=run))
            agent_total, fcfs_total, wins = agent_total + agent, fcfs_total + base, wins + int(agent < base)
    n = episodes * cfg.jobs_per_episode
    return {"sequences": episodes, "agent_mean_slowdown": float(agent_total / n),
            "fcfs_mean_slowdown": float(fcfs_total / n), "agent_better_on": int(wins)}


def _ppo_update(net: RLTuneNet, opt: torch.optim.Optimizer, batch: list, cfg: TrainConfig) -> None:
    steps = [(s, r) for record, r in batch for s in record]
    if not steps:
        return
    obs = torch.as_tensor(np.stack([s[0] for s, _ in steps]), dtype=torch.float32)
    mask = torch.as_tensor(np.stack([s[1] for s, _ in steps]), dtype=torch.bool)
    act = torch.as_tensor([s[2] for s, _ in steps])
    old_logp = torch.as_tensor([s[3] for s, _ in steps], dtype=torch.float32)
    value = torch.as_tensor([s[4] for s, _ in steps], dtype=torch.float32)
    ret = torch.as_tensor([r for _, r in steps], dtype=torch.float32)
    adv = ret - value
    adv = (adv - adv.mean()) / (adv.std() + 1e-8) if len(steps) > 1 else adv
    net.train()
    for _ in range(cfg.ppo_epochs):
        for idx in torch.randperm(len(steps)).split(512):
            logits, v = net(obs[idx], mask[idx])
            dist = torch.distributions.Categorical(logits=logits)
            ratio = torch.exp(dist.log_prob(act[idx]) - old_logp[idx])
            a = adv[idx]
            policy_loss = -torch.min(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a).mean()
            loss = policy_loss + 0.5 * ((v - ret[idx]) ** 2).mean() - cfg.entropy * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()


def plot_curve(curve: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [r["episode"] for r in curve]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    rew = np.array([r["reward"] for r in curve])
    w = min(8, len(rew))
    ax[0].plot(ep, rew, ".", alpha=0.4, label="episode")
    ax[0].plot(ep[w - 1:], np.convolve(rew, np.ones(w) / w, mode="valid"), label=f"mean of {w}")
    ax[0].axhline(0, color="grey", lw=0.8)
    ax[0].set(xlabel="episode", ylabel="reward (FCFS - agent) / max", title="RLTune-style agent: reward")
    ax[0].legend()
    ax[1].plot(ep, [r["fcfs_slowdown"] for r in curve], label="FCFS")
    ax[1].plot(ep, [r["agent_slowdown"] for r in curve], label="agent (sampling)")
    ax[1].set(xlabel="episode", ylabel="mean bounded slowdown", yscale="log",
              title="same 256-job sequence, each episode")
    ax[1].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_parser(sub) -> None:
    p = sub.add_parser("rltune", help="the RLTune-style peer (a reconstruction): train its agent")
    ps = p.add_subparsers(dest="rltune", required=True)
    t = ps.add_parser("train", help="train the agent with PPO on generated job streams")
    t.add_argument("--out", required=True, help="directory for weights.safetensors + config.json (the "
                   "shipped agent is models/rltune; use another directory and `gogh simulate --rltune-model`)")
    t.add_argument("--truth", default="gavel", help="'gavel' (simulation_throughputs.json; the default) or a Gavel JSON")
    t.add_argument("--data", help="Gavel data folder (default: $GOGH_GAVEL_DIR, else ../shared/data/gavel here or beside the checkout)")
    d = TrainConfig()
    t.add_argument("--episodes", type=int, default=d.episodes, help=f"training episodes (default {d.episodes})")
    t.add_argument("--jobs", type=int, default=d.jobs_per_episode, help=f"jobs per episode (default {d.jobs_per_episode})")
    t.add_argument("--seed", type=int, default=d.seed, help=f"seeds the episodes and the agent (default {d.seed})")
    t.add_argument("--cluster", default=d.cluster, help=f"TYPE=COUNT,... the agent is trained on (default {d.cluster})")
    t.add_argument("--rate", type=float, default=d.rate_per_hour, help=f"arrivals per hour (default {d.rate_per_hour:g})")
    t.add_argument("--plot", help="write the training curve here (PNG)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace an agent already in --out (the shipped one too); without it that is refused")
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

    if (Path(args.out) / "config.json").exists() and not args.overwrite:  # before the minutes of training
        raise ValueError(f"--out {args.out!r} already holds an agent; give another directory (and `gogh simulate "
                         "--rltune-model DIR` to use it), or --overwrite to replace it")
    data = Path(args.data) if args.data else gavel_dir()
    if args.truth != "gavel" and not Path(args.truth).is_file():
        raise ValueError(f"--truth {args.truth!r} is neither 'gavel' nor a file: the agent is trained on Gavel's "
                         "measured throughputs, 'gavel' (simulation_throughputs.json in --data) or the path of a "
                         "Gavel throughput JSON (the synthetic fleet is not offered here)")
    truth_path = data / "simulation_throughputs.json" if args.truth == "gavel" else Path(args.truth)
    truth = read_gavel_json(truth_path)
    for flag, value in (("--episodes", args.episodes), ("--jobs", args.jobs)):
        if value < 1:  # TrainConfig's own message names its field, not the option the user typed
            raise ValueError(f"{flag} must be a whole number >= 1, got {value}")
    if not args.rate > 0:
        raise ValueError(f"--rate must be arrivals per hour > 0, got {args.rate:g}")
    cfg = TrainConfig(episodes=args.episodes, jobs_per_episode=args.jobs, seed=args.seed,
                      cluster=args.cluster, rate_per_hour=args.rate)
    check_training_fleet(cfg, truth)
    t0 = time.perf_counter()

    def show(done: int, total: int, row: dict) -> None:
        print(f"episode {done}/{total}: reward {row['reward']:+.3f} (bounded slowdown agent "
              f"{row['agent_slowdown']:.2f}, FCFS {row['fcfs_slowdown']:.2f})", file=sys.stderr, flush=True)

    net, curve = train_rltune(truth, data, cfg, progress=show)
    heldout = evaluate_agent(net, truth, data, cfg)
    print(f"held-out sequences: mean bounded slowdown agent {heldout['agent_mean_slowdown']:.2f}, FCFS "
          f"{heldout['fcfs_mean_slowdown']:.2f}; agent better on {heldout['agent_better_on']} of "
          f"{heldout['sequences']}", file=sys.stderr, flush=True)
    trained_on = {"heldout": heldout, **asdict(cfg), "truth": str(truth_path.name), "queue": QUEUE,
                  "streams": "generated: Poisson arrivals, Philly durations and GPU counts, seeds "
                             f"{10_000 * (cfg.seed + 1)}+episode",
                  "curve": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in curve],
                  "wall_s": round(time.perf_counter() - t0, 1)}
    out = save_rltune(net, args.out, trained_on)
    if args.plot:
        plot_curve(curve, Path(args.plot))
    last = curve[-min(16, len(curve)):]
    print(json.dumps({"out": str(out), "episodes": len(curve),
                      "mean_reward_last": sum(r["reward"] for r in last) / len(last)}))
    return 0
