"""The metrics HTTP server on its own (plain sockets, no mount): a connection closed by the
idle cap in the same wake-up as its request, the cap on parked+queued+answered connections,
the overall deadline of one request, and the back-off when accept() runs out of descriptors."""
from __future__ import annotations

import os
import resource
import select
import socket
import time

import pytest

from kvfs import metrics_http
from kvfs.metrics_http import BoundedServer

BODY = b"metrics here\n"


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [BODY]


@pytest.fixture
def server():
    srv = BoundedServer("127.0.0.1", 0, app)
    yield srv
    if srv.thread.is_alive():
        srv.stop()
    else:
        srv.pool.shutdown(wait=True, cancel_futures=True)
        srv.server_close()


def connect(srv) -> socket.socket:
    return socket.create_connection(srv.server_address[:2], timeout=60)


def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        select.select([], [], [], 0.01)


def readable(*socks) -> bool:
    return len(select.select(list(socks), [], [], 0)[0]) == len(socks)


def read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_request_from_the_connection_dropped_in_the_same_batch(server, monkeypatch):
    """The oldest parked connection sends its request while a new one arrives: _accept drops
    it (MAX_PARKED) and its own ready key, in the same batch, must be skipped, not crash."""
    monkeypatch.setattr(metrics_http, "MAX_PARKED", 1)
    sel = server._selector()
    try:
        a = connect(server)
        until(lambda: server._step(sel) or server._parked, "the first connection parked")
        (a_srv,) = server._parked
        b = connect(server)                 # the listener is ready first, then a's request
        until(lambda: readable(server.socket), "the second connection queued")
        a.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        until(lambda: readable(server.socket, a_srv), "both ready")
        server._step(sel)                   # accepts b, drops a; a's key in the same batch
        assert a_srv not in server._parked and len(server._parked) == 1
        assert read_all(a) == b""
        b.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        until(lambda: server._step(sel) or not server._parked, "b's request handed over")
        assert read_all(b).endswith(BODY)
    finally:
        sel.close()


def test_connections_past_the_cap_are_closed(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "MAX_PARKED", 2)
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT", 600.0)
    server.start()
    stalled = []
    for i in range(metrics_http.WORKERS + 2):     # 4 answered (stalled mid-request), 2 queued
        s = connect(server)
        s.sendall(b"G")
        stalled.append(s)
        until(lambda: len(server._busy) == i + 1, "the stalled request to be taken")
    late = connect(server)
    late.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    assert read_all(late) == b""                  # closed unanswered, not queued behind them
    assert server.refused == 1
    for s in stalled:
        s.close()


def test_a_trickling_request_ends_at_its_deadline(server, monkeypatch):
    """One byte at a time, each well within the timeout: the request still ends."""
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT", 0.5)
    server.start()
    s = connect(server)
    deadline = time.monotonic() + 60
    ended = False
    while not ended and time.monotonic() < deadline:
        try:
            s.sendall(b"G")
            ended = bool(select.select([s], [], [], 0.1)[0])   # the pace of the trickle
        except (BrokenPipeError, ConnectionResetError):
            ended = True
    assert ended, "the trickling request was never ended"
    assert server.timed_out == 1


def test_out_of_descriptors_pauses_the_listener(server):
    sel = server._selector()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        c = connect(server)
        until(lambda: readable(server.socket), "the connection queued")
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with pytest.raises(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        server._step(sel)                   # accept() fails: EMFILE
        assert all(k.fileobj is not server.socket for k in sel.get_map().values()), \
            "the listener is still selected: the accept loop would spin"
        assert server._paused_until > 0 and not server._parked
        for fd in fillers:
            os.close(fd)
        fillers.clear()
        until(lambda: server._step(sel) or server._parked, "the connection accepted after the pause")
        c.close()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sel.close()
