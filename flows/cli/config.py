"""``bertpipe config``: the resolved configuration and the presets.

    bertpipe config show --preset bert-base-128 --set pretrain.nodes=2
    bertpipe config show --preset demo --deepspeed    (the DeepSpeed config of phase 1, RUN = the run folder)
    bertpipe config presets
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
import yaml

from bert_core.config import preset_names
from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve


def config_show(
    preset: PresetOpt = "demo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML.")] = False,
    deepspeed: Annotated[bool, typer.Option(
        "--deepspeed", help="The DeepSpeed config of the first phase instead (pretrain.deepspeed merged in; "
        "RUN stands for the run folder).")] = False,
) -> None:
    """Print the resolved configuration (preset + file + --set)."""
    resolved = resolve(preset, config, set_)
    if deepspeed:
        from bert_core.pretrain.ds_config import ds_config

        cfg = ds_config(resolved.pretrain, 0, "RUN")
    else:
        cfg = resolved.model_dump(mode="json")
    typer.echo(json.dumps(cfg, indent=2) if as_json else yaml.safe_dump(cfg, sort_keys=False))


def config_presets() -> None:
    """List the presets shipped with the package."""
    for name in preset_names():
        typer.echo(name)
