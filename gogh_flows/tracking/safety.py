"""Weights-only check for model directories.

A gogh model is a directory of data: tensors in safetensors, configuration in JSON, and an
optional Markdown model card, and an ``MLmodel`` file naming only gogh's own pyfunc loader
(``tracking/pyfunc_flavor.py``). None of these formats can run code when read, which is the
whole point: a model registry is shared, writable storage, and a pickle planted there would
execute on every machine that places a flow. So the rule is an allow-list, checked both
before a directory is registered and after it is downloaded, and anything outside it is
refused with the file named and the reason given.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from gogh_flows.tracking.errors import UnsafeArtifactError

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "MODEL_CARD.md"
REQUIRED_FILES = (WEIGHTS_FILE, CONFIG_FILE)
ALLOWED_SUFFIXES = (".safetensors", ".json", ".md")

# Formats that are (or usually wrap) pickles: torch.save, joblib, numpy object arrays, ...
_PICKLE_SUFFIXES = {".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".joblib", ".npy", ".npz", ".dill", ".cloudpickle"}
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own upper bound


def _reason_for_suffix(path: Path) -> str:
    if path.name == "MLmodel":
        return (
            "MLflow model metadata: its flavours (pytorch, pyfunc) load the model by unpickling, "
            "so an MLmodel directory is not a weights-only gogh model"
        )
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        return f"'{path.suffix}' files are (or may wrap) pickles, which run arbitrary code when loaded"
    if path.suffix.lower() in {".py", ".pyc", ".so", ".sh", ".exe", ".dll", ".dylib"}:
        return "executable code has no place in a weights-only model"
    return f"only {', '.join(ALLOWED_SUFFIXES)} files are allowed in a weights-only model"


#: the one finding of a file-content check that is a hazard, not damage
RENAMED_PICKLE = "starts with pickle/zip magic bytes: this is a torch.save/pickle file renamed to .safetensors"


def _check_safetensors(path: Path) -> str | None:
    """Return why `path` is not a plausible safetensors file, or None if it is.

    Reading the header is cheap and catches the classic trick of renaming a pickle to
    .safetensors (the loader would also refuse it, but here the message names the file).
    """
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "too short to be a safetensors file (no 8-byte header length)"
        if head.startswith(_PICKLE_MAGIC):
            return RENAMED_PICKLE
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > _MAX_SAFETENSORS_HEADER or n > size - 8:
            return f"header length {n} does not fit the file ({size} bytes): not a safetensors file"
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "its header is not JSON: not a safetensors file"
    if not isinstance(header, dict):
        return "its header is not a JSON object: not a safetensors file"
    return None


def _check_json(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"not valid UTF-8 JSON ({exc})"
    return None


def _check_mlmodel(path: Path) -> str | None:
    """Why an ``MLmodel`` file is refused, or None: only gogh's own loader, which reads safetensors.

    MLflow loads a ``python_function`` model through the module it names; any other flavour, or
    a ``python_model`` / artifacts entry, means a pickle would be read.
    """
    import yaml

    from gogh_flows.tracking.pyfunc_flavor import LOADER_MODULE

    try:
        meta = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        return f"not a readable MLmodel file ({exc})"
    flavors = meta.get("flavors") if isinstance(meta, dict) else None
    if not isinstance(flavors, dict) or set(flavors) != {"python_function"}:
        return (f"MLmodel flavours {sorted(flavors) if isinstance(flavors, dict) else flavors!r}: only gogh's "
                f"python_function flavour ({LOADER_MODULE}) loads without unpickling")
    pf = flavors["python_function"] or {}
    if pf.get("loader_module") != LOADER_MODULE:
        return f"MLmodel loader module {pf.get('loader_module')!r} is not gogh's ({LOADER_MODULE}): it may unpickle"
    risky = sorted(k for k in ("python_model", "artifacts", "code", "cloudpickle_version") if pf.get(k))
    if risky:
        return f"MLmodel python_function entries {risky} load pickled objects or code"
    return None


def _check_registered_meta(path: Path) -> str | None:
    """MLflow writes ``registered_model_meta`` (the model's name and version) next to a registered
    version's files; plain YAML with those two keys is data."""
    import yaml

    try:
        meta = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        return f"not a readable registered_model_meta file ({exc})"
    if not isinstance(meta, dict) or not set(meta) <= {"model_name", "model_version"}:
        return "registered_model_meta holds more than MLflow's model name and version"
    return None


def _check_markdown(path: Path) -> str | None:
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    return None


def verify_weights_only(directory: Path) -> list[Path]:
    """Check that `directory` is a weights-only gogh model; return its files, sorted.

    Raises UnsafeArtifactError listing every offending entry (not just the first), so one
    look at the message tells the operator everything that must be removed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UnsafeArtifactError(f"model directory {directory} does not exist or is not a directory")
    problems: list[str] = []  # what could run code, or hide it
    damaged: list[str] = []  # allowed kinds of file that do not read as such
    files: list[Path] = []
    for entry in sorted(directory.rglob("*")):
        rel = entry.relative_to(directory)
        if entry.is_symlink():
            problems.append(f"{rel}: symbolic links are refused (they can point outside the model)")
            continue
        if entry.is_dir():
            problems.append(f"{rel}/: sub-directories are refused (a gogh model is one flat directory)")
            continue
        if not entry.is_file():
            problems.append(f"{rel}: not a regular file")
            continue
        if entry.name in ("MLmodel", "registered_model_meta") and entry.parent == directory:
            why = _check_mlmodel(entry) if entry.name == "MLmodel" else _check_registered_meta(entry)
            if why is None:
                files.append(entry)
            else:
                problems.append(f"{rel}: refused, {why}")
            continue
        if entry.suffix.lower() not in ALLOWED_SUFFIXES:
            problems.append(f"{rel}: refused, {_reason_for_suffix(entry)}")
            continue
        if entry.suffix.lower() == ".safetensors":
            why = _check_safetensors(entry)
        elif entry.suffix.lower() == ".json":
            why = _check_json(entry)
        else:
            why = _check_markdown(entry)
        if why:  # a pickle in disguise is unsafe; anything else that does not parse, damaged
            (problems if why == RENAMED_PICKLE else damaged).append(f"{rel}: refused, {why}")
            continue
        files.append(entry)
    present = {f.name for f in files if f.parent == directory}
    for required in REQUIRED_FILES:
        if required not in present and not any(p.startswith(f"{required}:") for p in problems + damaged):
            damaged.append(f"{required}: missing (a gogh model needs {' and '.join(REQUIRED_FILES)})")
    if problems:
        raise UnsafeArtifactError(
            f"model directory {directory} is not weights-only; refusing it:\n  - "
            + "\n  - ".join(problems + damaged)
            + "\nSave models with gogh_flows.predict.io.save_model (safetensors + JSON), never pickle."
        )
    if damaged:  # files of the right kinds, cut short or corrupted: nothing unsafe, nothing to load either
        raise UnsafeArtifactError(
            f"model directory {directory} is damaged or incomplete; refusing it:\n  - " + "\n  - ".join(damaged)
            + "\nCopy it again, or save it again with gogh_flows.predict.io.save_model (gogh predictors train)."
        )
    return files
