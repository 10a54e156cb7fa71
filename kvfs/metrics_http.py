"""The HTTP server behind ``--metrics``: a fixed number of threads, idle connections closed.

prometheus-client's own server starts a thread per connection, with no cap and no timeout:
300 idle connections held 300 threads (and ~94 MB). Here one thread accepts connections and
parks each until its request starts to arrive (in a selector, no thread), and a small pool
of workers answers requests. A connection that sends nothing for ``IDLE_TIMEOUT`` seconds is
closed; at most ``MAX_PARKED`` wait at once (past that the one idle the longest is closed);
a request that stalls half-sent holds its worker for at most ``REQUEST_TIMEOUT`` seconds.
Each connection serves one request (HTTP/1.0, as wsgiref does); garbage gets wsgiref's 400.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import selectors
import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger(__name__)

WORKERS = 4
MAX_PARKED = 64
IDLE_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):       # noqa: A002 - the base class's name
        pass


class BoundedServer(WSGIServer):
    """``serve_forever`` on one thread (started by ``start``); ``stop`` ends it and the pool."""

    request_queue_size = 128    # listen backlog (socketserver's 5 drops SYNs of a burst: 1 s retries)

    def __init__(self, host: str, port: int, app):
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.address_family = family
        super().__init__((host, port), _QuietHandler)
        self.set_app(app)
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="kvfs-metrics")
        self._parked: dict[socket.socket, tuple[float, object]] = {}     # -> (deadline, address)
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self.closed_idle = 0
        self.thread = threading.Thread(target=self._serve, name="kvfs-metrics-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop:
                now = time.monotonic()
                soonest = min((d for d, _ in self._parked.values()), default=now + IDLE_TIMEOUT)
                for key, _ in sel.select(max(0.0, soonest - now)):
                    if key.data == "accept":
                        self._accept(sel)
                    elif key.data != "wake":
                        sel.unregister(key.fileobj)
                        _, addr = self._parked.pop(key.fileobj)
                        self.pool.submit(self._answer, key.fileobj, addr)
                self._expire(sel, time.monotonic())
        finally:
            for conn in list(self._parked):
                self._drop(sel, conn)
            sel.close()

    def _accept(self, sel) -> None:
        try:
            conn, addr = self.socket.accept()
        except OSError:
            return
        if len(self._parked) >= MAX_PARKED:     # the longest idle goes (dicts keep insertion order)
            self._drop(sel, next(iter(self._parked)))
        self._parked[conn] = (time.monotonic() + IDLE_TIMEOUT, addr)
        sel.register(conn, selectors.EVENT_READ, "conn")

    def _expire(self, sel, now: float) -> None:
        for conn in [c for c, (d, _) in self._parked.items() if d <= now]:
            self._drop(sel, conn)

    def _drop(self, sel, conn: socket.socket) -> None:
        sel.unregister(conn)
        self._parked.pop(conn, None)
        self.closed_idle += 1
        self.shutdown_request(conn)

    def _answer(self, conn: socket.socket, addr) -> None:
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            self.finish_request(conn, addr)
        except Exception as e:      # noqa: BLE001 - a client's broken request is its own
            log.debug("metrics request from %s: %s", addr, e)
        finally:
            self.shutdown_request(conn)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self.thread.join(timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server_close()
        os.close(self._wake_r)
        os.close(self._wake_w)
