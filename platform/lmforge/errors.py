"""Errors that reach the user as one line and exit code 2.

Anything raised as a `UserError` is the user's input being wrong (a field, a
file, a cluster too small); the CLI prints it without a traceback.
"""


class UserError(Exception):
    """Bad input: printed as one line, exit code 2, nothing started."""

    exit_code = 2


class TrainingFailed(RuntimeError):
    """A rank or the controller raised during training: printed as one line with
    where the full traceback was saved, exit code 1."""

    exit_code = 1


class CheckpointWritesFailing(RuntimeError):
    """`checkpoint.max_failed_writes` checkpoints in a row could not be written:
    restarting would not help, so the controller does not retry it."""
