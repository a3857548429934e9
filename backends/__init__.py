"""Backend registry: lazy probes, each importing its library only when asked (DESIGN.md).

    resolve("auto")  ->  cuda, then opencl (GPU/accelerator devices only), then cpu
    COLIBRI_BACKEND overrides "auto"; an explicit name beats the environment.
Each module named here has probe(for_auto) -> (ok, detail) and a Backend class (base.Backend).
"""
from __future__ import annotations

import importlib

from colibri_edge.errors import ColibriError, COLIBRI_ERR_UNAVAILABLE, COLIBRI_ERR_INVALID_ARGUMENT

# name -> module path (relative to this package)
_MODULES = {
    "cuda": ".cuda.backend",
    "opencl": ".opencl.backend",
    "cpu": ".cpu.backend",
    "reference": ".reference.backend",
}
AUTO_ORDER = ("cuda", "opencl", "cpu")
NAMES = tuple(_MODULES)


def _module(name):
    if name not in _MODULES:
        raise ColibriError(COLIBRI_ERR_INVALID_ARGUMENT,
                           f"unknown backend {name!r}; choose one of auto, {', '.join(_MODULES)}")
    try:
        return importlib.import_module(_MODULES[name], __name__)
    except ModuleNotFoundError as e:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"backend {name!r} is not built into this install ({e})")


def probe(name: str, for_auto: bool = False):
    """-> (ok, detail): detail lists devices when ok, or why the backend is missing."""
    try:
        mod = _module(name)
        return mod.probe(for_auto=for_auto)
    except ColibriError as e:
        return False, e.message


def resolve(name: str) -> str:
    """A backend name, with 'auto' resolved through the probes; unavailable -> COLIBRI_ERR_UNAVAILABLE."""
    if name == "auto":
        reasons = []
        for cand in AUTO_ORDER:
            ok, detail = probe(cand, for_auto=True)
            if ok:
                return cand
            reasons.append(f"{cand}: {detail}")
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, "no backend works here: " + "; ".join(reasons))
    ok, detail = _module(name).probe(for_auto=False)
    if not ok:
        raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"backend {name!r} is unavailable: {detail}")
    return name


def backend_class(name: str):
    """The Backend class of a concrete backend name (imports its module, not its library)."""
    return _module(name).Backend


def require_kv_dtype(backend, kv_dtype: str):
    """COLIBRI_ERR_UNAVAILABLE unless `backend` (a Backend class or instance) lists kv_dtype among its
    kv_dtypes (base.Backend), naming the backends that do: their classes are read, no device is probed."""
    if kv_dtype in backend.kv_dtypes:
        return
    takes = []
    for name in NAMES:
        try:
            if kv_dtype in backend_class(name).kv_dtypes:
                takes.append(name)
        except ColibriError:
            continue
    raise ColibriError(COLIBRI_ERR_UNAVAILABLE, f"kv_dtype={kv_dtype!r}: the {backend.name} backend keeps "
                       f"{', '.join(backend.kv_dtypes)} KV caches; {kv_dtype} runs on the {', '.join(takes)} "
                       "backends (backend=...), or leave kv_dtype unset")


def create(name: str, **options):
    """Instantiate a backend by name ('auto' resolves through the probes)."""
    return backend_class(resolve(name))(**options)
