"""Colibri Edge: a mixture-of-experts runtime for edge hardware (CUDA, OpenCL/Mali, CPU)."""


from .errors import (ColibriError, COLIBRI_OK, COLIBRI_ERR_INVALID_ARGUMENT, COLIBRI_ERR_INVALID_MODEL,
                     COLIBRI_ERR_BACKEND, COLIBRI_ERR_OUT_OF_MEMORY, COLIBRI_ERR_INVALID_MODEL_TYPE,
                     COLIBRI_ERR_UNAVAILABLE)
from .requests.engine import Engine
from .requests.aio import AsyncEngine
from .requests.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "AsyncEngine", "SamplingParams", "ColibriError", "COLIBRI_OK", "COLIBRI_ERR_INVALID_ARGUMENT", "COLIBRI_ERR_INVALID_MODEL",
           "COLIBRI_ERR_BACKEND", "COLIBRI_ERR_OUT_OF_MEMORY", "COLIBRI_ERR_INVALID_MODEL_TYPE",
           "COLIBRI_ERR_UNAVAILABLE"]