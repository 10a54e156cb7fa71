"""The tests' helpers, one module per concern; test modules import them as
``from support.<module> import ...`` (pyproject's pytest ``pythonpath`` puts ``tests`` on the
path). Fixtures used across folders are registered by ``tests/conftest.py``.

* ``mount``: kvfs through its CLI: ``Mount``, ``kvfs_mount``, ``open_mount``, ``run_kvfs``,
  ``wait_for``, the per-module ``mnt``/``d`` fixtures, stats and metrics of a mount.
* ``files``: files through a mount: seeded content, reads, ``put``, ``tier_of``, errnos,
  xattrs, ``renameat2``, ``fallocate``, ``direct_read``.
* ``bigfile``: big files written and checked a MiB at a time.
* ``users``: real second and third users, ``reachable``.
* ``store``: real tiers and stores without the kernel, ``plant_record``.
* ``share``: shared-volume nodes and the share status of a mount.
* ``nvmet``: the real NVMe/TCP target in QEMU (also a script: ``python tests/support/nvmet.py up``).
* ``target``: the target's fixtures and ``open_tier``.
* ``fsx``: the fsx-style exerciser (also a script: ``python tests/support/fsx.py``).
* ``kv``: the KV tests' layout and exit child (needs torch).
* ``released``, ``drivers``: the runtimes' released code and the adapters' drivers.
* ``session``: the session's pytest hooks (base directory, FUSE skip, watchdog).
"""
