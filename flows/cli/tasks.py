"""``bertpipe tasks fetch``: the fine-tuning tasks' data from its official locations, verified,
into ``<storage_root>/tasks/<Folder>/`` where the bert-base presets' ``finetune.data_dir`` reads.

    bertpipe tasks fetch glue squad swag
    bertpipe tasks fetch mrpc --set storage_root=gs://bucket/bert
    bertpipe tasks fetch ner --url ner=https://mirror.example/conll2003
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.options import ConfigOpt, PresetOpt, RetriesOpt, SetOpt, StagingOpt, resolve


def tasks_fetch(
    names: Annotated[list[str] | None, typer.Argument(
        help="Task data to fetch: glue (its nine tasks), cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, "
             "wnli, squad (v1.1), squad_v2, swag, ner.", show_default=False)] = None,
    to: Annotated[str | None, typer.Option(
        help="Folder of task folders (default: <storage_root>/tasks).")] = None,
    url: Annotated[list[str] | None, typer.Option(
        "--url", help="NAME=URL: a folder holding that task's files under their official names "
                      "(ner: train.txt, valid.txt, test.txt); repeatable.")] = None,
    staging: StagingOpt = None,
    retries: RetriesOpt = 5,
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Download task data (GLUE, SQuAD, SWAG), verified against pinned sha256, unpacked for its reader."""
    from bert_core import storage
    from bert_core.config import ConfigError
    from bert_core.finetune.fetch import fetch_task, task_names

    wanted = task_names(names or [])
    urls: dict[str, str] = {}
    for given in url or []:
        name, eq, where = given.partition("=")
        if not eq or not where or name.lower() not in wanted:
            raise ConfigError(f"--url {given!r}: give NAME=URL for a task this command fetches "
                              f"({', '.join(wanted)}), e.g. --url ner=https://mirror.example/conll2003")
        urls[name.lower()] = where
    if to is not None and storage.is_local(to) and Path(storage.to_uri(to)).is_file():
        raise ConfigError(f"--to {to} is a file; give a folder: the task folders go under it")
    data_dir = to or storage.join(resolve(preset, config, set_).storage_root, "tasks")
    for name in wanted:
        manifest = fetch_task(name, data_dir, url=urls.get(name), staging=staging, retries=retries,
                              log=lambda m: typer.echo(m, err=True))
        if manifest is None:
            typer.echo(f"{name}: the files put there by hand, under {data_dir}")
            continue
        typer.echo(f"{name}: {manifest['counts']['files']} file(s), {manifest['counts']['bytes']} bytes "
                   f"-> {manifest['uri']}")
