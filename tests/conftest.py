"""The one conftest: registers the session's hooks and the fixtures shared across folders,
all defined in the ``support`` package (tests import helpers from there, never from here)."""
import pytest

pytest.register_assert_rewrite("support")

from support.mount import kvfs_cli, kvfs_mount  # noqa: E402,F401
from support.session import (  # noqa: E402,F401
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_call, pytest_sessionfinish,
    pytest_unconfigure)
from support.target import fresh_target, nvmet_target, remote_tier, remote_url  # noqa: E402,F401
from support.users import intruder, tenant  # noqa: E402,F401
