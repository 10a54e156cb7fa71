"""The metrics endpoint under many idle connections (a real daemon): its threads stay
bounded, a real scrape is still served, garbage gets a 400, and idle connections are closed."""
from __future__ import annotations

import socket
import urllib.request

import pytest

from support.mount import wait_for

from kvfs.metrics_http import MAX_PARKED, WORKERS

pytestmark = pytest.mark.mount


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=60) as r:
        assert r.status == 200
        return r.read().decode()


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_hold_no_threads_and_are_closed(kvfs_mount):
    m = kvfs_mount(ram="8MiB", metrics="127.0.0.1:0")
    addr = m.stats()["metrics"]
    host, port = addr.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert "kvfs_tier_capacity_bytes" in scrape(addr)
    base = threads_of(m.pid)
    idle = []
    try:
        for _ in range(300):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.setblocking(False)
            idle.append(s)
        # the connections are accepted (the listener's backlog is small): the oldest beyond
        # MAX_PARKED are closed at once, and no connection got a thread of its own
        wait_for(lambda: sum(closed_by_peer(s) for s in idle[:300 - MAX_PARKED]) == 300 - MAX_PARKED,
                 60, "the connections past MAX_PARKED to be closed")
        assert threads_of(m.pid) <= base + WORKERS
        text = scrape(addr)                              # still served, with them all open
        assert "kvfs_tier_capacity_bytes" in text and "process_resident_memory_bytes" in text
        with socket.create_connection((host, int(port)), timeout=60) as g:
            g.sendall(b"GET /metrics HTTP/x.\xff\r\n\r\n")
            answer = g.recv(4096)
        assert b"Error code: 400" in answer, answer[:200]     # no status line: no version parsed
        # the rest are closed once idle past IDLE_TIMEOUT
        wait_for(lambda: all(closed_by_peer(s) for s in idle[300 - MAX_PARKED:]), 120,
                 "the idle connections to be closed")
        assert threads_of(m.pid) <= base + WORKERS
        assert "kvfs_tier_capacity_bytes" in scrape(addr)
    finally:
        for s in idle:
            s.close()
