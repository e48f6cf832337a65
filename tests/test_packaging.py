"""What a wheel holds: the package, the shipped models and example blocks (a packaging review
found a wheel without models/, on which every placement and the demo failed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_of_the_source_tree():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gogh_flows").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_the_wheel_holds_the_shipped_models_and_blocks_and_finds_them_installed(tmp_path):
    # built from a copy: a build writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("gogh_flows", "models", "blocks"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("gogh_flows-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in (ROOT / "models").rglob("*"):
        if model.is_file():
            assert f"gogh_flows/shipped/models/{model.relative_to(ROOT / 'models').as_posix()}" in names, model
    for block in (ROOT / "blocks").glob("*.json"):
        assert f"gogh_flows/shipped/blocks/{block.name}" in names, block
    assert "gogh_flows/power_model.json" in names and "gogh_flows/power_limit_model.json" in names
    # unpacked where no checkout is above it, the package finds its models and blocks inside itself
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # another distribution's top-level models/ and blocks/ packages beside it are not its own (a review)
    for foreign in ("models", "blocks"):
        (site / foreign).mkdir()
        (site / foreign / "__init__.py").write_text("")
    code = ("import gogh_flows.predict.io as io, gogh_flows.flows.blocks as b; "
            "print(io.models_dir()); print(b.REPO_BLOCKS); print(io.prior_dir('synthetic'))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    models, blocks, prior = shown.stdout.split()
    assert models == str(site / "gogh_flows" / "shipped" / "models")
    assert blocks == str(site / "gogh_flows" / "shipped" / "blocks")
    assert (Path(prior) / "p1" / "config.json").is_file()
