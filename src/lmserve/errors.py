"""The one error type for anything wrong with a checkpoint on disk."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated, unsupported or does not match its config.

    The message always names the file (or config field) and what is wrong, so a user can act on it.
    """
