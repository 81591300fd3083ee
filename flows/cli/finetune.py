"""CLI of the fine-tuning stage and of frozen feature extraction.

    bertpipe finetune --task sentiment --data samples/tasks --checkpoint samples/models/minilm \
        --output ./ft --seeds 1,2 --learning-rates 1e-4,2e-4
    bertpipe features --checkpoint samples/models/minilm --input tests/fixtures/tasks/ner/valid.txt \
        --output ./features.parquet --layers sum_last_four

``finetune`` runs every (task, setting, seed) here (``--prefect``: as the Prefect flow), with
progress while it runs (jobs done of all, and the running job's steps: ``flows/cli/progress.py``),
and prints the grid on 0-100; ``bertpipe stats <output>`` shows it again.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def finetune(
    task: Annotated[list[str], typer.Option("--task", "-t", help="Task name (repeatable, or a,b).")],
    data: Annotated[str, typer.Option(help="Folder with one sub-folder per task, or the task's own folder.")],
    checkpoint: Annotated[str, typer.Option(help="Our runs' hf/ folder, any transformers BERT folder, "
                                                 "or models:current (models:<version>).")],
    output: Annotated[str, typer.Option(help="Output folder or URI (gs://...).")],
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds, e.g. 1,2,3.")] = None,
    learning_rates: Annotated[str | None, typer.Option(help="Grid, e.g. 5e-5,3e-5,2e-5.")] = None,
    batch_sizes: Annotated[str | None, typer.Option(help="Grid, e.g. 16,32.")] = None,
    epochs: Annotated[str | None, typer.Option(help="Grid, e.g. 2,3,4.")] = None,
    use_prefect: Annotated[bool, typer.Option("--prefect", help="Run as the Prefect flow.")] = False,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Fine-tune a checkpoint on tasks x settings x seeds; select per task on dev; print the grid."""
    from bert_core import storage
    from bert_core.finetune import TASKS
    from bert_core.finetune.grid import checkpoint_name
    from bert_core.finetune.report import (
        failure_lines,
        format_table,
        run_many,
        table_rows,
        task_stats,
    )
    from bert_core.refresh.registry import (
        Registry,
        registered_version,
        registry_root,
        resolve_checkpoint,
        task_models,
    )
    from flows.versions import checkpoint_identity, finetune_version

    tasks = [t.strip().lower() for item in task for t in item.split(",") if t.strip()]
    unknown = [t for t in tasks if t.lower() not in TASKS]
    if unknown:
        typer.secho(f"unknown task(s) {unknown}; choose from {', '.join(sorted(TASKS))}", fg="red", err=True)
        raise typer.Exit(2)
    cfg = resolve(preset, config, set_)
    registered = registered_version(checkpoint, cfg.storage_root)
    checkpoint = resolve_checkpoint(checkpoint, cfg.storage_root)
    cfg.finetune.tasks = tasks
    cfg.finetune.data_dir = data
    for option, field, value, kind in (("--seeds", "seeds", seeds, int),
                                       ("--learning-rates", "learning_rates", learning_rates, float),
                                       ("--batch-sizes", "batch_sizes", batch_sizes, int),
                                       ("--epochs", "epochs", epochs, float)):
        if not value:
            continue
        try:  # validated on assignment, like the rest of the config
            setattr(cfg.finetune, field, [kind(v) for v in value.split(",") if v.strip()])
        except ValueError as err:
            why = err.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(err, "errors") else err
            typer.secho(f"{option} {value!r}: {why}", fg="red", err=True)
            raise typer.Exit(2) from None
    # What every job reads is checked once, before the first starts; a bad task file or setting
    # met later raises a Refusal (bert_core.finetune.errors): one line, exit 1.
    from bert_core.preflight import check_finetune

    check_finetune(cfg, checkpoint)
    if use_prefect:
        from flows.finetune import finetune as finetune_flow

        finetune_flow(cfg, checkpoint=checkpoint, output=output)
        index = storage.read_manifest(output)
    else:
        ident = checkpoint_identity(checkpoint, cfg.storage_root)
        versions = {t: finetune_version(cfg, t, ident) for t in tasks}
        from flows.cli.progress import progress_bars

        with progress_bars() as on_progress:
            index = run_many(tasks, cfg.finetune.seeds, data, checkpoint, cfg.finetune, output,
                             log=lambda m: typer.echo(m, err=True), checkpoint_name=checkpoint_name(checkpoint),
                             versions=versions, on_progress=on_progress)
    if registered:  # a registered model: the registry lists the task models fine-tuned from it
        Registry(registry_root(cfg.storage_root)).add_task_models(registered, task_models(output, tasks))
    typer.echo(format_table(table_rows(task_stats(output, tasks))))
    for line in failure_lines(index.get("failures", [])):
        typer.secho(f"FAILED {line}", fg="red", err=True)
    typer.echo(f"wrote {', '.join(storage.join(output, t) for t in tasks)}; all of {output}: "
               f"bertpipe stats {output}")


def features(
    checkpoint: Annotated[str, typer.Option(help="Transformers-layout BERT folder, or models:current "
                                                 "(models:<version>).")],
    input_: Annotated[str, typer.Option("--input", help="Text file (one sentence a line) or CoNLL file.")],
    output: Annotated[str, typer.Option(help="Parquet file to write.")],
    layers: Annotated[str, typer.Option(help="last | sum_last_four | concat_last_four | all | second_to_last")] = "last",
    input_format: Annotated[str, typer.Option("--format", help="text | conll (auto from the name if omitted)")] = "",
    max_seq_length: Annotated[int, typer.Option(help="Word pieces per window, specials included.")] = 128,
    threads: Annotated[int, typer.Option(help="torch threads")] = 2,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Extract frozen contextual token features (the paper's feature-based approach) to Parquet.

    Prints the sentences read / kept / rejected (by reason); rejects go to
    ``<output>.rejects.jsonl``. An input with no sentence kept exits 1 with one line.
    """
    from bert_core.finetune.features import extract_file, rejects_uri
    from bert_core.refresh.registry import resolve_checkpoint

    checkpoint = resolve_checkpoint(checkpoint, resolve(preset, config, set_).storage_root)
    c = extract_file(checkpoint, input_, output, layers=layers, input_format=input_format or None,
                     max_seq_length=max_seq_length, threads=threads)
    typer.echo(f"{input_}: read {c['read']}, kept {c['kept']}, rejected {c['rejected']}")
    for reason, n in c["rejected_by_reason"].items():
        typer.echo(f"  {reason}: {n}")
    if c["rejected"]:
        typer.echo(f"rejects in {rejects_uri(output)}")
    typer.echo(f"wrote {c['kept']} sentences of {layers} features to {output}")
