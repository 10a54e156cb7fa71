"""The fleet simulation of docs/scale-out.md (benchmarks/fleet_sim.py): its accounting holds.

The model is only worth its plot if what it counts is consistent; these checks run it small.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("fleet_sim_for_test", SRC)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def small(sim, **kw):
    base = dict(nodes=8, per_node=75, prompts=100, local=120, region=300, open_sessions=100)
    return sim.Params(**{**base, **kw})


def run(sim, **kw):
    return sim.Fleet(small(sim, **kw)).run()


def test_without_sharing_nothing_is_shared_or_polled(sim):
    r = run(sim)
    assert r.hits_shared == 0 and r.poll_bytes_per_s == 0 and r.log_bytes_read == 0
    found = r.hits_local + r.hits_own_volume
    assert 0 < found < r.lookups and r.hit_rate == pytest.approx(found / r.lookups)
    assert len(r.node_hit_rates) == 8


def test_sharing_on_demote_only_adds_hits(sim):
    """Same workload request for request (the poll lags have their own generator): a node that
    may also read its peers' blocks finds at least what it found alone, and writes the same."""
    off, on = run(sim), run(sim, sharing=True)
    assert on.lookups == off.lookups
    assert on.hits_local == off.hits_local
    assert on.hit_rate > off.hit_rate and on.hits_shared > 0
    assert on.volume_written == off.volume_written      # demotions are the same blocks
    assert on.volume_read > off.volume_read


def test_traffic_accounting(sim):
    p = small(sim, sharing=True, publish="write", nodes=16, poll_ms=250.0, slot=512)
    r = sim.Fleet(p).run()
    assert r.poll_bytes_per_s == pytest.approx(16 * 15 * 512 / 0.25)
    assert r.log_bytes_read > 0 and r.log_bytes_read % (p.entry * 15) == 0
    p50, p90 = r.visibility_ms
    # written through at creation: visible after the flush plus at most one poll interval
    assert p.flush_ms <= p50 <= p90 <= p.flush_ms + p.poll_ms
    assert asdict(r)["params"]["publish"] == "write"


def test_sweep_and_plot(sim, tmp_path):
    rows = sim.sweep(small(sim, per_node=25), [2, 4], progress=lambda line: None)
    assert len(rows) == 2 * 2 * 3
    out = tmp_path / "fleet.png"
    sim.plot(rows, str(out))
    assert out.stat().st_size > 10_000
