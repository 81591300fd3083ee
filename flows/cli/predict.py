"""``bertpipe predict``: a saved task model run on new text, one JSON line per example.

    bertpipe predict finetune/demo/sentiment/model reviews.txt --output reviews.predictions.jsonl
    bertpipe predict finetune/demo/squad/model questions.jsonl          # rows on stdout

The work is ``bert_core.finetune.predict.predict_file`` (inputs, rows and rejects are described
there). Progress goes to stderr while it runs (``flows/cli/progress.py``), then the counts: read,
kept and rejected by reason. An input of which nothing is kept exits 1 with one line.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer


def predict(
    model: Annotated[str, typer.Argument(help="A task model folder (<finetune output>/<task>/model).")],
    input_: Annotated[str, typer.Argument(metavar="INPUT", help="Text (one example a line, pairs "
                                          "TAB-separated), JSONL, TSV with a header, or SQuAD JSON.")],
    output: Annotated[str | None, typer.Option("--output", "-o", help="JSONL file to write (default: stdout); "
                                               "rejects go beside it.")] = None,
    field: Annotated[str, typer.Option(help="The text field of JSONL / TSV records.")] = "text",
    batch_size: Annotated[int, typer.Option(min=1, help="Examples (or windows) per forward pass.")] = 32,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's own).")] = None,
) -> None:
    """Run a fine-tuned task model on new text; write one JSON line of predictions per example."""
    from bert_core.finetune.predict import predict_file, rejects_uri
    from flows.cli.progress import progress_bars

    with progress_bars() as on_progress:
        c = predict_file(model, input_, output, field=field, batch_size=batch_size, threads=threads,
                         on_progress=on_progress, emit=typer.echo)
    if output is None:
        for r in c["rejects"]:
            typer.echo(f"rejected: {json.dumps(r)}", err=True)
    typer.echo(f"{input_}: read {c['read']}, kept {c['kept']}, rejected {c['rejected']}", err=True)
    for reason, n in c["rejected_by_reason"].items():
        typer.echo(f"  {reason}: {n}", err=True)
    if output is not None:
        if c["rejected"]:
            typer.echo(f"rejects in {rejects_uri(output)}", err=True)
        typer.echo(f"wrote {c['kept']} {c['task']} predictions to {output}", err=True)
