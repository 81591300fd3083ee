"""The ``bertpipe`` command line: the command map in ``main.py`` (``flows.cli.main:app``), each
stage's commands beside it. The package imports nothing, so a command module may import its
siblings (``flows.cli.options``) without a circle through the package."""
