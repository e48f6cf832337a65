"""What ``@gogh_placed(...)`` is told about a flow's job, checked when the decorator is applied.

A wrong argument is a programming error, so it must fail at import time with a message that
names the argument, not minutes later inside a flow run. Layer features are extracted here,
once, on the ``meta`` device (no memory, no GPU): each run then only looks them up. The
result is the project's one job model, :class:`~gogh_flows.workloads.job.JobSpec`, the same
the CLI and the simulator use.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import warnings
from typing import Any

from pydantic import ValidationError
from torch import nn

from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS
from gogh_flows.workloads.features import WorkloadFeatures, check_example_batch, check_kind, extract_features
from gogh_flows.workloads.job import JobSpec
from gogh_flows.workloads.zoo import (
    _BUILDERS, FAMILIES, canonical_family, families_like, job_type_name, parse_job_kind, zoo_features,
)

_ZOO_BY_BUILDER = {builder: family for family, builder in _BUILDERS.items()}


def _positive_number(name: str, value: Any, *, integer: bool = False) -> float:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"@gogh_placed({name}=...) must be {kind} > 0, got {value!r}")
    return value


def _family_named(model: str) -> str:
    """The zoo family ``model=`` names, or an error that says what was probably meant."""
    try:
        return canonical_family(model)
    except ValueError as exc:
        error = f"@gogh_placed(model=...): {exc}"
    try:  # a job-type string, as the tables and the UI show them: "ResNet-50 (batch size 64)"
        family, bs, kind = parse_job_kind(model)
    except ValueError:
        raise ValueError(error + ("" if families_like(model) else  # the error says what was meant
                                  "; for a model of your own pass the torch.nn.Module (or a function "
                                  "returning one) with example_inputs=...")) from None
    extra = ", kind='inference'" if kind == "inference" else ""
    raise ValueError(f"{error}; {model!r} is a job type, which @gogh_placed builds from its parts: "
                     f"model={family!r}, batch_size={bs}{extra}") from None


def _zoo_job_type(name: str) -> tuple[str, int, str] | None:
    """The zoo job (family, batch size, kind) that ``name`` is read as, or None for a name of one's own.

    Measurements, predictions, the shared features and the emulated fleet all know a job by its
    job type, and read any name the zoo's parser takes ("LM", "lm (batch size 20)") as the zoo
    model's: a model of one's own under such a name was run at the zoo model's speed on the
    emulated fleet and logged into the zoo model's records, skewing every later placement of it
    (a review).
    """
    try:
        return parse_job_kind(name)
    except (KeyError, ValueError):
        return None


def _own_name(name: str, *, given: bool, features: WorkloadFeatures) -> str:
    """``name`` for a job of one's own; one the zoo would read as its own is refused where the user
    gave it, and where it was derived from a class's name (``class Transformer``) is prefixed with
    "my ", with a warning that says so (a common class name is no mistake of the user's)."""
    zoo = _zoo_job_type(name)
    if zoo is None:
        return name
    if given:
        family, bs, kind = zoo
        if features.to_dict() == zoo_features(family, bs, kind).to_dict():
            return name  # the zoo model's own features, under its own name: it is that model
        raise ValueError(f"@gogh_placed(job_name={name!r}) is read as the zoo's job type "
                         f"{job_type_name(family, bs, kind)!r}, and this is not that model: its measurements would be "
                         "mixed with the zoo model's (and the emulated fleet would run it at the zoo model's speed). "
                         f"Give it a name of its own, e.g. job_name={'my ' + name!r}")
    own = "my " + name
    warnings.warn(f"@gogh_placed: your model's class is named like a zoo model, and {name!r} is the zoo's job type: "
                  f"it is placed and measured as {own!r} instead, apart from the zoo model's data. Give "
                  "job_name='...' to choose the name", UserWarning, stacklevel=5)
    return own


def _features_of(model: Any, batch_size: int, kind: str, example_inputs: Any,
                 job_name: str | None) -> tuple[WorkloadFeatures, str | None, str]:
    """(features, zoo family or None, job type) of whatever the user passed as ``model``."""
    if job_name is not None and (not isinstance(job_name, str) or not job_name.strip()):
        raise ValueError(f"@gogh_placed(job_name=...) must be a non-empty name, got {job_name!r}; leave it out to "
                         "use the model's own (a zoo model's job type, your model's class name and batch size)")
    if isinstance(model, WorkloadFeatures):
        if not job_name:
            raise ValueError("@gogh_placed(model=WorkloadFeatures(...)) also needs job_name='...': "
                             "measurements of this job are grouped under that name")
        return model, None, _own_name(job_name, given=True, features=model)
    family = None
    if isinstance(model, str):
        family = _family_named(model)
    elif callable(model) and model in _ZOO_BY_BUILDER:
        family = _ZOO_BY_BUILDER[model]
    if family is not None:
        if example_inputs is not None:  # ignored without a word before (a Prefect user's review)
            raise ValueError(f"@gogh_placed(model={model if isinstance(model, str) else family!r}, example_inputs=...): "
                             f"{family!r} is a zoo model, whose layers are traced on its own inputs at batch_size; "
                             "example_inputs is for a torch model of your own (model=MyModule()): drop it, or pass "
                             "your own module")
        own = job_type_name(family, batch_size, kind)
        read_as = _zoo_job_type(job_name) if job_name else None
        if read_as is not None and read_as != (family, batch_size, kind):
            raise ValueError(f"@gogh_placed(job_name={job_name!r}) is another zoo job type than this model's own "
                             f"({own!r}): its measurements would be logged as that model's. Drop job_name to use "
                             f"{own!r}, or give a name that is no zoo job type")
        return zoo_features(family, batch_size, kind), family, job_name or own
    if isinstance(model, nn.Module) or callable(model):
        if example_inputs is None:
            raise ValueError(
                "@gogh_placed(model=...) got your own torch model, so it also needs example_inputs=... "
                f"(one batch of {batch_size} inputs, on any device; features come from one pass on "
                f"'meta'); or pass a zoo family name: {', '.join(FAMILIES)}")
        module = model if isinstance(model, nn.Module) else model()
        if not isinstance(module, nn.Module):
            raise ValueError(f"@gogh_placed(model=...) callable returned {type(module).__name__}, "
                             "not a torch.nn.Module")
        try:
            check_example_batch(example_inputs, batch_size)
        except ValueError as exc:
            raise ValueError(f"@gogh_placed(example_inputs=..., batch_size={batch_size}): {exc}") from None
        try:
            feats = extract_features(module, example_inputs, kind=kind, batch_size=batch_size)
        except ValueError:
            # a forward that reads tensor values (.item(), data-dependent branches) cannot run on
            # 'meta': trace it where the model and inputs are, once, as the user gave them
            try:
                feats = extract_features(module, example_inputs, kind=kind, batch_size=batch_size, device=None)
            except ValueError as exc:
                raise ValueError(f"@gogh_placed could not trace {type(module).__name__} on example_inputs, "
                                 f"neither on 'meta' nor where they are: {exc}. Check that "
                                 "model(example_inputs) runs as written") from exc
        name = _own_name(job_name or f"{type(module).__name__} (batch size {batch_size})",
                         given=bool(job_name), features=feats)
        return feats, None, name
    raise ValueError(
        f"@gogh_placed(model=...) must be a zoo family name ({', '.join(FAMILIES)}), a zoo "
        f"builder, a torch.nn.Module or a function returning one, or WorkloadFeatures; got {model!r}")


#: the layer features each job type of a model of one's own was declared with in this process
_DECLARED: dict[str, str] = {}
_DECLARED_LOCK = threading.Lock()


def _say_if_declared_otherwise(job_type: str, features: WorkloadFeatures) -> None:
    """Warn when a job type of one's own is declared again with other layer features.

    Two different models of one class (two ``nn.Sequential`` at one batch size) became one job
    type without a word: the second was predicted, and on the emulated fleet run, as the first,
    and their measurements were mixed (a review). Warned, not refused: a notebook cell run again
    after editing its model declares the same name with new layers, which is legitimate (its
    measurements of the old layers still count toward it: a new name starts afresh).
    """
    mark = hashlib.sha256(json.dumps(features.to_dict(), sort_keys=True).encode()).hexdigest()
    with _DECLARED_LOCK:
        before = _DECLARED.setdefault(job_type, mark)
        _DECLARED[job_type] = mark
    if before != mark:
        warnings.warn(f"@gogh_placed: the job type {job_type!r} was declared before in this process with other layer "
                      "features (a different model under the same name): placements, measurements and the refiner "
                      "know one job type by its name, so the two would be predicted and learned as one. Give each "
                      "model a job_name of its own", UserWarning, stacklevel=4)


def check_wait_timeout(wait_timeout_s: Any) -> float | None:
    """``@gogh_placed(wait_timeout_s=...)``: how long a run may wait for a GPU, overriding the policy's."""
    if wait_timeout_s is None:
        return None
    if isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s, (int, float)) or not (
            math.isfinite(wait_timeout_s) and wait_timeout_s >= 0):
        raise ValueError(f"@gogh_placed(wait_timeout_s=...) must be a number of seconds >= 0, "
                         f"got {wait_timeout_s!r}")
    return float(wait_timeout_s)


def check_warmup_steps(warmup_steps: Any, work_steps: int) -> int:
    """``@gogh_placed(warmup_steps=...)``: a whole number of steps >= 0, fewer than the work.

    ``None`` is the default warm-up, shortened for work too short to have it.
    """
    if warmup_steps is None:
        return max(0, min(DEFAULT_WARMUP_STEPS, work_steps - 1))
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"@gogh_placed(warmup_steps=...) must be a whole number of steps >= 0, got {warmup_steps!r}")
    if warmup_steps >= work_steps:
        raise ValueError(
            f"@gogh_placed(warmup_steps={warmup_steps}) leaves no steady-state steps of the {work_steps} work steps: "
            "the run's throughput would include its start-up; lower warmup_steps (0 opens the window at the "
            "first report)")
    return warmup_steps


def placed_job(
    *, model: Any, batch_size: Any, min_throughput: Any, work_steps: Any, kind: str = "training",
    example_inputs: Any = None, job_name: str | None = None,
) -> JobSpec:
    """The decorated flow's job; ``min_throughput`` becomes its ``required_throughput``."""
    bs = int(_positive_number("batch_size", batch_size, integer=True))
    rho = float(_positive_number("min_throughput", min_throughput))
    work = int(_positive_number("work_steps", work_steps, integer=True))
    try:
        check_kind(kind)
    except ValueError as exc:
        raise ValueError(f"@gogh_placed(kind=...): {exc}") from exc
    features, family, job_type = _features_of(model, bs, kind, example_inputs, job_name)
    if family is None:
        _say_if_declared_otherwise(job_type, features)
    try:
        return JobSpec(name=job_type, family=family, batch_size=bs, kind=kind, required_throughput=rho,
                       work_steps=work, features=features, job_type=job_type)
    except ValidationError as exc:  # e.g. a batch too large for any GPU's memory
        reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise ValueError(f"@gogh_placed(...) for {job_type!r}: {reasons}") from None


__all__ = ["check_wait_timeout", "check_warmup_steps", "placed_job"]
