"""Smoke test of benchmarks/bench_eplb_sim.py (a small run at EP 8 and 64) and the committed
results: ours at or below the baseline on the traffic planned from, and the target rows."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_eplb_sim as sim

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eplb_sim.json"


def test_small_run_rows_and_targets():
    table = sim.rows(256, sim.WINDOW + sim.REBALANCE_EVERY + 1, 0, eps=(8, 64))
    got = {(r["scenario"], r["ep"], r["redundant"]) for r in table}
    assert ("zero", 64, 64) in got and ("zero", 64, 32) not in got  # 288 % 64 != 0
    assert len(got) == len(sim.SCENARIOS) * (5 + 2)
    for r in table:
        assert r["planned"]["ours"] <= r["planned"]["baseline"] * (1 + 1e-9), r
        assert r["layer_us"]["ours"] <= r["layer_us"]["none"] * 1.2 or r["scenario"] == "shift"
    by = {(r["scenario"], r["ep"], r["redundant"]): r for r in table}
    assert by["zero", 64, 64]["planned"]["ours"] == pytest.approx(1.0)
    assert by["zero", 64, 64]["planned"]["baseline"] >= 2.0
    assert by["zipf1.0", 64, 64]["planned"]["ours"] <= 1.10
    assert set(by["shift", 8, 8]["moves_per_rebalance"]) == {"none", "baseline", "ours"}


def test_layer_time_interpolates_and_extends():
    slots, us, source = sim.layer_time_points()
    assert slots.size >= 2 and (np.diff(slots) > 0).all() and (us > 0).all() and source
    x, y = np.array([128.0, 1024.0, 8192.0]), np.array([100.0, 500.0, 4000.0])
    assert sim.layer_us(128, (x, y)) == 100.0
    assert sim.layer_us(576, (x, y)) == pytest.approx(300.0)
    assert sim.layer_us(8192 + 7168, (x, y)) == pytest.approx(7500.0)


def test_committed_results_meet_the_targets():
    rows = json.loads(RESULTS.read_text())["rows"]
    for r in rows:
        assert r["planned"]["ours"] <= r["planned"]["baseline"] * (1 + 1e-9), r
    by = {(r["scenario"], r["ep"], r["redundant"]): r for r in rows}
    for scenario in ("zero", "zipf1.0"):
        for ep, redundant in ((64, 64), (32, 32)):
            assert by[scenario, ep, redundant]["measured"]["ours"] <= 1.10
