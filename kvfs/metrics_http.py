"""The HTTP server behind ``--metrics``: a fixed number of threads, idle connections closed.

prometheus-client's own server starts a thread per connection, with no cap and no timeout:
300 idle connections held 300 threads (and ~94 MB). Here one thread accepts connections and
parks each until its request starts to arrive (in a selector, no thread), and a small pool
of workers answers requests. A connection that sends nothing for ``IDLE_TIMEOUT`` seconds is
closed; at most ``MAX_PARKED`` wait at once (past that the one idle the longest is closed);
a request (read and answer together) holds its worker for at most ``REQUEST_TIMEOUT`` seconds,
however slowly its client trickles bytes. At most ``MAX_PARKED + WORKERS`` connections are
parked, queued or answered at once: a new one past that is closed. When accept() runs out of
descriptors (EMFILE/ENFILE) the listener rests ``ACCEPT_BACKOFF`` seconds instead of spinning.
Each connection serves one request (HTTP/1.0, as wsgiref does); garbage gets wsgiref's 400.
"""
from __future__ import annotations

import concurrent.futures
import errno
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
ACCEPT_BACKOFF = 0.5


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
        self._busy: dict[socket.socket, float] = {}     # queued or answered -> deadline (inf: queued)
        self._lock = threading.Lock()                   # _busy; a shutdown vs. the worker's close
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = False
        self._paused_until = 0.0        # listener unregistered until then (out of descriptors)
        self.closed_idle = 0
        self.refused = 0
        self.timed_out = 0
        self.thread = threading.Thread(target=self._serve, name="kvfs-metrics-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _selector(self) -> selectors.BaseSelector:
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        return sel

    def _serve(self) -> None:
        sel = self._selector()
        try:
            while not self._stop:
                try:
                    self._step(sel)
                except Exception:       # noqa: BLE001 - one bad event must not end the endpoint
                    log.exception("metrics server")
        finally:
            for conn in list(self._parked):
                self._drop(sel, conn)
            sel.close()

    def _step(self, sel) -> None:
        """Wait for the next event or deadline and handle what is ready."""
        now = time.monotonic()
        with self._lock:
            ends = [d for d in self._busy.values() if d != float("inf")]
        ends += [d for d, _ in self._parked.values()] + ([self._paused_until] if self._paused_until else [])
        for key, _ in sel.select(max(0.0, min(ends, default=now + IDLE_TIMEOUT) - now)):
            if key.data == "accept":
                self._accept(sel)
            elif key.data == "wake":
                os.read(self._wake_r, 4096)
            elif key.fileobj in self._parked:   # not one _accept just closed (same batch)
                sel.unregister(key.fileobj)
                _, addr = self._parked.pop(key.fileobj)
                with self._lock:
                    self._busy[key.fileobj] = float("inf")
                self.pool.submit(self._answer, key.fileobj, addr)
        now = time.monotonic()
        self._expire(sel, now)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            sel.register(self.socket, selectors.EVENT_READ, "accept")

    def _accept(self, sel) -> None:
        try:
            conn, addr = self.socket.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("metrics server: cannot accept (%s): pausing %.1fs", e, ACCEPT_BACKOFF)
                sel.unregister(self.socket)     # else the pending connection wakes us at once, forever
                self._paused_until = time.monotonic() + ACCEPT_BACKOFF
            return
        with self._lock:
            busy = len(self._busy)
        if len(self._parked) + busy >= MAX_PARKED + WORKERS:    # every slot taken: the new one goes
            self.refused += 1
            self.shutdown_request(conn)
            return
        if len(self._parked) >= MAX_PARKED:     # the longest idle goes (dicts keep insertion order)
            self._drop(sel, next(iter(self._parked)))
        self._parked[conn] = (time.monotonic() + IDLE_TIMEOUT, addr)
        sel.register(conn, selectors.EVENT_READ, "conn")

    def _expire(self, sel, now: float) -> None:
        for conn in [c for c, (d, _) in self._parked.items() if d <= now]:
            self._drop(sel, conn)
        with self._lock:                # a request past its deadline: its blocked recv/send ends
            for conn in [c for c, d in self._busy.items() if d <= now]:
                self._busy[conn] = float("inf")
                self.timed_out += 1
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _drop(self, sel, conn: socket.socket) -> None:
        sel.unregister(conn)
        self._parked.pop(conn, None)
        self.closed_idle += 1
        self.shutdown_request(conn)

    def _answer(self, conn: socket.socket, addr) -> None:
        with self._lock:
            self._busy[conn] = time.monotonic() + REQUEST_TIMEOUT
        self._wake()                    # the accept thread's wait now ends by this deadline
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            self.finish_request(conn, addr)
        except Exception as e:      # noqa: BLE001 - a client's broken request is its own
            log.debug("metrics request from %s: %s", addr, e)
        finally:
            with self._lock:
                self._busy.pop(conn, None)
            self.shutdown_request(conn)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:         # a wake-up is pending already
            pass

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake()
        self.thread.join(timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server_close()
        os.close(self._wake_r)
        os.close(self._wake_w)
