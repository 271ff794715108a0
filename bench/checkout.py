"""The checkout's root on sys.path for a bench run as `python bench/x.py`
(its own folder is on it, the root is not): the test harness (harness/) is
imported from there, as the tests and chaos/ import it; the wheel does not
carry it. Imported for that effect, before `from harness import ...`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
