"""One module per model family (see docs/families.md, docs/adding-a-family.md). Importing this package
imports every module beside this one (common and registry first, then each family module, by name),
which registers each Family class (registry.register); the drivers (convert.py, gguf_import.py) and
modeldir look families up here and name none. A new family module is found without editing this file."""
from __future__ import annotations

import importlib
import pkgutil

from .registry import FAMILIES, for_arch, for_model_type, supported_archs, supported_model_types  # noqa: F401

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m not in ("common", "registry"):
        importlib.import_module(f"{__name__}.{_m}")

SUPPORTED_MODEL_TYPES = supported_model_types()
SUPPORTED_ARCHS = supported_archs()
