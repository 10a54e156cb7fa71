"""Remote-tier tests: fixtures for the real nvmet-tcp target live in tests/target/."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "target"))

from nvmet_fixtures import fresh_target, nvmet_target, open_tier, remote_tier, remote_url  # noqa: E402,F401
