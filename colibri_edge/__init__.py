"""Colibri Edge: a mixture-of-experts runtime for edge hardware (CUDA, OpenCL/Mali, CPU)."""


def _map_source_backends():
    """Running from a source tree (PYTHONPATH=repo): map ../backends to colibri_edge.backends, as the
    installed package (setuptools package-dir) does."""
    import importlib.util
    import os
    import sys
    if "colibri_edge.backends" in sys.modules or importlib.util.find_spec("colibri_edge.backends") is not None:
        return
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "backends")
    spec = importlib.util.spec_from_file_location("colibri_edge.backends", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["colibri_edge.backends"] = mod
    spec.loader.exec_module(mod)


_map_source_backends()

from .errors import (ColibriError, COLIBRI_OK, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL,
                     COLIBRI_ERR_BACKEND, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_INVALID_MODEL_TYPE,
                     COLIBRI_ERR_UNAVAILABLE)
from .engine import Engine

__version__ = "0.1.0"
__all__ = ["Engine", "ColibriError", "COLIBRI_OK", "COLIBRI_ERR_INVALID_ARGUMENT", "COLIBRI_ERR_INVALID_MODEL",
           "COLIBRI_ERR_BACKEND", "COLIBRI_ERR_OUT_OF_MEMORY", "COLIBRI_ERR_INVALID_MODEL_TYPE",
           "COLIBRI_ERR_UNAVAILABLE"]