import json

from gogh_flows.cli import main


def test_bench_placement_writes_the_three_figures(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "placement", "--gpus", "32", "--running", "40", "--arrivals", "4",
               "--repeat", "3", "--seed", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"p50_ms", "p99_ms", "max_gap"} <= set(data)
    assert 0 < data["p50_ms"] <= data["p99_ms"]
    assert 0 <= data["max_gap"] <= 0.01
    assert json.loads(capsys.readouterr().out) == data


def test_demo_prints_explanations_and_every_policy(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for name in ("optimizer", "first-fit", "random", "greedy-fastest", "greedy-min-power", "greedy-efficiency"):
        assert name in out
    assert "runner_up" in out


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["bench", "placement", "--gpus", "0"]) == 2
    assert "num_gpus must be >= 1" in capsys.readouterr().err
