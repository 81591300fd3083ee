"""The ``bertpipe`` command line: the command map in ``main.py``, each stage's commands beside it."""

from flows.cli.main import app, main

__all__ = ["app", "main"]
