"""Options every ``bertpipe`` command that reads config takes, and the config they resolve to."""

from __future__ import annotations

from typing import Annotated

import typer

from bert_core.config import PipelineConfig, load_config, preset_names
from bert_core.pretrain.ds_config import check_deepspeed

PresetOpt = Annotated[str, typer.Option("--preset", "-p", help=f"Preset: {', '.join(preset_names())}.")]
ConfigOpt = Annotated[
    str | None, typer.Option("--config", "-c", help="YAML file shaped like a preset; overrides it.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field, e.g. instances.dupe_factor=2 (repeatable)."),
]
# Options of the resumable downloads (`download wikipedia`, `tasks fetch`).
StagingOpt = Annotated[str | None, typer.Option(help="Local folder for resumable .part files.")]
RetriesOpt = Annotated[int, typer.Option(help="Resume attempts per file.")]
# Options of the Beam stages; Beam's own options go after `--`.
WorkersOpt = Annotated[int | None, typer.Option(help="Beam worker processes (default: config workers).")]
RunnerOpt = Annotated[
    str | None,
    typer.Option(help="Beam runner: local, dask (a Dask cluster: -- --dask_scheduler_file=F or "
                      "--dask_client_address=A), or a Beam runner name (default: config beam_runner)."),
]


def beam_run(cfg: PipelineConfig, ctx: typer.Context, workers: int | None, runner: str | None) -> dict:
    """What every Beam stage command hands its job: the worker count, the runner, the Beam
    arguments of the config and of the command line, and whether the output is shared storage."""
    return {"workers": workers or cfg.workers, "runner": runner or cfg.beam_runner,
            "beam_args": [*cfg.beam_args, *ctx.args], "shared_storage": cfg.shared_storage}


def resolve(preset: str, config: str | None, sets: list[str] | None) -> PipelineConfig:
    """The config of a command: the preset, then the file, then each ``--set``; its
    ``pretrain.deepspeed`` checked against DeepSpeed's keys and the typed settings."""
    cfg = load_config(preset, config, sets or [])
    check_deepspeed(cfg.pretrain)  # the config layer sits below the DeepSpeed rendering it checks against
    return cfg
