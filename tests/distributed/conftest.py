"""Multi-process tests: gloo on 127.0.0.1, a free port per test, explicit timeouts everywhere."""

import sys
from pathlib import Path

# Spawned ranks unpickle the functions of _ranks.py by module name: make the folder importable.
sys.path.insert(0, str(Path(__file__).parent))
