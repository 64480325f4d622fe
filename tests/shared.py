"""Values several tests of one pytest session read, computed once for the whole session, whichever
pytest-xdist worker asks first (`make test` runs four workers).

Each value is a JSON file under the session's temporary root (tests/conftest.py sets `ROOT`), behind a
lock of its own: a worker asking for a key another worker is computing waits for it and reads it. Only
a computation that returned is kept; one that raised is computed again by the next caller, as it would
be without the cache. Nothing outlives the session, so every session computes everything afresh.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

ROOT: Path | None = None  # the session's folder shared by its workers; tests/conftest.py sets it


def once(key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()` for this session's first caller of `key` (anything JSON can write), its stored JSON for
    every later caller, in any worker."""
    assert ROOT is not None, "tests/conftest.py sets tests.shared.ROOT at the start of the session"
    folder = ROOT / "shared"
    folder.mkdir(exist_ok=True)
    path = folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        path.with_suffix(".tmp").write_text(json.dumps(value))
        path.with_suffix(".tmp").replace(path)
        return json.loads(path.read_text())  # the same object every caller gets, JSON's types
