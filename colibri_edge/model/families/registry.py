"""The family registry: one Family subclass per model family, registered with @register (as llama.cpp's
convert_hf_to_gguf.py registers one class per model), looked up by a config.json's model_type or a
GGUF's general.architecture. Imports no family: families/__init__.py imports them all, which registers
them, so the lists below are whole once `colibri_edge.model.families` is imported."""
from __future__ import annotations

from ...errors import ColibriError, COLIBRI_ERR_INVALID_MODEL_TYPE

BY_MODEL_TYPE: dict = {}        # Hugging Face model_type -> the family (an instance)
BY_ARCH: dict = {}              # GGUF general.architecture -> the family
FAMILIES: list = []             # in registration order


def register(cls):
    """Class decorator: registers one instance of the family under each of its model_types and
    gguf_archs (a name registered twice is a programming error)."""
    fam = cls()
    for mt in cls.__dict__.get("model_types", ()):
        if mt in BY_MODEL_TYPE:
            raise RuntimeError(f"model_type {mt!r} registered by {type(BY_MODEL_TYPE[mt]).__name__} and {cls.__name__}")
        BY_MODEL_TYPE[mt] = fam
    for arch in cls.__dict__.get("gguf_archs", ()):
        if arch in BY_ARCH:
            raise RuntimeError(f"GGUF arch {arch!r} registered by {type(BY_ARCH[arch]).__name__} and {cls.__name__}")
        BY_ARCH[arch] = fam
    FAMILIES.append(fam)
    return cls


def supported_model_types() -> tuple:
    return tuple(BY_MODEL_TYPE)


def supported_archs() -> tuple:
    return tuple(BY_ARCH)


def for_model_type(mt, path: str = "config.json", clip: bool = False):
    """The family of a config's model_type; an unknown one refused (COLIBRI_ERR_INVALID_MODEL_TYPE)
    with the supported list."""
    fam = BY_MODEL_TYPE.get(mt) if isinstance(mt, str) else None
    if fam is None:
        shown = f"{mt!r:.60}" if clip else f"{mt!r}"
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{path}: field 'model_type': {shown} is not supported; supported: "
                           f"{', '.join(supported_model_types())}")
    return fam


def for_arch(arch, path: str):
    """The family of a GGUF's general.architecture; an unknown one refused with the supported list."""
    fam = BY_ARCH.get(arch) if isinstance(arch, str) else None
    if fam is None:
        notes = "; ".join(f.gguf_note for f in FAMILIES if f.gguf_note)
        raise ColibriError(COLIBRI_ERR_INVALID_MODEL_TYPE,
                           f"{path}: field 'general.architecture': {arch!r} is not supported; supported: "
                           f"{', '.join(supported_archs())}" + (f" ({notes})" if notes else ""))
    return fam
