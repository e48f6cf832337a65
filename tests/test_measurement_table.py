"""The measurement table's folder layout: O(1) appends, merges, crashes half-way, many writers at once."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from gogh_flows.tracking.measurements import LEGACY_TABLE, SCHEMA, Measurement, MeasurementLog, read_measurements
from gogh_flows.tracking.table import MeasurementTable
from together import run_threads_beside


def row(i: int, key: str | None = None, **over) -> dict:
    m = Measurement(
        run_id=f"run-{i}", flow_name="train", job_type="ResNet-18 (batch size 64)", family="ResNet-18", batch_size=64,
        gpu_id=f"gpu-{i % 4}", gpu_type="v100", device="cuda:0", partners=(), required_throughput=1.0,
        predicted_throughput=2.0, steps=10.0, duration_s=1.0, throughput=10.0, mean_power_w=200.0, energy_j=200.0,
        status="completed", telemetry="emulated", started_at=1.7e9 + i,
    )
    out = {**m.to_row(), "logged_at": time.time(), **over}
    if key is not None:
        out["key"] = key
    return out


def small(tmp_path: Path, **kw) -> MeasurementTable:
    return MeasurementTable(tmp_path / "table", SCHEMA, parts_per_segment=kw.pop("parts", 4), fanout=kw.pop("fanout", 2),
                            **kw)


def test_append_read_and_retried_key(tmp_path):
    table = small(tmp_path, parts=1000)
    assert table.append(row(1)) and table.append(row(2))
    assert not table.append(row(1))  # a retried log adds nothing
    frame = table.read()
    assert sorted(frame["key"].to_list()) == ["run-1:gpu-1", "run-2:gpu-2"]
    assert frame.schema == pl.Schema(SCHEMA)


def test_merges_keep_every_row_once_and_bound_the_files(tmp_path):
    table = small(tmp_path)
    for i in range(100):
        assert table.append(row(i))
    frame = table.read()
    assert frame.height == 100 and frame["key"].n_unique() == 100
    # 100 rows in parts of 4 and a fan-out of 2: a handful of segments, fewer than 4 loose parts
    assert len(list(table.parts_dir.glob("*.parquet"))) < 4
    assert len(list(table.segments_dir.glob("*.parquet"))) <= 8
    assert not table.append(row(7))  # a key merged long ago is still known


def test_crash_between_part_and_claim_neither_drops_nor_doubles(tmp_path):
    table = small(tmp_path, parts=1000)
    # a writer died after its part landed and before it claimed the key
    MeasurementTable._write(pl.DataFrame([row(5)], schema=SCHEMA), table.parts_dir, "00000000000000000001-dead")
    assert table.read().height == 1  # the row is there (never dropped)
    assert table.append(row(5))  # the retry logs it again ...
    assert table.read().height == 1  # ... and readers keep one
    assert not table.append(row(5))


def test_keys_that_cannot_be_written_leave_no_part_behind(tmp_path, monkeypatch):
    """The row's file is removed when its key cannot be claimed (a full or read-only disk): a
    caller retrying until the disk recovers must not leave a part file per try."""
    table = small(tmp_path, parts=1000)

    def refuse(key):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(table, "_claim", refuse)
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            table.append(row(1))
    assert not list(table.parts_dir.glob("*")) and table.read().height == 0
    monkeypatch.undo()
    assert table.append(row(1)) and table.read().height == 1


def test_crash_between_merge_and_delete_neither_drops_nor_doubles(tmp_path):
    table = small(tmp_path, parts=1000)
    for i in range(6):
        table.append(row(i))
    parts = sorted(table.parts_dir.glob("*.parquet"))
    # a merge wrote its segment and died before deleting its inputs
    merged = MeasurementTable._read_files(parts, SCHEMA)
    MeasurementTable._write(merged, table.segments_dir, "L00-00000000000000000001-crashed")
    assert table.read().height == 6
    table.compact()
    assert table.read().height == 6 and not list(table.parts_dir.glob("*.parquet"))


def test_older_files_without_new_columns_are_read(tmp_path):
    table = small(tmp_path, parts=1000)
    old = pl.DataFrame([row(1)], schema=SCHEMA).drop("run_energy_j", "startup_s")
    old.write_parquet(table.segments_dir / "L00-00000000000000000001-old.parquet")
    table.append(row(2))
    frame = table.read()
    assert frame.height == 2 and frame.columns == list(SCHEMA)
    assert frame.filter(pl.col("run_id") == "run-1")["run_energy_j"].to_list() == [None]


def test_a_one_file_table_of_an_earlier_version_is_taken_in(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    legacy = pl.DataFrame([row(i) for i in range(3)], schema=SCHEMA).drop("window")
    (tmp_path / "m").mkdir()
    legacy.write_parquet(tmp_path / "m" / LEGACY_TABLE)
    assert read_measurements(tmp_path / "m").height == 3  # readable before any log opens it
    log = MeasurementLog(uri, tmp_path / "m")
    assert log.read().height == 3
    assert not (tmp_path / "m" / LEGACY_TABLE).exists() and (tmp_path / "m" / f"{LEGACY_TABLE}.migrated").exists()
    assert not log.table.append(row(1))  # its keys are known: nothing logged twice
    assert log.table.append(row(9))
    assert read_measurements(tmp_path / "m").height == 4
    assert read_measurements(log.table_path).height == 4


def test_read_measurements_says_what_it_expects(tmp_path):
    with pytest.raises(FileNotFoundError, match="MeasurementLog's root"):
        read_measurements(tmp_path / "nowhere")


def _append_from_process(root: str, start: int, count: int, shared_key: str) -> None:
    table = MeasurementTable(Path(root), SCHEMA, parts_per_segment=4, fanout=2)
    for i in range(start, start + count):
        table.append(row(i))
        table.append(row(i, key=shared_key))


def test_a_reader_that_keeps_losing_to_merges_reads_with_merges_held_off(tmp_path, monkeypatch):
    """Readers race merges optimistically; one that loses every time (a loaded machine) is not
    starved: it takes the merge lock, so a merge started meanwhile waits, and it reads every row."""
    import gogh_flows.tracking.table as table_module

    table = small(tmp_path, parts=1000)
    for i in range(10):
        table.append(row(i))
    real = table_module._read_once
    lost = 0
    merged_beside: list[bool] = []

    def unlucky(root, schema):
        nonlocal lost
        if lost < table_module._OPTIMISTIC_READS:
            lost += 1
            return None  # as if a merge landed under this read
        beside = threading.Thread(target=lambda: merged_beside.append(table.compact(blocking=False)))
        beside.start()
        beside.join()
        return real(root, schema)

    monkeypatch.setattr(table_module, "_read_once", unlucky)
    assert table.read().height == 10
    assert merged_beside == [False]  # the merge found the reader holding the lock
    assert table.compact(blocking=False)  # and may merge once the reader is done


def test_threads_and_processes_appending_and_merging_at_once(tmp_path):
    """Writers in 2 processes and 8 threads, merging every 4 parts, a reader throughout:
    every row once, the shared key exactly once, no reader ever sees fewer rows than before."""
    table = small(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_from_process, args=(str(table.root), 1000 * (p + 1), 25, "shared:gpu"))
             for p in range(2)]
    won: list[bool] = []
    errors: list[BaseException] = []
    seen: list[int] = []
    stop = threading.Event()

    def writer(t: int) -> None:
        try:
            for i in range(t * 100, t * 100 + 25):
                table.append(row(i))
                won.append(table.append(row(i, key="shared:gpu")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(table.read().height)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    watcher = threading.Thread(target=reader)
    watcher.start()
    for p in procs:
        p.start()
    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    run_threads_beside(threads, procs)
    stop.set()
    watcher.join()
    assert not errors
    frame = table.read()
    assert frame.height == 8 * 25 + 2 * 25 + 1
    assert frame["key"].n_unique() == frame.height
    assert sum(map(bool, won)) <= 1  # the processes may have claimed the shared key first
    assert seen == sorted(seen) and len(seen) > 1


def test_a_merge_whose_listed_part_is_removed_by_a_losing_appender_merges_the_rest(tmp_path, monkeypatch):
    """An appender that lost its key's claim removes its own part outside the merge lock; a merge
    that listed it goes on without it (its row is the winner's) instead of failing."""
    table = small(tmp_path, parts=1000)
    for i in range(5):
        table.append(row(i))
    loser = MeasurementTable._write(pl.DataFrame([row(0)], schema=SCHEMA), table.parts_dir, "99999999999999999999-loser")
    real = MeasurementTable._read_files
    calls = []

    def read_after_the_loser_left(files, schema):
        if not calls:
            loser.unlink()  # between the merge's listing and its read
        calls.append(len(files))
        return real(files, schema)

    monkeypatch.setattr(MeasurementTable, "_read_files", staticmethod(read_after_the_loser_left))
    assert table.compact()
    assert calls[0] == 6 and calls[1] == 5  # tried with the loser's part, then without it
    monkeypatch.undo()
    assert sorted(table.read()["key"].to_list()) == sorted(f"run-{i}:gpu-{i % 4}" for i in range(5))


def _supersede_from_process(root: str, key: str, out) -> None:
    table = MeasurementTable(Path(root), SCHEMA, parts_per_segment=4, fanout=2)
    out.put(table.append(row(1, key=key, steps=40.0)))


def test_a_provisional_row_yields_once_to_the_runs_own_record_whoever_writes_it_first(tmp_path):
    """A run given up on a silent scheduler is logged by its placing process with nothing measured
    (telemetry "none"); its worker's record of the same run, delivered later, replaces it. Two
    processes and four threads deliver that record at once: it is added exactly once, it is what
    readers and merges keep, and a provisional row arriving after it (or again) adds nothing."""
    table = small(tmp_path)
    given_up = row(1, key="run-1:gpu-1", steps=0.0, telemetry="none", throughput=0.0, status="failed")
    assert table.append(given_up) == "added" and not table.settled("run-1:gpu-1")
    assert table.append(given_up) is None  # a retried provisional log adds nothing
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_supersede_from_process, args=(str(table.root), "run-1:gpu-1", queue)) for _ in range(2)]
    for p in procs:
        p.start()
    won: list[str | None] = []
    threads = [threading.Thread(target=lambda: won.append(table.append(row(1, key="run-1:gpu-1", steps=40.0))))
               for _ in range(4)]
    run_threads_beside(threads, procs)
    won += [queue.get(timeout=10) for _ in procs]
    assert sorted(map(str, won)) == ["None"] * 5 + ["superseded"]
    assert table.settled("run-1:gpu-1")
    assert table.append(given_up) is None
    for step in ("before a merge", "after it"):
        frame = table.read()
        assert frame.height == 1 and frame["steps"].to_list() == [40.0], step
        assert frame["telemetry"].to_list() == ["emulated"], step
        table.compact()
    # the other order: the worker's record first, the placing process's own later, adds nothing
    assert table.append(row(2, key="run-2:gpu-2", steps=30.0)) == "added"
    assert table.append(row(2, key="run-2:gpu-2", steps=0.0, telemetry="none")) is None
    assert table.read().filter(pl.col("key") == "run-2:gpu-2")["steps"].to_list() == [30.0]


def test_the_log_replaces_a_provisional_mlflow_run_too_and_pulls_the_replacement(tmp_path):
    """MLflow keeps one run per measurement: the provisional one is deleted when the worker's
    record is logged, and another host's table that pulled the provisional one takes the
    replacement on its next pull."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    log = MeasurementLog(uri, tmp_path / "a")
    other = MeasurementLog(uri, tmp_path / "b")
    given_up = Measurement.from_row({**row(1, key=None, steps=0.0, telemetry="none", throughput=0.0,
                                           status="failed")})
    measured = Measurement.from_row({**row(1, steps=40.0, status="failed")})
    assert given_up.key == measured.key
    log.log(given_up)
    assert other.pull() == 1 and other.read()["telemetry"].to_list() == ["none"]
    log.log(measured)
    log.log(measured)  # delivered again: nothing more
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(log.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`gogh.measurement_key` = '{measured.key}'")
    assert [r.data.tags["gogh.telemetry"] for r in runs] == ["emulated"]
    assert [r.data.metrics["steps"] for r in runs] == [40.0]
    assert log.read()["steps"].to_list() == [40.0]
    assert other.pull() == 1 and other.read()["steps"].to_list() == [40.0]
    assert other.pull() == 0


def test_appends_past_a_damaged_part_merge_the_rest_and_name_it(tmp_path, caplog):
    """A part damaged outside gogh made every merge fail, and from the merge-triggering append on
    each append raised: the measurement's row was in, its key claimed, yet log() neither wrote
    it to MLflow nor spooled it (a review). The merge leaves the file out, and names it."""
    import logging

    import polars as pl

    from gogh_flows.tracking.table import MeasurementTable

    schema = {"key": pl.String, "logged_at": pl.Float64, "value": pl.Float64}
    table = MeasurementTable(tmp_path / "t", schema, parts_per_segment=4, fanout=4)
    table.append({"key": "k0", "logged_at": 0.0, "value": 0.0})
    [good] = list(table.parts_dir.glob("*.parquet"))
    damaged = table.parts_dir / "00000000000000000000-damaged.parquet"
    damaged.write_bytes(good.read_bytes()[:40])
    with caplog.at_level(logging.WARNING):
        for i in range(1, 9):
            assert table.append({"key": f"k{i}", "logged_at": float(i), "value": float(i)}) == "added"
    assert "cannot be read, left out of its merges" in caplog.text and "damaged.parquet" in caplog.text
    assert damaged.exists() and len(list(table.segments_dir.glob("*.parquet"))) >= 1
    damaged.unlink()  # what the message says to do
    assert sorted(table.read()["key"].to_list()) == [f"k{i}" for i in range(9)]
