"""Store exceptions. The filesystem layer maps them to errnos in one place (kvfs.fs.errmap)."""


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class NoSuchObject(StoreError):
    """The object (or name) does not exist: ENOENT."""


class CorruptObject(StoreError):
    """Bytes read back from a tier do not match the recorded checksum: EIO."""


class TierFull(StoreError):
    """No tier can take the bytes (what remains is pinned): ENOSPC."""


class TierUnavailable(StoreError):
    """A tier cannot be reached right now (remote target down): EIO."""


class TierWriteFailed(StoreError):
    """A tier refused a write for a reason other than space (EIO, EROFS on its filesystem):
    counted in the tier's ``errors``; the object stays where it was. EIO to a writer."""


class ConfigError(Exception):
    """Bad configuration or command-line input; the CLI prints it as one line."""


class NamespaceError(StoreError):
    """A namespace operation is not allowed; carries the errno the filesystem returns."""

    def __init__(self, errno_: int, message: str = ""):
        super().__init__(message or f"errno {errno_}")
        self.errno = errno_


class IndexDamaged(ConfigError):
    """The LMDB index is missing, truncated, of an unknown format or holds a record that does
    not parse: the daemon and fsck refuse it with one line that names ``kvfs fsck --repair``."""


class InUse(ConfigError):
    """A state or NVMe directory is held by another kvfs daemon (or fsck)."""
