"""Test setup: make the reference helpers in algos_refs.py importable (importlib mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
