"""Error codes of the public interface (DESIGN.md, "Errors"); they are the C ABI's return values."""

COLIBRI_OK = 0
COLIBRI_ERR_INVALID_ARGUMENT = -1
COLIBRI_ERR_INVALID_MODEL = -2
COLIBRI_ERR_BACKEND = -3
COLIBRI_ERR_OUT_OF_MEMORY = -4
COLIBRI_ERR_INVALID_MODEL_TYPE = -5
COLIBRI_ERR_UNAVAILABLE = -6
COLIBRI_ERR_TIMEOUT = -7          # a request ran past its deadline (serve --request-timeout)

ERROR_NAMES = {
    COLIBRI_OK: "COLIBRI_OK",
    COLIBRI_ERR_INVALID_ARGUMENT: "COLIBRI_ERR_INVALID_ARGUMENT",
    COLIBRI_ERR_INVALID_MODEL: "COLIBRI_ERR_INVALID_MODEL",
    COLIBRI_ERR_BACKEND: "COLIBRI_ERR_BACKEND",
    COLIBRI_ERR_OUT_OF_MEMORY: "COLIBRI_ERR_OUT_OF_MEMORY",
    COLIBRI_ERR_INVALID_MODEL_TYPE: "COLIBRI_ERR_INVALID_MODEL_TYPE",
    COLIBRI_ERR_UNAVAILABLE: "COLIBRI_ERR_UNAVAILABLE",
    COLIBRI_ERR_TIMEOUT: "COLIBRI_ERR_TIMEOUT",
}


class ColibriError(Exception):
    """Every failure a user can cause. `code` is stable; the message says what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(f"[{ERROR_NAMES.get(code, code)}] {message}")
        self.code = code
        self.message = message

    @property
    def name(self) -> str:
        return ERROR_NAMES.get(self.code, str(self.code))


def invalid_argument(msg):
    return ColibriError(COLIBRI_ERR_INVALID_ARGUMENT, msg)


def invalid_model(path, field, msg):
    """A model-directory error always names the file and the field."""
    return ColibriError(COLIBRI_ERR_INVALID_MODEL, f"{path}: field '{field}': {msg}")


def nonfinite(where: str) -> ColibriError:
    """The outcome of NaN or inf logits: the weights (opening never scans them: pages of experts never
    routed are never read) or an expert routed to hold non-finite values."""
    return ColibriError(COLIBRI_ERR_INVALID_MODEL, f"the model produced non-finite logits (NaN or inf) for {where}: "
                        "its weights, or an expert it routed to, hold NaN or inf values; convert it again from a sound "
                        "checkpoint (`colibri convert` refuses non-finite tensors)")
