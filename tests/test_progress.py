"""Progress with an ETA: plain lines in a log, rich's bars on a terminal (gogh_flows/progress.py)."""

from __future__ import annotations

import io

from gogh_flows.progress import Progress


def test_a_log_gets_a_line_per_tenth_with_an_eta_and_no_carriage_returns():
    out = io.StringIO()
    with Progress(stream=out, min_interval_s=0) as bars:
        for done in range(0, 101):
            bars.update("oracle", done, 100)
        bars.update("greedy", 1, 1)
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    oracle = [ln for ln in lines if ln.startswith("oracle:")]
    assert len(oracle) == 10  # 10%, ..., 100%
    assert oracle[0].startswith("oracle: 10/100 (10%)") and oracle[-1].startswith("oracle: 100/100 (100%)")
    assert all("left" in ln for ln in oracle[1:-1]) and "left" not in oracle[-1]
    assert lines[-1].startswith("greedy: 1/1 (100%)")


def test_quick_work_says_only_that_it_ended():
    out = io.StringIO()
    with Progress(stream=out) as bars:
        for done in range(0, 101):
            bars.update("oracle", done, 100)
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
    assert out.getvalue().startswith("oracle: 100/100 (100%), 0:00 elapsed")


def test_a_terminal_gets_rich_bars():
    out = io.StringIO()
    with Progress(stream=out, live=True) as bars:
        for done in range(0, 51):
            bars.update("families", done, 50)
    assert "families" in out.getvalue() and "50/50" in out.getvalue()


def test_a_report_printed_into_a_pipe_keeps_its_full_width(capsys):
    """rich would squeeze a table to 80 columns outside a terminal ("violatio..."); reports keep theirs."""
    from rich.table import Table

    from gogh_flows.progress import report_console

    table = Table(*(f"a rather long header number {i}" for i in range(5)))
    table.add_row(*("x" for _ in range(5)))
    report_console().print(table)
    out = capsys.readouterr().out
    assert "a rather long header number 4" in out and max(len(line) for line in out.splitlines()) > 80
