"""Store-level tests run without the kernel; the real target's fixtures come from tests/target."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "target"))
