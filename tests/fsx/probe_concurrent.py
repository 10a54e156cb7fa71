"""Concurrent probe (not a test): readers and writers of ONE file in several processes on a
kvfs mount, where the fsx exerciser never shares a file between workers. Readers open,
fstat, pread to the size and mmap it; writers grow the file (truncate by path, O_RDWR pwrite
at the end, O_APPEND). Prints each process's errno counts and exit code (-7: SIGBUS).

    PYTHONPATH=.:tests python tests/fsx/probe_concurrent.py /tmp/NAME-probe [mount flags]
    (DUR=seconds, WRITERS=n (default 1; with 2 the file may shrink between a reader's fstat
    and its read: racing stat + truncate, a real EOF), KINDS, MMAP; KVFS_TRACE_REQUESTS=FILE
    on the daemon traces every answer, docs/testing.md)

A short read or a mapping past the kernel's own size is first checked against that size
(``statx`` with AT_STATX_DONT_SYNC: no request reaches the daemon): while another process's
truncate is answered but not yet applied by the kernel (its task has not run since the
daemon's reply), ``fstat`` returns a GETATTR's answer (the new size) that the kernel did not
apply, and reads and faults stop at the old size. That window is the kernel's and is counted
as "kernel truncate window" (docs/design.md, "Versions and sizes"), not as a failure; the
mapping is then made only as long as the kernel's size.
"""
import collections, ctypes, errno, mmap, multiprocessing as mp, os, random, struct, sys, time
from pathlib import Path
MiB = 1 << 20
DUR = float(os.environ.get("DUR", "20"))

_LIBC = ctypes.CDLL(None, use_errno=True)
SYS_STATX, AT_EMPTY_PATH, AT_STATX_DONT_SYNC, STATX_SIZE = 332, 0x1000, 0x4000, 0x200


def kernel_size(fd):
    """The size the kernel holds for ``fd``'s inode (no GETATTR: AT_STATX_DONT_SYNC)."""
    buf = ctypes.create_string_buffer(256)
    if _LIBC.syscall(SYS_STATX, fd, b"", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_SIZE, buf) != 0:
        return -1
    return struct.unpack_from("<Q", buf.raw, 40)[0]


def shape_ok(b):
    if not b: return True
    c = b[0]
    if c == 0: return not any(b)
    i = len(b.rstrip(b"\0"))
    return b[:i] == bytes([c]) * i

def reader(path, seed, q):
    rng = random.Random(seed); errs = collections.Counter(); n = 0
    end = time.time() + DUR
    while time.time() < end:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            errs["open " + errno.errorcode[e.errno]] += 1; continue
        try:
            sz = os.fstat(fd).st_size
            ks = kernel_size(fd)            # the kernel's own size, before and after the read
            b = os.pread(fd, sz + 10, 0)
            if len(b) < sz:
                if len(b) in (ks, kernel_size(fd)):
                    errs["kernel truncate window (pread)"] += 1
                else:
                    errs[f"pread EOF inside fstat size: fstat {sz} got {len(b)} fstat now {os.fstat(fd).st_size} ino {os.fstat(fd).st_ino}"] += 1
            
            if sz and rng.random() < float(os.environ.get("MMAP", "0.5")):   # MMAP=0: pread only
                sz2 = os.fstat(fd).st_size
                ks = kernel_size(fd)
                if 0 <= ks < sz2:
                    errs["kernel truncate window (mmap)"] += 1
                    sz2 = ks
                try:
                    mm = mmap.mmap(fd, sz2, prot=mmap.PROT_READ) if sz2 else None
                except ValueError:
                    mm = None; errs["mmap valueerror (size moved)"] += 1
                if mm is not None:
                    st = os.fstat(fd)
                    with open(os.path.join(os.environ.get("PROBE_DIR", "/tmp"), f"probe-last-{seed}"), "w") as lf:
                        lf.write(f"ino {st.st_ino} nlink {st.st_nlink} fstat {sz} then {sz2} pread got {len(b)} now {st.st_size} t {time.time():.4f}\n")
                    mm[:]                       # every page faulted in
                    mm.close()
            n += 1
        except OSError as e:
            errs["io " + errno.errorcode[e.errno]] += 1
        finally:
            os.close(fd)
    q.put(("reader", n, dict(errs)))

def writer(path, seed, q):
    rng = random.Random(seed); errs = collections.Counter(); n = 0
    end = time.time() + DUR
    while time.time() < end:
        c = rng.randrange(1, 256); L = rng.randrange(1, 64 << 10)
        k = rng.random() * float(os.environ.get("KINDS", "1"))   # KINDS=0.8: no O_APPEND writer
        try:
            if k < 0.4:
                s0 = os.stat(path).st_size
                if s0 < getattr(writer, "last", 0): errs["stat shrank"] += 1
                os.truncate(path, s0 + L)
                writer.last = s0 + L
            elif k < 0.8:
                fd = os.open(path, os.O_RDWR)
                os.pwrite(fd, bytes([c]) * L, os.fstat(fd).st_size); os.close(fd)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                os.write(fd, bytes([c]) * L); os.close(fd)
            n += 1
        except OSError as e:
            errs[f"{k<0.4 and 'truncate' or k<0.8 and 'rdwr' or 'append'} " + errno.errorcode[e.errno]] += 1
        time.sleep(rng.random() * 0.02)
    q.put(("writer", n, dict(errs)))

if __name__ == "__main__":
    from support.mount import open_mount
    m = open_mount(Path(sys.argv[1]), *sys.argv[2:], ram="64MiB", nvme_size="256MiB")
    try:
        p = str(m.path / "f")
        with open(p, "wb") as f: f.write(b"\x07" * MiB)
        ctx = mp.get_context("spawn"); q = ctx.Queue()
        ps = [ctx.Process(target=reader, args=(p, i, q)) for i in range(3)] + \
             [ctx.Process(target=writer, args=(p, 100 + i, q)) for i in range(int(os.environ.get("WRITERS", "1")))]
        for x in ps: x.start()
        for x in ps: x.join(DUR + 120)
        for x in ps: print("exit", x.exitcode)
        for i in range(3):
            if ps[i].exitcode == -7: print("last", i, open(os.path.join(os.environ.get("PROBE_DIR", "/tmp"), f"probe-last-{i}")).read().strip())
        while not q.empty(): print(q.get())
        print("passthrough", m.stats()["transport"]["passthrough"])
    finally:
        m.cleanup()
