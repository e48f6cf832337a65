"""Predictors on disk: a directory of ``weights.safetensors`` + ``config.json`` (+ ``MODEL_CARD.md``).

Why a directory of plain data: a model registry (MLflow, a shared folder, ``models/``) is an
*input* to every placement, and an input must never be able to run code. safetensors holds
only named tensors, the JSON config holds everything needed to rebuild the network, and the
loader refuses anything that looks like a pickled object instead of guessing which file
to trust. The config also records the weights' SHA-256, so weights swapped behind a
config (another model's tensors, a truncated file) are caught before they are used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gogh_flows.datapaths import shipped
from gogh_flows.predict.encoding import GPU_DIM, SUMMARY_DIM
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, P1Model, make_net
from gogh_flows.predict.p2 import P2Config, P2Model, P2Net

WEIGHTS = "weights.safetensors"
CONFIG = "config.json"
CARD = "MODEL_CARD.md"
FORMAT_VERSION = 1
KINDS = ("p1", "p2")
#: file endings of serialisations that can execute code when loaded (pickle and friends)
UNSAFE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".joblib", ".npy", ".npz", ".dill")


def models_dir() -> Path:
    """Shipped models (data, not code): ``$GOGH_MODELS_DIR`` or the repository's models/ (in a
    checkout, or installed inside the package)."""
    env = os.environ.get("GOGH_MODELS_DIR", "").strip()
    return Path(env).expanduser() if env else shipped("models")


def models_dir_problem() -> str | None:
    """What is wrong with ``$GOGH_MODELS_DIR``, for an error about a missing prior (None: unset or
    a folder). A mistyped one was reported as the prior missing from a folder the user never named."""
    env = os.environ.get("GOGH_MODELS_DIR", "").strip()
    if env and not Path(env).expanduser().is_dir():
        return f"GOGH_MODELS_DIR={env!r} is not a folder: unset it to use the shipped models/, or point it at one"
    return None


def prior_dir(prior: str) -> Path:
    """A shipped prior's folder under :func:`models_dir`, else ``prior`` read as a path (the folder
    `gogh predictors train --out DIR` wrote), so a team's own predictors can serve flow runs.

    Only a bare name can be a shipped one: ``./gavel`` is the folder here, as the user guide
    says, where it used to find the shipped ``gavel`` first (a review)."""
    if Path(prior).name != prior or prior in (".", ".."):  # "./gavel", "~/p", "/x/y": a path, never a shipped name
        return Path(prior).expanduser()
    shipped = models_dir() / prior
    return shipped if (shipped / "p1").is_dir() else Path(prior).expanduser()


class ModelFormatError(ValueError):
    """A model directory that is incomplete or does not describe the model it claims to."""


class UnsafeModelError(ValueError):
    """A model directory holding a serialisation that could run code when loaded."""


def save_model(model: P1Model | P2Model, directory: str | Path, card: str | None = None) -> Path:
    """Write ``model`` into ``directory`` (created if needed) and return the directory."""
    if isinstance(model, P1Model):
        kind = "p1"
    elif isinstance(model, P2Model):
        kind = "p2"
    else:
        raise TypeError(f"save_model takes a P1Model or a P2Model, got {type(model).__name__}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _refuse_unsafe(out)
    weights = out / WEIGHTS
    save_file(dict(model.state()), str(weights), metadata={"kind": kind, "format_version": str(FORMAT_VERSION)})
    config = {"kind": kind, "format_version": FORMAT_VERSION, **model.config_dict(),
              "weights_sha256": _sha256(weights)}
    (out / CONFIG).write_text(json.dumps(_plain(config), indent=2, sort_keys=True) + "\n")
    if card is not None:
        (out / CARD).write_text(card if card.endswith("\n") else card + "\n")
    return out


def load_model(directory: str | Path) -> P1Model | P2Model:
    """Rebuild a model saved by :func:`save_model`; never unpickles anything."""
    d = Path(directory)
    if not d.is_dir():
        raise ModelFormatError(
            f"model directory {str(d)!r} does not exist or is not a directory; expected a directory "
            f"holding {WEIGHTS} and {CONFIG} (written by gogh_flows.predict.io.save_model)"
        )
    _refuse_unsafe(d)
    missing = [n for n in (WEIGHTS, CONFIG) if not (d / n).is_file()]
    if missing:
        found = sorted(p.name for p in d.iterdir())
        raise ModelFormatError(
            f"model directory {str(d)!r} lacks {missing}; found {found}. Expected {WEIGHTS} "
            f"(safetensors) and {CONFIG} (written by gogh_flows.predict.io.save_model)"
        )
    config = _read_config(d / CONFIG)
    kind = config["kind"]
    expected_sha = config.get("weights_sha256")
    if expected_sha is None:  # every model save_model wrote records it: without it the check could be switched off
        raise ModelFormatError(
            f"{d / CONFIG} records no weights_sha256, so its weights cannot be checked against what was saved; "
            "save the model again with save_model() (gogh predictors train writes it)")
    if _sha256(d / WEIGHTS) != expected_sha:
        raise ModelFormatError(
            f"{d / WEIGHTS} does not match the SHA-256 recorded in {CONFIG}: the weights were "
            "replaced or damaged after saving. Re-save the model with save_model()."
        )
    try:
        state = load_file(str(d / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFormatError(f"{d / WEIGHTS} is not a readable safetensors file: {exc}") from exc
    try:
        expected = _expected_shapes(kind, config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{d / CONFIG} does not describe a {kind} model: {exc}") from exc
    _check_tensors(d, kind, state, expected)
    if kind == "p1":
        return P1Model.from_state(config, state)
    try:
        return P2Model.from_state(config, state)
    except (TypeError, ValueError) as exc:
        raise ModelFormatError(f"{d / CONFIG} does not describe a usable p2 model: {exc}") from exc


def load_p1(directory: str | Path) -> P1Model:
    model = load_model(directory)
    if not isinstance(model, P1Model):
        raise ModelFormatError(f"{str(directory)!r} holds a P2 refiner; a P1 estimator was expected")
    return model


def load_p2(directory: str | Path) -> P2Model:
    model = load_model(directory)
    if not isinstance(model, P2Model):
        raise ModelFormatError(f"{str(directory)!r} holds a P1 estimator; a P2 refiner was expected")
    return model


def record_trained_on(directory: str | Path, entries: Mapping[str, object]) -> Path:
    """Add ``entries`` to ``trained_on`` in a saved model's ``config.json``, in one write, so records
    that belong together (an ensemble and its intervals) land together; the weights (and their
    recorded hash) stay byte for byte as they were. What ``gogh predictors calibrate`` writes."""
    path = Path(directory) / CONFIG
    config = json.loads(path.read_text())
    config.setdefault("trained_on", {}).update(entries)
    path.write_text(json.dumps(_plain(config), indent=2, sort_keys=True) + "\n")
    return path


def read_card(directory: str | Path) -> str | None:
    p = Path(directory) / CARD
    return p.read_text() if p.is_file() else None


# -- checks ---------------------------------------------------------------------------------

def _refuse_unsafe(d: Path) -> None:
    bad = sorted(str(p.relative_to(d)) for p in d.rglob("*")
                 if p.is_file() and p.name.lower().endswith(UNSAFE_SUFFIXES))
    if bad:
        raise UnsafeModelError(
            f"model directory {str(d)!r} contains {bad}: files that may hold pickled Python objects, "
            f"which could run code when loaded. gogh-flows models are only {WEIGHTS} + {CONFIG} "
            f"(+ {CARD}); remove the other files or re-save the model with save_model()."
        )


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, got {type(config).__name__}")
    kind = config.get("kind")
    if kind not in KINDS:
        raise ModelFormatError(f"{path} has kind {kind!r}; expected one of {list(KINDS)}")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelFormatError(
            f"{path} has format_version {version!r}; this gogh-flows reads version {FORMAT_VERSION}"
        )
    return config


def _expected_shapes(kind: str, config: Mapping) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes the config's architecture has (built on the meta device: no memory)."""
    with torch.device("meta"):
        if kind == "p1":
            cfg = P1Config(**config["p1"])
            net = make_net(cfg.encoder, cfg.hidden)
            shapes = {f"net.{k}": tuple(v.shape) for k, v in net.state_dict().items()}
            shapes.update({"norm.summary_mean": (SUMMARY_DIM,), "norm.summary_std": (SUMMARY_DIM,),
                           "norm.gpu_mean": (GPU_DIM,), "norm.gpu_std": (GPU_DIM,)})
            return shapes
        cfg2 = P2Config(**config["p2"])
        layout = Layout(tuple(config["layout"]["gpus"]), tuple(config["layout"]["partners"]))
        return {k: tuple(v.shape) for k, v in P2Net(layout.size, cfg2.hidden).state_dict().items()}


def _check_tensors(d: Path, kind: str, state: Mapping[str, torch.Tensor],
                   expected: Mapping[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or extra or wrong:
        detail = []
        if missing:
            detail.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            detail.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if wrong:
            detail.append("wrong shape " + ", ".join(
                f"{k} {tuple(state[k].shape)} (expected {expected[k]})" for k in wrong[:5]))
        raise ModelFormatError(
            f"{d / WEIGHTS} does not hold the tensors of the {kind} model described by {CONFIG}: "
            + "; ".join(detail)
        )
    bad = [k for k, v in state.items() if not v.is_floating_point() or not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelFormatError(f"{d / WEIGHTS}: tensors {bad[:5]} are not finite floating-point values")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _plain(x):
    """JSON-safe copy (numpy scalars and tuples from training summaries)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str | bytes):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


__all__ = [
    "CARD", "CONFIG", "WEIGHTS", "ModelFormatError", "UnsafeModelError", "load_model", "load_p1",
    "load_p2", "models_dir", "prior_dir", "read_card", "record_trained_on", "save_model",
]
