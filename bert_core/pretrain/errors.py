"""Errors of a pre-training run that a retry cannot fix, and how a rank reports them: one line
starting with ``bertpipe-config-error:`` and exit code 2, which the launcher reads."""

from __future__ import annotations

from bert_core.config import ConfigError

CONFIG_ERROR_EXIT = 2
CONFIG_ERROR_PREFIX = "bertpipe-config-error:"


class PretrainConfigError(ConfigError):
    """The run cannot start with this config/data (not an infrastructure failure)."""


class CheckpointWriteError(PretrainConfigError):
    """A checkpoint could not be written (full or read-only disk): a retry fails the same way."""


def first_line(err: BaseException) -> str:
    """The line of ``err`` that says what went wrong, at most 240 characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # torch's weights-only refusal explains itself over many lines; the global it met says it all
    unsupported = [line for line in lines if "Unsupported global" in line]
    return ((unsupported or lines or [type(err).__name__])[0])[:240]
