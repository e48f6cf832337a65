"""The placement ledger never overbooks a GPU, from threads or from processes."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gogh_flows.runtime.ledger import LedgerError, PlacementLedger

GPUS = [f"{t}-{i}" for t in ("v100", "t4", "k80") for i in range(2)]  # 6 GPUs
CAPACITY = 2


def _reserve(ledger: PlacementLedger, run_id: str, gpu_id: str) -> bool:
    return ledger.reserve(run_id, gpu_id, "resnet", CAPACITY, required_throughput=10.0, work=100.0)


def _check_capacity(ledger: PlacementLedger) -> dict[str, int]:
    counts = {g: len(rs) for g, rs in ledger.occupants().items()}
    assert all(n <= CAPACITY for n in counts.values()), counts
    return counts


def test_reserve_release_and_occupants(tmp_path: Path):
    ledger = PlacementLedger(tmp_path / "ledger.db")
    assert _reserve(ledger, "r1", "v100-0")
    assert _reserve(ledger, "r1", "v100-0")  # a retried task: idempotent
    assert ledger.reserve("r2", "v100-0", "bert", 2, required_throughput=3.5, work=7)
    assert not _reserve(ledger, "r3", "v100-0")  # full
    occ = ledger.occupants()["v100-0"]
    assert [(r.run_id, r.job_type, r.required_throughput, r.work) for r in occ] == [
        ("r1", "resnet", 10.0, 100.0), ("r2", "bert", 3.5, 7.0)]
    with pytest.raises(LedgerError, match="already holds.*release it"):
        _reserve(ledger, "r1", "t4-0")
    ledger.release("r1")
    ledger.release("never-reserved")
    assert _reserve(ledger, "r3", "v100-0")
    assert {r.run_id for r in ledger.occupants()["v100-0"]} == {"r2", "r3"}
    # A second handle on the same file sees the same state (it is the file that is shared).
    assert {r.run_id for r in PlacementLedger(tmp_path / "ledger.db").occupants()["v100-0"]} == {"r2", "r3"}
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_gang_reservation_is_all_or_nothing(tmp_path: Path):
    ledger = PlacementLedger(tmp_path / "ledger.db")
    assert ledger.reserve("solo", "t4-1", "x", 1, required_throughput=1, work=1)
    assert not ledger.reserve_gang("gang", ["t4-0", "t4-1"], "x", 1, required_throughput=1, work=1)
    assert "t4-0" not in ledger.occupants()
    assert ledger.reserve_gang("gang", ["t4-0", "k80-0"], "x", {"t4-0": 1, "k80-0": 2},
                               required_throughput=1, work=1)
    ledger.release("gang")
    assert set(ledger.occupants()) == {"t4-1"}


def test_expire_drops_stale_reservations_but_not_touched_ones(tmp_path: Path):
    ledger = PlacementLedger(tmp_path / "ledger.db")
    _reserve(ledger, "crashed", "k80-0")
    _reserve(ledger, "alive", "k80-1")
    with sqlite3.connect(tmp_path / "ledger.db") as conn:  # both were reserved an hour ago
        conn.execute("UPDATE reservations SET started_at = started_at - 3600, seen_at = seen_at - 3600")
    assert ledger.touch("alive") and not ledger.touch("unknown")
    assert ledger.expire(600) == 1
    assert [r.run_id for rs in ledger.occupants().values() for r in rs] == ["alive"]
    assert ledger.expire(600) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"run_id": ""}, "run_id"), ({"gpu_id": ""}, "gpu ids"), ({"job_type": ""}, "job_type"),
    ({"capacity": 0}, "capacity"), ({"required_throughput": -1}, "required_throughput"),
    ({"work": float("nan")}, "work"),
])
def test_bad_requests_are_refused(tmp_path: Path, kwargs, match):
    args = {"run_id": "r", "gpu_id": "v100-0", "job_type": "x", "capacity": 2,
            "required_throughput": 1.0, "work": 1.0, **kwargs}
    ledger = PlacementLedger(tmp_path / "ledger.db")
    with pytest.raises(ValueError, match=match):
        ledger.reserve(args.pop("run_id"), args.pop("gpu_id"), args.pop("job_type"), args.pop("capacity"), **args)
    with pytest.raises(ValueError, match="older_than_s"):
        ledger.expire(-1)


def _race(ledger: PlacementLedger, attempts: list[tuple[str, str]], start: threading.Barrier) -> list[bool]:
    results: list[bool] = [False] * len(attempts)

    def one(i: int) -> None:
        start.wait()
        results[i] = _reserve(ledger, *attempts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(attempts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_forty_concurrent_thread_reservations_never_exceed_capacity(tmp_path: Path):
    ledger = PlacementLedger(tmp_path / "ledger.db")
    attempts = [(f"run-{i}", GPUS[i % len(GPUS)]) for i in range(40)]  # >= 6 tries per GPU
    results = _race(ledger, attempts, threading.Barrier(40))
    counts = _check_capacity(ledger)
    # Every GPU saw more attempts than slots, so every slot is taken exactly once.
    assert counts == {g: CAPACITY for g in GPUS}
    assert sum(results) == len(GPUS) * CAPACITY


def _process_attempts(args: tuple[str, int, float]) -> int:
    path, seed, start_at = args
    ledger = PlacementLedger(path)
    while time.time() < start_at:  # start together with the parent's threads
        time.sleep(0.001)
    won = 0
    for k in range(6):
        won += _reserve(ledger, f"proc-{seed}-{k}", GPUS[(seed + k) % len(GPUS)])
    return won


def test_threads_and_processes_racing_never_exceed_capacity(tmp_path: Path):
    path = tmp_path / "ledger.db"
    ledger = PlacementLedger(path)
    ctx = multiprocessing.get_context("fork")  # cheap; the children only use sqlite3
    start_at = time.time() + 1.0
    with ctx.Pool(3) as procs:
        pending = procs.map_async(_process_attempts, [(str(path), s, start_at) for s in range(3)])
        while time.time() < start_at:
            time.sleep(0.001)
        attempts = [(f"thread-{i}", GPUS[i % len(GPUS)]) for i in range(22)]
        thread_wins = sum(_race(ledger, attempts, threading.Barrier(len(attempts))))
        process_wins = sum(pending.get(timeout=60))
    counts = _check_capacity(ledger)
    assert counts == {g: CAPACITY for g in GPUS}
    assert thread_wins + process_wins == len(GPUS) * CAPACITY
