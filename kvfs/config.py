"""Mount configuration: embedded defaults, a TOML file, and flags on top."""
from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

from kvfs.errors import ConfigError
from kvfs.protocol import ALIGN
from kvfs.units import parse_size

MAX_SPIN_US = 10_000      # a longer window is a core given away per request, not a wake-up saved


def _env_int(name: str, default: int):
    """An integer default from the environment; a value that is not one is kept as text, so
    that :meth:`Config.validate` names it in its error (not a traceback at import)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        return raw


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass
class Config:
    """Everything a mount needs. Sizes are bytes once resolved."""

    mountpoint: str = ""
    ram: str | int = "10%"             # of physical memory
    nvme: str = ""                     # directory; default ~/.cache/kvfs/nvme
    nvme_size: str | int = "50%"       # of the filesystem holding `nvme`
    state: str = ""                    # index directory; default <nvme>/state
    remote: str = ""                   # nvme-tcp://host:port/nqn?... or a block device / file
    remote_size: str | int = "100%"
    remote_format: bool = False
    share: bool = False                # the remote volume is shared by several nodes (format 2)
    share_max_nodes: int = 8           # node slots when formatting a shared volume
    share_poll: float = 0.5            # seconds between polls of the other nodes' logs
    share_lease: float = 10.0          # heartbeat every lease/4; a node silent lease + grace is dead
    share_grace: float = -1.0          # extra wait before a silent node is dead (negative: lease/2)
    share_takeover: bool = True        # claim the regions of dead nodes
    node_id: str = ""                  # this node on a shared volume (default: the instance id)
    allow_other: bool = False
    volatile_ram: bool = False         # clean unmount does not write RAM-only objects down
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    promote_hits: int = 2              # accesses within promote_window that make an object hot
    promote_window: float = 30.0       # seconds
    chunk_size: int = 1 << 20          # checksum and read granularity of lower tiers
    shm_dir: str = "/dev/shm"          # the RAM tier lives in shared memory here
    ram_hugefs: bool = True            # the RAM tier on a huge-page tmpfs the daemon mounts in shm_dir (root)
    metrics: str = ""                  # HOST:PORT of the Prometheus endpoint ("" = off)
    admit_after: int | dict = 1        # uses before a tier takes an object: N, or {tier = N}
    read_deadline: float = 2.0         # seconds a read may wait on a lower tier (0 = no limit)
    events_queue: int = 4096           # events a .kvfs/events reader may lag before it loses some
    names_build_step: int = 8192       # directory entries the name table's background build adds per step
    ram_mapped_min: int = 256 << 10    # RAM-tier objects this big stay tmpfs files (leasable)
    # the FUSE transport: "kernel" (kvfs's own, needs root; passthrough), "pyfuse3", or "auto"
    # (kernel where it can run, else pyfuse3); KVFS_TRANSPORT in the environment sets the default
    transport: str = dataclasses.field(default_factory=lambda: os.environ.get("KVFS_TRANSPORT", "auto"))
    # sealed blocks read by the kernel from their tier files (FUSE passthrough, kernel transport,
    # docs/design.md "How a read travels"); KVFS_PASSTHROUGH=0 in the environment sets the default off
    passthrough: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("KVFS_PASSTHROUGH", "1").strip().lower() not in ("0", "false", "no", "off"))
    # the kernel's writeback cache (FUSE_WRITEBACK_CACHE), kvfs's own transport only: an
    # experiment, off (docs/design.md, "How a read travels": measured, no gain on a stat after a
    # write); excludes passthrough (the kernel allows one or the other). KVFS_WRITEBACK_CACHE=1
    # in the environment sets the default (to run the tests with it on)
    writeback_cache: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("KVFS_WRITEBACK_CACHE", "") in ("1", "true"))
    # microseconds the kernel transport's reader keeps retrying /dev/fuse right after it answered
    # a request, before it sleeps in epoll: the caller's next request (a RELEASE and the OPEN of
    # a read right after a write) then costs no wake-up (kvfs/fs/loop.py, Reader.spin). At most
    # one window per request: an idle mount never spins. Off (0) by default: measured
    # (docs/benchmarks.md "The open's round trip"), 100 makes that open ~20% faster but takes
    # CPU from a caller whose threads fill the cores (LMCache's 4 reader threads on 2 cores:
    # 0.7-0.9x). KVFS_FUSE_SPIN_US in the environment sets the default
    fuse_spin_us: int = dataclasses.field(default_factory=lambda: _env_int("KVFS_FUSE_SPIN_US", 0))
    # a supervisor holds the mount's /dev/fuse session and starts the daemon again when it
    # dies (kvfs/supervisor.py, docs/operations.md "Restarts"): kvfs's own transport only, not
    # in the foreground. KVFS_SUPERVISE=1 in the environment sets the default on
    supervise: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("KVFS_SUPERVISE", "").strip().lower() in ("1", "true", "yes", "on"))
    debug: bool = False
    foreground: bool = False

    @classmethod
    def load(cls, path: str | None = None, **overrides) -> "Config":
        """Defaults, then the TOML file (if any), then non-None overrides."""
        values: dict = {}
        if path:
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except FileNotFoundError:
                raise ConfigError(f"config file not found: {path}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
            data = data.get("kvfs", data)
            known = {f.name for f in dataclasses.fields(cls)}
            for key, val in data.items():
                key = key.replace("-", "_")
                if key not in known:
                    raise ConfigError(f"unknown key in {path}: {key}")
                values[key] = val
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    # Resolved values -------------------------------------------------------
    @property
    def nvme_dir(self) -> Path:
        return Path(self.nvme or Path.home() / ".cache" / "kvfs" / "nvme").expanduser().resolve()

    @property
    def state_dir(self) -> Path:
        return Path(self.state).expanduser().resolve() if self.state else self.nvme_dir / "state"

    def ram_bytes(self) -> int:
        return parse_size(self.ram, whole=_total_ram())

    def nvme_bytes(self) -> int:
        d = self.nvme_dir
        probe = d if d.exists() else d.parent
        while not probe.exists():
            probe = probe.parent
        st = os.statvfs(probe)
        return parse_size(self.nvme_size, whole=st.f_blocks * st.f_frsize)

    def validate(self) -> None:
        """Raise ConfigError with a one-line message for anything unusable."""
        self.ram_bytes()
        self.nvme_bytes()
        if self.remote:
            # the remote tier resolves "%" against the volume size itself
            if not str(self.remote_size).strip().endswith("%"):
                parse_size(self.remote_size)
        if self.share:
            if not self.remote:
                raise ConfigError("share = true needs a remote volume (--remote)")
            if not isinstance(self.share_max_nodes, int) or not 1 <= self.share_max_nodes <= 255:
                raise ConfigError("share_max_nodes must be an integer from 1 to 255")
            if not isinstance(self.share_poll, (int, float)) or not 0.01 <= self.share_poll <= 60:
                raise ConfigError("share_poll must be a number of seconds from 0.01 to 60")
            if not isinstance(self.share_lease, (int, float)) or not 0.1 <= self.share_lease <= 600:
                raise ConfigError("share_lease must be a number of seconds from 0.1 to 600")
            if not isinstance(self.share_grace, (int, float)) or self.share_grace > 600:
                raise ConfigError("share_grace must be a number of seconds up to 600 (negative: lease/2)")
            if len(str(self.node_id).encode()) > 64:
                raise ConfigError("node_id must be at most 64 bytes")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
        if self.promote_hits < 1:
            raise ConfigError("promote_hits must be at least 1")
        if self.chunk_size < ALIGN or self.chunk_size % ALIGN:
            raise ConfigError(f"chunk_size must be a positive multiple of {ALIGN}")
        if self.metrics:
            from kvfs.metrics import parse_address
            parse_address(self.metrics)
        self.admission()
        if not isinstance(self.events_queue, int) or not 1 <= self.events_queue <= 1 << 20:
            raise ConfigError("events_queue must be an integer in [1, 1048576]")
        if not isinstance(self.names_build_step, int) or not 1 <= self.names_build_step <= 1 << 24:
            raise ConfigError("names_build_step must be an integer in [1, 16777216]")
        if not isinstance(self.read_deadline, (int, float)) or not 0 <= self.read_deadline <= 3600:
            raise ConfigError("read_deadline must be a number of seconds in [0, 3600] (0: no deadline)")
        if not isinstance(self.ram_mapped_min, int) or not ALIGN <= self.ram_mapped_min <= 1 << 30:
            raise ConfigError(f"ram_mapped_min must be a whole number of bytes from {ALIGN} to 1 GiB")
        if not isinstance(self.ram_hugefs, bool):
            raise ConfigError("ram_hugefs must be true or false")
        if self.transport not in ("auto", "kernel", "pyfuse3"):
            raise ConfigError(f"transport must be auto, kernel or pyfuse3, not {self.transport!r}")
        if not isinstance(self.passthrough, bool):
            raise ConfigError("passthrough must be true or false")
        if not isinstance(self.writeback_cache, bool):
            raise ConfigError("writeback_cache must be true or false")
        if not isinstance(self.supervise, bool):
            raise ConfigError("supervise must be true or false")
        if (not isinstance(self.fuse_spin_us, int) or isinstance(self.fuse_spin_us, bool)
                or not 0 <= self.fuse_spin_us <= MAX_SPIN_US):
            raise ConfigError(f"fuse_spin_us must be a whole number of microseconds from 0 to {MAX_SPIN_US} "
                              f"(0: off), not {self.fuse_spin_us!r}")
        self.check_shm_dir()

    def admission(self) -> dict[str, int]:
        """``admit_after`` per lower tier (``nvme``, ``remote``): uses (its write plus opens)
        an object needs before that tier takes it. An integer applies to every lower tier."""
        raw = self.admit_after
        table = {"nvme": raw, "remote": raw} if isinstance(raw, int) and not isinstance(raw, bool) else raw
        if not isinstance(table, dict):
            raise ConfigError(f"admit_after must be an integer or a table of tier = integer, not {raw!r}")
        for tier, n in table.items():
            if tier not in ("nvme", "remote"):
                raise ConfigError(f"admit_after: unknown tier {tier!r} (nvme or remote)")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"admit_after.{tier} must be an integer >= 1, not {n!r}")
        return dict(table)

    def check_shm_dir(self) -> dict[str, str]:
        """The RAM tier's directory must be an existing directory on tmpfs (memory, and what
        the loader's fast path maps). Returns the tmpfs mount's options."""
        from kvfs.proc import filesystem_of
        if not os.path.isdir(self.shm_dir):
            raise ConfigError(f"shm_dir {self.shm_dir} is not an existing directory")
        try:
            mnt, fstype, opts = filesystem_of(self.shm_dir)
        except OSError as e:
            raise ConfigError(f"cannot tell which filesystem holds shm_dir {self.shm_dir}: {e}") from None
        if fstype != "tmpfs":
            raise ConfigError(f"shm_dir {self.shm_dir} is on {fstype or 'an unknown filesystem'} ({mnt}), "
                              "not tmpfs: the RAM tier must live in memory")
        return opts
