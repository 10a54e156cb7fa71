"""Boot the real Linux NVMe/TCP target (nvmet + nvmet-tcp) in QEMU for tests.

Debian's stock 6.1 kernel is fetched with ``apt-get download`` and unpacked with
``dpkg -x`` into a cache directory outside the repository
(``$KVFS_CACHE/target``, default ``~/.cache/kvfs/target``). A busybox-static
initramfs loads the modules, exports a virtio-blk disk (a raw image file on the
host, so data survives a target restart) as namespace 1 of one subsystem on
TCP port 4420, and prints a ready marker on the serial console. QEMU's
user-mode network forwards a loopback port on the host to it. The VM also
streams /dev/zero on guest port 5001 (busybox ``nc``) so benchmarks can measure
the raw TCP throughput of the same VM.

Run as a script::

    python tests/support/nvmet.py up [--image PATH] [--size 1GiB] [--port N]

prints the URL and PID and leaves the VM running (stop it with ``kill PID``).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

SUBNQN = "nqn.2024-01.io.kvfs:target"
READY = "KVFS-TARGET-READY"
RAW_STREAM_PORT = 5001     # busybox nc < /dev/zero
RAW_STREAM_PORT_DD = 5002  # busybox nc -e "dd if=/dev/zero bs=1M" (large writes)
CONTROL_PORT = 5003        # busybox nc -e /bin/sh: a root shell in the guest, for fault tests
MODULES = [
    "crct10dif_common", "crct10dif_generic", "crc-t10dif", "crc64", "crc64_rocksoft_generic",
    "crc64-rocksoft", "t10-pi", "crc32c_generic", "configfs", "nvmet", "nvmet-tcp",
    "failover", "net_failover", "virtio_ring", "virtio", "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev", "virtio_pci", "virtio_net", "virtio_blk",
]

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in __MODULES__; do insmod /lib/modules/$m.ko || echo "insmod $m failed"; done
mount -t configfs none /sys/kernel/config
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
i=0; while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do usleep 50000; i=$((i+1)); done
N=/sys/kernel/config/nvmet
S=$N/subsystems/__SUBNQN__
mkdir $S
echo 1 > $S/attr_allow_any_host
echo KVFS0123456789 > $S/attr_serial 2>/dev/null
mkdir $S/namespaces/1
echo -n /dev/vda > $S/namespaces/1/device_path
echo 1 > $S/namespaces/1/enable
mkdir $N/ports/1
echo tcp > $N/ports/1/addr_trtype
echo ipv4 > $N/ports/1/addr_adrfam
echo 0.0.0.0 > $N/ports/1/addr_traddr
echo 4420 > $N/ports/1/addr_trsvcid
ln -s $S $N/ports/1/subsystems/
(while true; do nc -l -p __RAWPORT__ < /dev/zero; done) >/dev/null 2>&1 &
printf '#!/bin/sh\nexec dd if=/dev/zero bs=1M 2>/dev/null\n' > /bin/zero1m; chmod +x /bin/zero1m
nc -ll -p __RAWPORT2__ -e /bin/zero1m >/dev/null 2>&1 &
nc -ll -p __CTLPORT__ -e /bin/sh >/dev/null 2>&1 &
echo __READY__
while true; do sleep 3600; done
"""


def cache_dir() -> Path:
    base = os.environ.get("KVFS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvfs")
    d = Path(base) / "target"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _kernel_package() -> str:
    """The current linux-image-6.1.0-N-amd64 package name (what linux-image-amd64 depends on)."""
    out = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split(":", 1)[-1].strip()
        if line.strip().startswith("Depends:") and name.startswith("linux-image-6.1.0-") and name.endswith("-amd64"):
            return name
    out = subprocess.run(["apt-cache", "search", "--names-only", r"^linux-image-6\.1\.0-[0-9]+-amd64$"],
                         capture_output=True, text=True).stdout
    names = sorted((l.split()[0] for l in out.splitlines() if l.strip()),
                   key=lambda n: int(n.split("-")[3]))
    if not names:
        raise RuntimeError("no linux-image-6.1.0-*-amd64 package known to apt (run apt-get update)")
    return names[-1]


def ensure_kernel(cache: Path | None = None) -> tuple[Path, Path]:
    """Download and unpack the Debian kernel once. Returns (vmlinuz, modules dir)."""
    cache = cache or cache_dir()
    root = cache / "root"
    found = glob.glob(str(root / "boot" / "vmlinuz-6.1.0-*-amd64"))
    if not found:
        debs = glob.glob(str(cache / "linux-image-6.1.0-*-amd64_*.deb"))
        if not debs:
            pkg = _kernel_package()
            log.info("downloading %s into %s", pkg, cache)
            r = subprocess.run(["apt-get", "download", pkg], cwd=cache, capture_output=True, text=True)
            if r.returncode != 0:
                subprocess.run(["apt-get", "update"], capture_output=True)
                subprocess.run(["apt-get", "download", _kernel_package()], cwd=cache, check=True)
            debs = glob.glob(str(cache / "linux-image-6.1.0-*-amd64_*.deb"))
        tmp = cache / "root.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["dpkg", "-x", debs[0], str(tmp)], check=True)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
        found = glob.glob(str(root / "boot" / "vmlinuz-6.1.0-*-amd64"))
    vmlinuz = Path(found[0])
    release = vmlinuz.name[len("vmlinuz-"):]
    return vmlinuz, root / "lib" / "modules" / release


def _busybox() -> str:
    for cand in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.exists(cand):
            out = subprocess.run(["file", "-L", cand], capture_output=True, text=True).stdout if shutil.which("file") else ""
            if "dynamically" not in out:
                return cand
    raise RuntimeError("busybox-static is not installed (apt-get install busybox-static)")


def ensure_initramfs(cache: Path | None = None) -> Path:
    """Build (once per content) the uncompressed newc initramfs with busybox and modules."""
    cache = cache or cache_dir()
    vmlinuz, moddir = ensure_kernel(cache)
    init = (INIT.replace("__MODULES__", " ".join(MODULES)).replace("__SUBNQN__", SUBNQN)
            .replace("__READY__", READY).replace("__RAWPORT__", str(RAW_STREAM_PORT))
            .replace("__RAWPORT2__", str(RAW_STREAM_PORT_DD)).replace("__CTLPORT__", str(CONTROL_PORT)))
    stamp = f"{vmlinuz.name}:{zlib.crc32(init.encode()):08x}"   # stable across processes
    out = cache / "initramfs.cpio"
    stampfile = cache / "initramfs.stamp"
    if out.exists() and stampfile.exists() and stampfile.read_text() == stamp:
        return out
    tree = cache / "initramfs.tree"
    shutil.rmtree(tree, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "lib/modules", "tmp"):
        (tree / d).mkdir(parents=True)
    shutil.copy(_busybox(), tree / "bin" / "busybox")
    for m in MODULES:
        hits = glob.glob(str(moddir / "kernel" / "**" / f"{m}.ko"), recursive=True)
        if not hits:
            raise RuntimeError(f"module {m}.ko not found under {moddir}")
        shutil.copy(hits[0], tree / "lib" / "modules" / f"{m}.ko")
    (tree / "init").write_text(init)
    (tree / "init").chmod(0o755)
    files = subprocess.run(["find", "."], cwd=tree, capture_output=True, text=True, check=True).stdout
    tmp = cache / "initramfs.cpio.tmp"
    with open(tmp, "wb") as f:
        subprocess.run([_busybox(), "cpio", "-o", "-H", "newc"], cwd=tree, input=files.encode(),
                       stdout=f, stderr=subprocess.DEVNULL, check=True)
    tmp.rename(out)
    stampfile.write_text(stamp)
    shutil.rmtree(tree, ignore_errors=True)
    return out


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets stay bound until all are chosen (one at a time,
    the kernel may hand the same ephemeral port out twice: QEMU then refused two host
    forwards on one port, seen once in a full run)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclasses.dataclass
class Target:
    """One QEMU-booted nvmet-tcp target. ``start`` boots it; ``kill``/``stop`` end it by PID."""

    image: Path
    size: int = 1 << 30
    port: int = 0
    raw_port: int = 0
    raw_port_dd: int = 0
    control_port: int = 0
    workdir: Path | None = None
    memory_mb: int = 512
    cpus: int = 1
    proc: subprocess.Popen | None = None
    boot_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.image = Path(self.image)
        self.workdir = Path(self.workdir or self.image.parent)
        fresh = iter(free_ports(4))
        self.port = self.port or next(fresh)
        self.raw_port = self.raw_port or next(fresh)
        self.raw_port_dd = self.raw_port_dd or next(fresh)
        self.control_port = self.control_port or next(fresh)

    @property
    def url(self) -> str:
        return f"nvme-tcp://127.0.0.1:{self.port}/{SUBNQN}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def console(self) -> Path:
        return self.workdir / f"console-{self.port}.log"

    def start(self, timeout: float = 120.0) -> None:
        if self.proc and self.proc.poll() is None:
            raise RuntimeError("target already running")
        vmlinuz, _ = ensure_kernel()
        initrd = ensure_initramfs()
        if not self.image.exists() or self.image.stat().st_size < self.size:
            with open(self.image, "ab") as f:
                f.truncate(self.size)
        self.console.write_text("")
        cmd = [
            "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-m", str(self.memory_mb),
            "-smp", str(self.cpus), "-nodefaults", "-no-user-config", "-display", "none",
            "-kernel", str(vmlinuz), "-initrd", str(initrd),
            "-append", "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off",
            "-serial", f"file:{self.console}",
            "-drive", f"file={self.image},format=raw,if=virtio,cache=writeback,discard=unmap",
            "-netdev", (f"user,id=n0,hostfwd=tcp:127.0.0.1:{self.port}-:4420,"
                        f"hostfwd=tcp:127.0.0.1:{self.raw_port}-:{RAW_STREAM_PORT},"
                        f"hostfwd=tcp:127.0.0.1:{self.raw_port_dd}-:{RAW_STREAM_PORT_DD},"
                        f"hostfwd=tcp:127.0.0.1:{self.control_port}-:{CONTROL_PORT}"),
            "-device", "virtio-net-pci,netdev=n0",
            "-no-reboot",
        ]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / f"qemu-{self.port}.err", "wb"),
                                     start_new_session=True)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.workdir / f"qemu-{self.port}.err").read_text(errors="replace")
                raise RuntimeError(f"qemu exited with {self.proc.returncode}: {err.strip()[-500:]}")
            if READY in self.console.read_text(errors="replace"):
                self.boot_seconds = time.monotonic() - t0
                log.info("target up on port %d after %.1f s (pid %d)", self.port, self.boot_seconds, self.pid)
                return
            time.sleep(0.1)     # polling a log file with a deadline, not synchronising on time
        self.kill()
        raise TimeoutError(f"target did not become ready in {timeout} s; console: "
                           f"{self.console.read_text(errors='replace')[-1000:]}")

    def kill(self) -> None:
        """SIGKILL the VM (a crash, as far as the initiator can tell) and reap it."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    stop = kill     # the namespace is a host file written through: nothing to flush in the guest

    def restart(self, timeout: float = 120.0) -> None:
        self.kill()
        self.start(timeout)

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)

    def guest(self, command: str, timeout: float = 30.0) -> str:
        """Run a shell command in the guest (as root) and return its output.

        Used by fault tests to change the target under a connected initiator, e.g. to
        disable the namespace in configfs. Retried while the guest's listener restarts.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.control_port), timeout=timeout) as s:
                    s.settimeout(max(1.0, deadline - time.monotonic()))
                    s.sendall(f"{command}\necho __KVFS_DONE__ $?\nexit\n".encode())
                    out = b""
                    while b"__KVFS_DONE__" not in out or not out.endswith(b"\n"):
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        out += chunk
            except OSError as e:
                out, err = b"", e
            else:
                err = None
            text = out.decode(errors="replace")
            if "__KVFS_DONE__" in text:
                body, _, rc = text.rpartition("__KVFS_DONE__")
                if rc.strip() != "0":
                    raise RuntimeError(f"guest command {command!r} failed ({rc.strip()}): {body.strip()}")
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the guest shell within {timeout} s ({err or 'no output'})")
            time.sleep(0.1)   # the guest's nc is between connections; nothing to wait on from here


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="boot a target and leave it running")
    up.add_argument("--image", default=str(cache_dir() / "namespace.img"))
    up.add_argument("--size", default=str(1 << 30))
    up.add_argument("--port", type=int, default=4420)
    sub.add_parser("fetch", help="download the kernel and build the initramfs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.cmd == "fetch":
        print(ensure_initramfs())
        return 0
    t = Target(Path(args.image), size=int(args.size), port=args.port)
    t.start()
    print(f"url={t.url} pid={t.pid} raw_port={t.raw_port} raw_port_dd={t.raw_port_dd} boot={t.boot_seconds:.1f}s")
    t.proc = None   # leave it running
    return 0


if __name__ == "__main__":
    sys.exit(main())
