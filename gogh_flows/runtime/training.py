"""A body that trains a zoo model for real on the GPU it was given, reporting every step.

What a measured run looks like: build the model on the run's device, train with
synthetic inputs, synchronise after each step (so a step is counted when the GPU has
done it, not when it was queued) and report it. Used by ``benchmarks/gpu_check.py`` and
the GPU-only tests; a user's own training loop follows the same pattern.
"""

from __future__ import annotations

import time
from typing import Any

from gogh_flows.runtime.context import current_gpu

__all__ = ["train_zoo"]


def _float_tensors(out: Any) -> list:
    import torch

    if torch.is_tensor(out):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _float_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _float_tensors(o)]
    return []


def train_zoo(family: str, batch_size: int, *, seconds: float | None = None, steps: int | None = None,
              report: bool = True) -> int:
    """Train ``family`` at ``batch_size`` for ``steps`` steps, or for ``seconds`` after its first
    step; the steps done. Runs on the current pool GPU (``cuda:0`` on a real board, the CPU
    when emulated or outside a pool) and reports each step unless ``report=False``."""
    import torch

    from gogh_flows.workloads.zoo import build_model

    if (seconds is None) == (steps is None):
        raise ValueError("train_zoo needs exactly one of seconds=... or steps=...")
    gpu = current_gpu()
    device = gpu.torch_device if gpu is not None else "cpu"
    zoo = build_model(family, batch_size, device=device)
    module = zoo.module.train()
    inputs = zoo.example_inputs if isinstance(zoo.example_inputs, tuple) else (zoo.example_inputs,)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    cuda = str(device).startswith("cuda")
    done, end = 0, None
    while done < steps if steps is not None else (end is None or time.monotonic() < end):
        opt.zero_grad(set_to_none=True)
        sum(t.float().mean() for t in _float_tensors(module(*inputs))).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        done += 1
        if report and gpu is not None:
            gpu.report()
        if end is None and seconds is not None:
            end = time.monotonic() + seconds  # the clock starts after the first step (start-up)
    return done
