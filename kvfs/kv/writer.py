"""Background block writer: on kvfs, each job's blocks in one ``.kvfs/commit`` request
(kvfs.kv.commit); elsewhere (or for a block the commit refused) temp file, one write,
rename, skipping blocks already present.

``BlockWriter.submit`` never blocks the caller longer than its bound: the job queue is
bounded, and a job that cannot be queued within ``timeout`` is dropped (counted, logged).
``flush`` waits for queued jobs and raises the first failure since the last flush.

Exit safety: queued saves are written before a normal interpreter exit. An ``atexit``
handler flushes every open writer, each bounded by its ``exit_timeout``; blocks still
unwritten after that are logged (one warning with the count) and lost. (The writer thread is
a daemon thread so a hung disk cannot hang the exit forever; ``atexit`` handlers run
before the interpreter stops daemon threads.)
"""
from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import queue
import threading
import time
import weakref

from kvfs.kv.block import encode_header
from kvfs.kv.commit import CommitClient
from kvfs.kv.layout import KVLayout, block_path, block_relpath
from kvfs.kv.lookup import open_mount_root, replace_at

log = logging.getLogger(__name__)


class SaveError(RuntimeError):
    """Saving one or more blocks failed in the background."""


@dataclasses.dataclass
class SaveJob:
    """Blocks ``first .. first+len(hashes)-1`` of one prompt; ``payload(i)`` -> bytes-like."""

    hashes: list[str]           # hex hashes of the blocks to write, in chain order
    parents: list[str]          # hex hash of each block's parent ("" for block 0)
    first: int                  # chain index of hashes[0]
    token_ids: list[list[int]]  # token ids of each block
    payload: object             # callable: j -> contiguous bytes-like of block j of this job
    ready: object = None        # callable run before writing (e.g. wait for a device copy)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    written: int = 0
    skipped: int = 0
    done_blocks: int = 0        # blocks written, skipped or failed (the writer's accounting)
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class WriterStats:
    queued: int
    written: int
    skipped: int
    dropped: int
    failed: int
    bytes_written: int


def write_block_file(final: str, header: bytes, payload, dir_fd: int | None = None) -> bool:
    """Write ``header + payload`` to a temp file beside ``final`` and rename it into place.

    Returns False (and writes nothing) if ``final`` already exists. With ``dir_fd`` (a
    descriptor of the mount root), ``final`` is relative to it and every directory, the temp
    file and the rename go through it: a mount that dies meanwhile fails them (ENOTCONN)
    instead of creating directories and files under the bare mount point.
    """
    try:
        os.stat(final, dir_fd=dir_fd)
        return False
    except FileNotFoundError:
        pass
    parent = os.path.dirname(final)
    if dir_fd is None:
        os.makedirs(parent, exist_ok=True)
    else:
        parts = [p for p in parent.split(os.sep) if p not in ("", os.curdir)]
        for k in range(1, len(parts) + 1):
            try:
                os.mkdir(os.path.join(*parts[:k]), dir_fd=dir_fd)
            except FileExistsError:
                pass
    tmp = os.path.join(parent, f".{os.path.basename(final)}.{os.urandom(6).hex()}.tmp")
    replace_at(dir_fd, tmp, final, [header, payload])
    return True


EXIT_TIMEOUT = 60.0       # seconds an exiting interpreter waits for each writer's queued saves

_open_writers: "weakref.WeakSet[BlockWriter]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Write every queued block of every open writer before the interpreter exits."""
    for w in list(_open_writers):
        w.finish_at_exit()


class BlockWriter:
    """One background thread writing SaveJobs for one namespace."""

    def __init__(self, ns_dir: str, namespace: str, layout: KVLayout, hash_algo: str, *,
                 max_pending: int = 64, store_token_ids: bool = True,
                 exit_timeout: float | None = EXIT_TIMEOUT, mount_root: str | None = None):
        self.ns_dir, self.namespace, self.layout, self.hash_algo = ns_dir, namespace, layout, hash_algo
        # on kvfs: blocks go in batches through .kvfs/commit (used by the writer thread only)
        self._commit = CommitClient.open(mount_root) if mount_root else None
        self._commit_base = os.path.relpath(os.path.realpath(ns_dir), mount_root) if mount_root else ""
        # on a mount, blocks the commit refused go through a descriptor of its root
        self._root_fd = -1
        if mount_root:                  # checked through itself: a mount dead by now is ENOTCONN,
            try:                        # not the bare mount point's directory
                self._root_fd = open_mount_root(mount_root)
            except BaseException:
                if self._commit is not None:
                    self._commit.close()
                raise
        self.store_token_ids = store_token_ids
        self._q: queue.Queue[SaveJob | None] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._unwritten = 0             # blocks of queued jobs not yet written, skipped or failed
        self.exit_timeout = exit_timeout
        self._errors: list[BaseException] = []
        self._counts = dict(queued=0, written=0, skipped=0, dropped=0, failed=0, bytes_written=0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvfs-writer-{namespace[:24]}", daemon=True)
        self._thread.start()
        _open_writers.add(self)

    def submit(self, job: SaveJob, timeout: float | None) -> bool:
        """Queue ``job``; False (job dropped) if the queue stayed full for ``timeout`` s."""
        if self._closed:
            raise RuntimeError("the KV cache writer is closed")
        with self._lock:
            self._outstanding += 1
            self._unwritten += len(job.hashes)
        try:
            self._q.put(job, timeout=timeout) if timeout is None or timeout > 0 else self._q.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._outstanding -= 1
                self._unwritten -= len(job.hashes)
                self._counts["dropped"] += len(job.hashes)
                self._idle.notify_all()
            log.warning("save of %d blocks dropped: writer queue full for %.3fs", len(job.hashes), timeout or 0)
            job.done.set()
            return False
        with self._lock:
            self._counts["queued"] += 1
        return True

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as e:  # recorded and re-raised from flush()
                log.error("saving blocks %s.. failed: %s", job.hashes[0][:16], e)
                job.error = e
                with self._lock:
                    self._errors.append(e)
                    self._counts["failed"] += len(job.hashes) - job.written - job.skipped
            finally:
                with self._lock:
                    self._unwritten -= len(job.hashes) - job.done_blocks
                job.done_blocks = len(job.hashes)
                job.done.set()
                with self._lock:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _header(self, job: SaveJob, j: int, payload) -> bytes:
        return encode_header(self.layout, namespace=self.namespace, hash_hex=job.hashes[j],
                             parent_hex=job.parents[j], tokens=(job.first + j + 1) * self.layout.block_tokens,
                             hash_algo=self.hash_algo, payload=payload,
                             token_ids=job.token_ids[j] if self.store_token_ids else None)

    def _done(self, job: SaveJob, written: int) -> None:
        """One block of ``job`` written (``written`` bytes), or found present (0)."""
        if written:
            job.written += 1
        else:
            job.skipped += 1
        job.done_blocks += 1
        with self._lock:
            if written:
                self._counts["written"] += 1
                self._counts["bytes_written"] += written
            else:
                self._counts["skipped"] += 1
            self._unwritten -= 1

    def _committed(self, job: SaveJob) -> list[int]:
        """Publish the job's blocks in one ``.kvfs/commit`` request (kvfs.kv.commit); returns
        the indices left to write through the mount (no commit file, refused, or a block
        directory not made yet)."""
        todo = list(range(len(job.hashes)))
        if self._commit is None:
            return todo
        items = []
        for j in todo:
            payload = job.payload(j)
            # a writable header: the block goes by address, header and payload (kvfs.kv.commit)
            items.append((block_relpath(job.hashes[j]), [bytearray(self._header(job, j, payload)), payload]))
        try:
            results = self._commit.commit_into(self._commit_base, items, noreplace=True)
        except OSError as e:
            log.warning("batched commit failed (%s): writing the blocks through the mount", e)
            return todo
        left = []
        for j, r in zip(todo, results):
            if r == 0:
                self._done(job, sum(memoryview(b).nbytes for b in items[j][1]))
            elif r == errno.EEXIST:
                self._done(job, 0)          # present already: skipped, as by the mount path
            else:
                left.append(j)
        return left

    def _write(self, job: SaveJob) -> None:
        if job.ready is not None:
            job.ready()
        lay = self.layout
        left = set(self._committed(job))
        for j, h in enumerate(job.hashes):
            if j not in left:
                continue
            final, dir_fd = block_path(self.ns_dir, h), None
            if self._root_fd >= 0:
                final, dir_fd = os.path.join(self._commit_base, os.path.relpath(final, self.ns_dir)), self._root_fd
            try:
                os.stat(final, dir_fd=dir_fd)
                self._done(job, 0)          # present already
                continue
            except FileNotFoundError:
                pass
            payload = job.payload(j)
            header = self._header(job, j, payload)
            written = write_block_file(final, header, payload, dir_fd)
            self._done(job, len(header) + lay.block_bytes if written else 0)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued job is written; raise SaveError for failures since last flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._outstanding:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._outstanding} KV save jobs still pending after {timeout}s")
                self._idle.wait(left)
            errors, self._errors = self._errors, []
        if errors:
            raise SaveError(f"{len(errors)} save job(s) failed; first: {errors[0]!r}") from errors[0]

    def statistics(self) -> WriterStats:
        with self._lock:
            return WriterStats(**self._counts)

    def unwritten(self) -> int:
        """Blocks of accepted saves not yet written (nor skipped as present, nor failed)."""
        with self._lock:
            return self._unwritten

    def finish_at_exit(self) -> None:
        """The interpreter is exiting: write what is queued, for at most ``exit_timeout`` s;
        log a warning with the count of blocks left unwritten (lost), never raise."""
        if self._closed:
            return
        try:
            self.close(self.exit_timeout)
        except TimeoutError:
            log.warning("exiting with %d KV blocks of %s still unwritten after %ss (lost)",
                        self.unwritten(), self.namespace, self.exit_timeout)
        except SaveError as e:
            log.error("at exit, saving KV blocks of %s failed: %s", self.namespace, e)
        except BaseException as e:  # noqa: BLE001 - an atexit handler must not raise
            log.error("at exit, flushing the KV writer of %s failed: %r", self.namespace, e)

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        _open_writers.discard(self)
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                if self._commit is not None:
                    self._commit.close()
                if self._root_fd >= 0:
                    os.close(self._root_fd)
                    self._root_fd = -1
