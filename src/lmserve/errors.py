"""The error types for mistakes a user makes before anything runs: a bad checkpoint or a bad setting."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated, unsupported or does not match its config.

    The message always names the file (or config field) and what is wrong, so a user can act on it.
    """


class ConfigError(ValueError):
    """A setting that cannot work (a flag out of range, a device that is absent, a model that cannot be found).

    Raised before the model loads; the message names the flag and, where there is one, the fix. The CLI
    prints it (and CheckpointError) as one line, `lmserve: error: ...`, and exits 2.
    """
