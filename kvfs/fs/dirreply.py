"""One directory entry into a READDIR answer, whichever transport asked (a pyfuse3 token, or
the kernel transport's :class:`kvfs.fs.decoders.DirToken`)."""
from __future__ import annotations

import pyfuse3

from kvfs.fs.decoders import DirToken


def reply(token, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
    """Add the entry; False when the answer is full (the kernel asks again from ``next_id``)."""
    if type(token) is DirToken:
        return token.add(name, attr, next_id)
    return pyfuse3.readdir_reply(token, name, attr, next_id)
