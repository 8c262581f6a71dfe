"""Imported first by every script of bench/ (`import on_path`, found because Python puts a script's
own folder first on sys.path): puts the repository and tests/ on sys.path, and takes bench/ off it
(bench/profile.py would shadow the standard library's `profile` module)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
for folder in (ROOT / "tests", ROOT):
    sys.path.insert(0, str(folder))
