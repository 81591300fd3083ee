"""The errors of fine-tuning and feature extraction that are the user's input to fix: a task
file, a task name, a setting, or a grid whose every job failed. Each is a
:class:`bert_core.failures.Refusal`, so the command line prints its one line (exit 1) and a retry
is never tried; each keeps the builtin type it replaced, so code that catches ``ValueError``,
``FileNotFoundError``, ``KeyError`` or ``RuntimeError`` still does.

Errors that mean a bug here (a task kind with no head, tags of different lengths from our own
decoder) stay plain exceptions and keep their traceback.
"""

from __future__ import annotations

from bert_core.failures import Refusal


class TaskDataError(ValueError, Refusal):
    """A task file's content or a fine-tuning / feature setting that cannot be used."""


class TaskFileMissing(FileNotFoundError, Refusal):
    """A task's data file or folder, or the input of feature extraction, is not there."""


class UnknownTask(KeyError, Refusal):
    """A task name that is not registered, or a malformed ``<task>@<n>``."""

    def __str__(self) -> str:  # KeyError's str() quotes its message; the command line prints it plain
        return str(self.args[0]) if self.args else ""


class AllJobsFailed(RuntimeError, Refusal):
    """Every job of a fine-tuning grid failed (each job's error is in the message)."""
