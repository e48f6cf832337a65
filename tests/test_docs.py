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
