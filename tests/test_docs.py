"""The code in README.md and docs/ must run as written: users copy it first."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


CASES = [(p.name, i, code) for p in DOCS for i, code in enumerate(_blocks(p))]


#: Examples that run flows get a Prefect test server and a fresh $GOGH_HOME.
NEEDS_PREFECT = ("gogh_placed", "refine_predictors")


@pytest.mark.parametrize("name, index, code", CASES, ids=[f"{n}[{i}]" for n, i, _ in CASES])
def test_doc_example_runs(name, index, code, request):
    if any(word in code for word in NEEDS_PREFECT):
        request.getfixturevalue("prefect_server")
        request.getfixturevalue("gogh_home")
    exec(compile(code, f"{name}[{index}]", "exec"), {"__name__": "__doc_example__"})


def test_examples_were_found():
    assert any(name == "README.md" for name, _, _ in CASES)


def test_the_predictor_tables_in_the_docs_are_the_committed_reports_own():
    """docs/predictors.md's result tables are generated from benchmarks/results/predictors_gavel.json
    (`benchmarks/predictors_eval.py docs`); a report run again without regenerating them fails here."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("predictors_eval", REPO / "benchmarks" / "predictors_eval.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = (REPO / "docs" / "predictors.md").read_text()
    assert bench.BEGIN in text and bench.END in text
    inside = text.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0].strip()
    report = json.loads((bench.RESULTS / "predictors_gavel.json").read_text())
    assert inside == bench.render(report).strip(), "run `.venv/bin/python benchmarks/predictors_eval.py docs`"
    # the report was made with the selection the docs describe: P1's encoder chosen on the inner split
    assert len(report["config"]["encoders"]) > 1 and set(report["p1_encoder"]) == set(report["families"])


def test_the_seeds_section_of_the_evaluation_is_the_committed_runs_own():
    """docs/evaluation.md's section over seeds 0-2 is written from benchmarks/results/energy_seeds.json
    (`benchmarks/energy_seeds.py`, or its `report` to rewrite it from the JSON)."""
    import importlib.util
    import json
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))  # it imports the scenarios of evaluate_policies.py
    try:
        spec = importlib.util.spec_from_file_location("energy_seeds", REPO / "benchmarks" / "energy_seeds.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    text = (REPO / "docs" / "evaluation.md").read_text()
    assert bench.BEGIN in text and bench.END in text
    inside = text.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0].strip()
    saved = json.loads((bench.OUT / "energy_seeds.json").read_text())
    lines = bench.tables(saved)
    assert inside == "\n".join(lines).strip(), "run `.venv/bin/python benchmarks/energy_seeds.py report`"
    assert saved["seeds"] == [0, 1, 2] and all(len(e["runs"]) == 3 for e in saved["scenarios"].values())
    assert saved["learned_modern"] and all(len(e["runs"]) == 3 for e in saved["learned_modern"].values())


def test_the_simulators_patience_is_the_one_chosen_on_the_selection_seeds():
    """``sim.run.WAIT_S`` (the ``+wait`` policies) is what `benchmarks/wait_tradeoff.py` chose on
    seeds 10-12, which no report uses; the evaluation's seeds never took part."""
    import json

    from gogh_flows.sim.run import WAIT_S

    saved = json.loads((REPO / "benchmarks" / "results" / "wait_tradeoff.json").read_text())
    assert WAIT_S == saved["chosen_hours"] * 3600.0, "set sim.run.WAIT_S to benchmarks/wait_tradeoff.py's choice"
    assert not set(saved["seeds"]) & {0, 1, 2} and {r["seed"] for r in saved["rows"]} == set(saved["seeds"])


def test_the_simulators_limit_levels_are_the_ones_chosen_on_the_selection_seeds():
    """``sim.run.DEFAULT_LIMIT_LEVELS`` (the ``+limits`` policies) is what `benchmarks/limit_levels.py`
    chose on seeds 10-12, which no report uses."""
    import json

    from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS

    saved = json.loads((REPO / "benchmarks" / "results" / "limit_levels.json").read_text())
    assert list(DEFAULT_LIMIT_LEVELS) == saved["chosen_levels"], "set sim.run.DEFAULT_LIMIT_LEVELS to the choice"
    assert not set(saved["seeds"]) & {0, 1, 2}


def test_the_simulators_fleet_re_solve_settings_are_the_ones_chosen_on_the_selection_seeds():
    """``sim.run.FLEET_REOPT_S`` and ``SimConfig``'s ``reopt_budget`` and ``reopt_gain`` (the ``+fleet``
    policies) are what `benchmarks/fleet_settings.py` chose on seeds 10-12, which no report uses."""
    import json

    from gogh_flows.sim.engine import SimConfig
    from gogh_flows.sim.run import FLEET_REOPT_S

    saved = json.loads((REPO / "benchmarks" / "results" / "fleet_settings.json").read_text())
    chosen = saved["candidates"][saved["chosen"]]
    assert (FLEET_REOPT_S, SimConfig().reopt_budget, SimConfig().reopt_gain) == (
        chosen["reoptimize_s"], chosen["reopt_budget"], chosen["reopt_gain"]), "set them to the choice"
    assert not set(saved["seeds"]) & {0, 1, 2} and {r["seed"] for r in saved["rows"]} == set(saved["seeds"])
