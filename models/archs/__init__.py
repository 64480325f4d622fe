"""The architecture registry: every module of this package defines one `SPEC` (models/spec.py's
ArchSpec), found by name, so adding a family is adding a file. ARCHS keeps the files' order."""

from __future__ import annotations

import importlib
import pkgutil

from models.spec import ArchSpec


def _specs() -> list[ArchSpec]:
    names = sorted(info.name for info in pkgutil.iter_modules(__path__))
    return [importlib.import_module(f"{__name__}.{name}").SPEC for name in names]


ARCHS: dict[str, ArchSpec] = {spec.name: spec for spec in _specs()}
