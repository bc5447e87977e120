"""The error types every layer may raise or catch: a user's mistakes before anything runs (a bad checkpoint or
setting), a request the engine refuses, and the engine failing under running requests (the server answers
each without importing the engine's modules)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated, unsupported or does not match its config.

    The message always names the file (or config field) and what is wrong, so a user can act on it.
    """


class ConfigError(ValueError):
    """A setting that cannot work (a flag out of range, a device that is absent, a model that cannot be found).

    Raised before the model loads; the message names the flag and, where there is one, the fix. The CLI
    prints it (and CheckpointError) as one line, `lmserve: error: ...`, and exits 2.
    """


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool, bad token ids...)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param  # the request field at fault


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served any more."""


class StepFailedError(RuntimeError):
    """Sent to each stream whose request was in a failed step: that request ended, the engine serves on."""
