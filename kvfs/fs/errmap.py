"""The one place where store exceptions become errnos."""
from __future__ import annotations

import errno
import functools
import logging

import pyfuse3

from kvfs.errors import (CorruptObject, NamespaceError, NoSuchObject, TierFull, TierUnavailable,
                         TierWriteFailed)

log = logging.getLogger(__name__)

_ERRNO = {
    NoSuchObject: errno.ENOENT,
    CorruptObject: errno.EIO,
    TierFull: errno.ENOSPC,
    TierUnavailable: errno.EIO,
    TierWriteFailed: errno.EIO,
}


def to_errno(exc: BaseException) -> int:
    if isinstance(exc, NamespaceError):
        return exc.errno
    for cls, code in _ERRNO.items():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def translate(fn):
    """Wrap an async pyfuse3 handler so it raises only pyfuse3.FUSEError."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:           # noqa: BLE001 - every error becomes an errno
            code = to_errno(e)
            if code == errno.EIO or not isinstance(e, (NamespaceError, NoSuchObject, TierFull)):
                log.warning("%s failed: %s: %s", fn.__name__, type(e).__name__, e,
                            exc_info=not isinstance(e, (CorruptObject, TierUnavailable, TierWriteFailed, OSError)))
            raise pyfuse3.FUSEError(code) from None
    return wrapper
