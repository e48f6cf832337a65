"""Trace readers, generators and requirement assignment (sim.traces)."""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gogh_flows.sim.traces import (
    TraceFormatError,
    TraceJob,
    assign_requirements,
    generate_arrivals,
    list_traces,
    load_philly_distribution,
    read_trace,
)

GOOD10 = "ResNet-18 (batch size 32)\tpython3 main.py\tcifar10\t--num_steps\t1\t1000\t{sf}\t1\t-1.000000\t{t}"
GOOD7 = "LM (batch size 20)\tcd %s && python3 main.py\t--steps\t1\t5000\t{t}\t{sf}"
TYPES = ["A", "B", "C"]


def _write(tmp_path: Path, lines: list[str], name: str = "x.trace") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _small_dist() -> pl.DataFrame:
    return pl.DataFrame({"duration_s": [100.0, 200.0, 400.0, 800.0],
                         "num_gpus": [1, 2, 8, 16]})


def _tput(job_type: str, gpus: int) -> float:
    """Made-up rates: C does not run on more than one GPU."""
    if job_type == "C" and gpus > 1:
        return 0.0
    return {"A": 2.0, "B": 0.5, "C": 3.0}[job_type] * gpus


# ------------------------------------------------------------------ Gavel traces


@pytest.mark.gavel
def test_max_min_fairness_trace(gavel_dir: Path) -> None:
    jobs = read_trace(gavel_dir / "traces/physical_cluster/max_min_fairness.trace")
    assert len(jobs) == 96
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0.0 and arrivals[-1] == 46_317.0
    assert {j.id for j in jobs} == {f"j{i}" for i in range(96)}
    assert all(j.total_steps > 0 and j.priority == 1.0 and j.slo_s is None for j in jobs)
    assert all(j.required_throughput is None and j.duration_s is None for j in jobs)


@pytest.mark.gavel
def test_minimize_makespan_trace(gavel_dir: Path) -> None:
    path = gavel_dir / "traces/physical_cluster/minimize_makespan.trace"
    jobs = read_trace(path)
    assert len(jobs) == 100
    assert all(j.arrival_s == 0.0 for j in jobs)
    assert collections.Counter(j.num_gpus for j in jobs) == {1: 71, 2: 6, 4: 23}
    # all arrive at once: sorting keeps file order, so ids stay in order
    assert [j.id for j in jobs] == [f"j{i}" for i in range(100)]
    first = path.read_text(encoding="utf-8").splitlines()[0].split("\t")
    assert jobs[0].job_type == first[0] and jobs[0].total_steps == float(first[5])


@pytest.mark.gavel
def test_msr_trace_old_format_and_max_gpus(gavel_dir: Path) -> None:
    files = list_traces(gavel_dir / "traces/msr/seed=0")
    assert len(files) == 15 and files == sorted(files)
    largest = max(files, key=lambda p: p.stat().st_size)
    lines = [ln for ln in largest.read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert all(len(ln.split("\t")) == 7 for ln in lines)
    jobs = read_trace(largest)
    assert len(jobs) == len(lines)
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    wide = sum(j.num_gpus > 8 for j in jobs)
    assert wide > 0  # the largest VC trace has jobs up to 32 GPUs, kept by default
    with pytest.warns(UserWarning, match=rf"{re.escape(largest.name)}: dropped {wide} of {len(lines)} jobs"):
        kept = read_trace(largest, max_gpus=8)
    assert len(kept) == len(lines) - wide and all(j.num_gpus <= 8 for j in kept)


@pytest.mark.gavel
def test_list_traces_recursive(gavel_dir: Path) -> None:
    files = list_traces(gavel_dir / "traces")
    assert len(files) == 15 + 8 and all(p.suffix == ".trace" for p in files)


def test_list_traces_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError, match="nope"):
        list_traces(tmp_path / "nope")


# ------------------------------------------------------------------ small files


def test_reads_both_formats_and_sorts(tmp_path: Path) -> None:
    p10 = _write(tmp_path, [GOOD10.format(sf=2, t=50), "", GOOD10.format(sf=1, t=10),
                            GOOD10.format(sf=4, t=10).replace("-1.000000", "3600")], "a.trace")
    jobs = read_trace(p10)
    assert [j.id for j in jobs] == ["j1", "j2", "j0"]  # stable for the tie at t=10
    assert [j.num_gpus for j in jobs] == [1, 4, 2]
    assert jobs[1].slo_s == 3600.0 and jobs[0].slo_s is None
    p7 = _write(tmp_path, [GOOD7.format(t="7.000000", sf=64), GOOD7.format(t="0.000000", sf=1)], "b.trace")
    jobs = read_trace(p7)
    assert [(j.id, j.num_gpus, j.total_steps, j.priority) for j in jobs] == [
        ("j1", 1, 5000.0, 1.0), ("j0", 64, 5000.0, 1.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped -> no warning
        assert len(read_trace(p7, max_gpus=64)) == 2


def test_empty_file_has_no_jobs(tmp_path: Path) -> None:
    assert read_trace(_write(tmp_path, ["", "  "])) == []


@pytest.mark.parametrize(
    ("third", "line", "why"),
    [
        (GOOD10.format(sf=1, t=0).rsplit("\t", 1)[0], 3, "expected 10 tab-separated fields"),
        (GOOD10.format(sf=1, t=0).replace("\t1000\t", "\t-5\t"), 3, "total_steps must be > 0"),
        (GOOD10.format(sf=1, t=0).replace("\t1000\t", "\t0\t"), 3, "total_steps must be > 0"),
        (GOOD10.format(sf=1, t=0).replace("\t1000\t", "\tmany\t"), 3, "total_steps must be a number"),
        (GOOD10.format(sf=1, t="soon"), 3, "arrival_time_seconds must be a number"),
        (GOOD10.format(sf=1, t=-1), 3, "arrival_time_seconds must be >= 0"),
        (GOOD10.format(sf=0, t=0), 3, "scale_factor must be an integer >= 1"),
        (GOOD10.format(sf=1.5, t=0), 3, "scale_factor must be an integer >= 1"),
        (GOOD10.format(sf=1, t="nan"), 3, "must be finite"),
        ("\t" + GOOD10.format(sf=1, t=0).split("\t", 1)[1], 3, "empty job_type"),
        (GOOD7.format(t=0, sf=1), 3, r"expected 10 .*\(Gavel current format\), got 7"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, third: str, line: int, why: str) -> None:
    path = _write(tmp_path, [GOOD10.format(sf=1, t=0), GOOD10.format(sf=2, t=5), third])
    with pytest.raises(TraceFormatError, match=why) as err:
        read_trace(path)
    assert f"{path}:{line}:" in str(err.value) and "x.trace" in str(err.value)


def test_malformed_old_format_and_first_line(tmp_path: Path) -> None:
    path = _write(tmp_path, ["", GOOD7.format(t=0, sf=1), GOOD10.format(sf=1, t=0)])
    with pytest.raises(TraceFormatError, match=r"x\.trace:3: expected 7 .*MSR.*got 10"):
        read_trace(path)
    path = _write(tmp_path, ["", "only\tthree\tfields"])
    with pytest.raises(TraceFormatError, match=r"x\.trace:2: expected 10 .* or 7 .*got 3"):
        read_trace(path)
    path = _write(tmp_path, [GOOD7.format(t=0, sf=1).replace("\t1\t5000", "\tyes\t5000")])
    with pytest.raises(TraceFormatError, match=r"x\.trace:1: needs_data_dir must be 0 or 1"):
        read_trace(path)


def test_read_trace_rejects_bad_max_gpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_gpus"):
        read_trace(_write(tmp_path, [GOOD7.format(t=0, sf=1)]), max_gpus=0)


# ------------------------------------------------------------------ generators


@pytest.mark.gavel
def test_philly_distribution(gavel_dir: Path) -> None:
    dist = load_philly_distribution(gavel_dir / "traces/philly_job_distribution.csv")
    assert dist.height == 33_192
    assert dist.schema == pl.Schema({"duration_s": pl.Float64, "num_gpus": pl.Int64})
    counts = dict(dist["num_gpus"].value_counts().iter_rows())
    assert counts == {1: 25_304, 2: 665, 4: 3_076, 8: 4_147}
    assert dist["duration_s"].min() >= 3_600


def test_philly_distribution_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("duration,num_gpus\n10,1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.csv.*duration_s"):
        load_philly_distribution(path)
    path.write_text("duration_s,num_gpus\n10,one\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.csv"):
        load_philly_distribution(path)


@pytest.mark.gavel
def test_generate_arrivals_philly(gavel_dir: Path) -> None:
    dist = load_philly_distribution(gavel_dir / "traces/philly_job_distribution.csv")
    kw = {"rate_per_hour": 6.0, "job_types": TYPES, "distribution": dist, "throughput_of": _tput}
    jobs = generate_arrivals(2000, seed=1, **kw)
    assert jobs == generate_arrivals(2000, seed=1, **kw)
    assert jobs != generate_arrivals(2000, seed=2, **kw)
    arrivals = np.array([j.arrival_s for j in jobs])
    assert arrivals[0] > 0 and np.all(np.diff(arrivals) >= 0)
    mean_gap = arrivals[-1] / len(jobs)  # first arrival is the first gap
    assert abs(mean_gap - 600.0) < 60.0
    assert {j.num_gpus for j in jobs} <= {1, 2, 4, 8}
    assert all(j.total_steps == pytest.approx(j.duration_s * _tput(j.job_type, j.num_gpus)) for j in jobs)
    assert all(j.job_type != "C" for j in jobs if j.num_gpus > 1)  # zero rate -> redrawn
    assert {j.job_type for j in jobs} == set(TYPES)
    assert [j.id for j in jobs] == [f"j{i}" for i in range(2000)]


def test_generate_arrivals_defaults_and_max_gpus() -> None:
    jobs = generate_arrivals(300, rate_per_hour=1.0, job_types=["A"], distribution=_small_dist(),
                             seed=0, max_gpus=2)
    assert {j.num_gpus for j in jobs} == {1, 2}  # 8 and 16 excluded
    assert all(j.total_steps == j.duration_s for j in jobs)  # 1 step/s without throughput_of


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"rate_per_hour": 0.0}, "rate_per_hour"),
        ({"rate_per_hour": float("nan")}, "rate_per_hour"),
        ({"job_types": []}, "job_types"),
        ({"job_types": "A"}, "job_types"),
        ({"max_gpus": 0}, "max_gpus"),
        ({"distribution": pl.DataFrame({"duration_s": [1.0]})}, "num_gpus"),
        ({"distribution": _small_dist().filter(pl.col("num_gpus") > 8)}, "max_gpus"),
        ({"job_types": ["C"], "throughput_of": _tput}, "job_types"),
    ],
)
def test_generate_arrivals_bad_arguments(kwargs: dict, name: str) -> None:
    base = {"n": 5, "rate_per_hour": 2.0, "job_types": TYPES, "distribution": _small_dist(), "seed": 0}
    args = base | kwargs
    with pytest.raises(ValueError, match=name):
        generate_arrivals(**args)


# ------------------------------------------------------------------ requirements


def _jobs() -> list[TraceJob]:
    return generate_arrivals(200, rate_per_hour=10.0, job_types=TYPES, distribution=_small_dist(),
                             seed=3, throughput_of=_tput)


def test_assign_requirements_within_bounds_and_deterministic() -> None:
    jobs = _jobs()
    out = assign_requirements(jobs, _tput, seed=7, q_low=0.3, q_high=0.6)
    assert out == assign_requirements(jobs, _tput, seed=7, q_low=0.3, q_high=0.6)
    assert out != assign_requirements(jobs, _tput, seed=8, q_low=0.3, q_high=0.6)
    assert all(j.required_throughput is None for j in jobs)  # inputs untouched
    for before, after in zip(jobs, out, strict=True):
        best = _tput(before.job_type, before.num_gpus)
        assert 0.3 * best <= after.required_throughput <= 0.6 * best
        assert dataclasses.replace(after, required_throughput=None) == before
    fixed = assign_requirements(jobs, _tput, seed=0, q_low=0.5, q_high=0.5)
    assert all(j.required_throughput == 0.5 * _tput(j.job_type, j.num_gpus) for j in fixed)


def test_assign_requirements_zero_best_throughput() -> None:
    job = TraceJob("j42", "C", 10.0, 2, 0.0)
    with pytest.raises(ValueError, match=r"'j42'.*'C'"):
        assign_requirements([job], _tput, seed=0)


@pytest.mark.parametrize(("q_low", "q_high"), [(0.0, 0.5), (0.6, 0.5), (0.2, 1.5), (-0.1, 0.5)])
def test_assign_requirements_bad_quantiles(q_low: float, q_high: float) -> None:
    with pytest.raises(ValueError, match="q_low"):
        assign_requirements(_jobs(), _tput, seed=0, q_low=q_low, q_high=q_high)
