"""``bertpipe plan``: what ``bertpipe run`` would do with this config and what it would cost.

    bertpipe plan --preset demo
    bertpipe plan --preset bert-base-128 --workers 32 [--json] \
        --assume-size '{storage_root}/downloads/wikipedia/*/enwiki-*-pages-articles*.xml*.bz2=24GB' \
        --assume-size '{storage_root}/books/*.txt=4.6GB'

Each stage: cached or will run, its version and folder, what it reads, and an estimate
(``bert_core.plan``). Nothing is run, no Prefect server is started, nothing is written. Inputs
not fetched yet are named with the command that fetches them; the samples' are counted at the
size they will have (``flows.tools.samples.LAID_OUT_BYTES``), others at 0 unless ``--assume-size``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from bert_core.config import PipelineConfig
from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve

AssumeOpt = Annotated[
    list[str] | None,
    typer.Option("--assume-size", help="GLOB=SIZE: an input glob of the config (it may name {storage_root}) whose files are not here, "
                                       "by its total size (e.g. 'wikipedia/*.xml.bz2=24GB'); repeatable."),
]
PlanWorkersOpt = Annotated[int | None, typer.Option("--workers", min=1,
                                                    help="Beam workers to estimate for (default: config workers).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")]


def make_plan(cfg: PipelineConfig, workers: int | None = None, assume: list[str] | None = None) -> dict[str, Any]:
    """The plan of ``cfg``, its versions by flows/versions.py's rules."""
    from bert_core.config import STORAGE_ROOT
    from bert_core.plan import Folders, build_plan, parse_assumed
    from flows.tools.samples import declared_sizes
    from flows.versions import (
        corpus_folder,
        instances_folder,
        is_done,
        pretrain_folder,
        vocab_folder,
    )

    folders = Folders(corpus_folder, vocab_folder, instances_folder, pretrain_folder, is_done)
    c = cfg.corpus
    return build_plan(cfg, folders, workers, [parse_assumed(a.replace(STORAGE_ROOT, cfg.storage_root)) for a in assume or []],
                      declared_sizes(c.wikipedia + c.books + c.text))


def fetch_hint(row: dict[str, Any]) -> str:
    """What puts a missing input glob's files in place: the command that fetches them, if any."""
    if "samples/" in row["pattern"]:
        return "fetch with `make samples` (or `bertpipe samples fetch samples`)"
    if row["source"] == "wikipedia":
        return "download with `bertpipe download wikipedia --date YYYYMMDD --lang en`"
    return "put the files there"


def _duration(hours: float) -> str:
    seconds = hours * 3600
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} days"


def _hours(value: float | list[float]) -> str:
    if isinstance(value, list):
        return "-".join(_duration(v) for v in value)
    return _duration(value)


def _estimate(stage: dict[str, Any]) -> str:
    e = stage["estimate"]
    if stage["stage"] == "finetune":
        return f"{e['jobs']} jobs, {e['settings_per_job']} runs each (settings x seeds)"
    if stage["stage"] != "pretrain":
        return (f"{e['input_mb']:,.1f} MB on {e['workers']} worker(s): {_duration(e['cpu_hours'])} CPU, "
                f"{_duration(e['wall_hours'])} wall")
    lines = [f"{e['steps']:,} steps, {e['tokens']:,.0f} tokens, {e['flops']:.2e} FLOPs"]
    cpu, gpu = e["cpu"], e["gpu"]
    lines.append(f"CPU: {_duration(cpu['cpu_hours'])} CPU, {_duration(cpu['wall_hours'])} wall on "
                 f"{e['ranks']} rank(s)")
    if e["accelerator"] == "cpu":  # a CPU run has no GPU time to show
        pass
    elif gpu["gpu_hours"] is None:
        lines.append(f"GPU: {gpu['note']}")
    else:
        mfu = "-".join(f"{m:.1%}" for m in gpu["mfu"])
        lines.append(f"GPU: {_hours(gpu['gpu_hours'])} GPU-hours at MFU {mfu} "
                     f"({_hours(gpu['wall_hours'])} wall on {e['ranks']} GPU(s))")
    return "\n".join(lines)


def print_plan(plan: dict[str, Any], as_json: bool = False) -> None:
    """The plan as a table (or JSON), then the machines its figures were measured on."""
    if as_json:
        typer.echo(json.dumps(plan, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plan: {plan['config']} in {plan['storage_root']}", show_lines=True)
    for column in ("stage", "status", "version / output", "reads", "estimate"):
        table.add_column(column, overflow="fold")
    for s in plan["stages"]:
        where = s["output"] or "-"
        if s["note"]:
            where += f"\n({s['note']})"
        status = s["status"] if s["status"] != "cached" else "[green]cached[/green]"
        table.add_row(s["stage"], status, where, "\n".join(s["inputs"]) or "-", _estimate(s))
    console = Console(width=max(Console().width, 120))
    console.print(table)
    sizes = ", ".join(f"{r['pattern']} {r['bytes'] / 1e6:,.1f} MB{' (assumed)' if r['assumed'] else ''}"
                      for r in plan["inputs"])
    missing: dict[str, list[dict[str, Any]]] = {}
    for r in plan["inputs"]:
        if r.get("missing"):
            missing.setdefault(fetch_hint(r), []).append(r)
    for hint, rows in missing.items():  # one line per command that fetches inputs
        sized = all(r["assumed"] for r in rows)
        console.print(f"not here yet: {', '.join(r['pattern'] for r in rows)}; {hint}. "
                      + ("Estimated at their expected size." if sized else
                         "Counted as 0 MB below unless given by --assume-size GLOB=SIZE."))
    dp = plan["data_prep"]
    pre = next(s for s in plan["stages"] if s["stage"] == "pretrain")["estimate"]
    console.print(f"inputs: {sizes or 'none'}")
    console.print(f"data prep still to run: {_duration(dp['cpu_hours'])} CPU, {_duration(dp['wall_hours'])} "
                  f"wall on {plan['workers']} worker(s); per-MB costs measured on {dp['measured_on']}")
    console.print(f"pre-training CPU rate measured on {pre['cpu']['measured_on']}")
    gpu = pre["gpu"]
    if pre["accelerator"] != "cpu":
        console.print(f"GPU MFU: {gpu['note']}" if gpu["gpu_hours"] is None
                      else f"GPU MFU measured on {gpu['measured_on']}; {gpu['note']}")


def plan(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None,
         workers: PlanWorkersOpt = None, assume_size: AssumeOpt = None, as_json: JsonOpt = False) -> None:
    """Show what `bertpipe run` would do: each stage cached or to run, its inputs and outputs,
    and the estimated CPU, GPU and wall time. Runs and writes nothing."""
    cfg = resolve(preset, config, set_)
    print_plan(make_plan(cfg, workers, assume_size), as_json)
