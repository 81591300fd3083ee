"""CLI of the pre-training stage: launch DeepSpeed with a progress display.

    bertpipe pretrain --preset demo --instances ./bertpipe-data/instances --output ./runs/demo
    bertpipe pretrain ... --nodes 4 --node-rank 0 --master-addr 10.0.0.2   (one launcher per node)
    bertpipe pretrain ... --nodes 4 --hostfile /job/hostfile               (one launcher, ssh)
    bertpipe pretrain ... --extend-to 20000        (a finished run to 20000 steps of its last phase)

Exit codes: 0 done, 2 the config or data was refused (fix it), 3 the infrastructure failed (run
the same command again: it resumes from the last checkpoint), 1 anything else.
"""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def pretrain(
    instances: Annotated[str, typer.Option(help="Instances folder (instance stage output).")],
    output: Annotated[str, typer.Option(help="Run folder (local or mounted path shared by the nodes).")],
    init_checkpoint: Annotated[
        str | None, typer.Option(help="Transformers-layout folder to start phase 1 from.")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="Machines (sets pretrain.nodes).")] = None,
    node_rank: Annotated[
        int | None, typer.Option(help="This machine's index: one launcher per node (--no_ssh).")
    ] = None,
    master_addr: Annotated[str | None, typer.Option(help="Rank 0's address (pretrain.master_addr).")] = None,
    hostfile: Annotated[str | None, typer.Option(help="DeepSpeed hostfile: ssh launcher.")] = None,
    extend_to: Annotated[int | None, typer.Option(
        help="Continue the finished run in --output to N steps of its last phase, with its optimizer, "
        "schedule, data order and RNG. The rate decays to 0 at max_steps, so: from its newest "
        "checkpoint at or before step max(2, warmup_steps) + 1 (the rates agree up to there) it is "
        "the run set to N from the start; without one it goes on from its last step at the rates of "
        "a run set to N, which is not that run (docs/operations.md). Give the run's own settings.",
        min=1)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also print DeepSpeed's own lines.")] = False,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Pre-train BERT (masked LM, + next-sentence prediction when
    instances.next_sentence_prediction is on; the demo preset has it off) with DeepSpeed on 1..N
    nodes; resumes an interrupted run."""
    sets = list(set_ or [])
    if nodes is not None:
        sets.append(f"pretrain.nodes={nodes}")
    if node_rank is not None:
        sets.append("pretrain.launcher=no_ssh")
    elif hostfile:
        sets += ["pretrain.launcher=hostfile", f"pretrain.hostfile={hostfile}"]
    if hostfile and node_rank is not None:
        sets.append(f"pretrain.hostfile={hostfile}")
    if master_addr:
        sets.append(f"pretrain.master_addr={master_addr}")
    cfg = resolve(preset, config, sets)

    from bert_core.pretrain.run_folder import check_run_config

    if extend_to is not None:  # node 0 (or the one launcher) makes the folder ready
        from bert_core.pretrain.extend import describe, extend_run, read_extended
        from bert_core.pretrain.loop import check_instances

        cfg = extend_run(cfg, output, extend_to, prepare=not node_rank,
                         check=lambda c: check_instances(c, instances, init_checkpoint))
        if not node_rank:
            typer.echo(describe(read_extended(output)[-1]))
    check_run_config(cfg, output)  # before the progress bar: a refusal is one line

    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from bert_core.failures import InfrastructureError, Refusal
    from bert_core.pretrain.launch import LaunchError, launch_pretraining
    from bert_core.pretrain.metrics import MetricsTail, train_rows
    from bert_core.pretrain.run_folder import steps_done, total_steps

    columns = (TextColumn("[bold]pre-training"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TextColumn("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        job = bar.add_task("", total=total_steps(cfg))
        metrics = MetricsTail(output)

        def on_line(line: str) -> None:
            if verbose or not line.startswith("[20"):
                bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            rows = train_rows(metrics.poll())
            if rows:
                bar.update(job, completed=steps_done(cfg, rows), description=f"loss {rows[-1]['loss']:.4f}")

        failed: LaunchError | None = None  # said after the bar's last line: the last word
        try:
            run = launch_pretraining(cfg, instances, output, init_checkpoint, node_rank, on_line)
        except LaunchError as err:
            if isinstance(err, (Refusal, InfrastructureError)):
                raise  # said by the command line's one rule (flows/cli/main.py)
            failed = err
        else:
            bar.update(job, completed=steps_done(cfg, metrics.poll()))
    if failed is not None:  # the job itself failed: its last lines say how
        typer.secho(str(failed), fg="red", err=True)
        raise typer.Exit(1)
    typer.echo(f"pre-trained model: {run}/hf")
