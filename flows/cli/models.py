"""``bertpipe models``: the model registry of the config's storage root.

    bertpipe models list
    bertpipe models show VERSION          (or current, previous)
    bertpipe models promote VERSION
    bertpipe models rollback
    bertpipe models import PATH           (a transformers-layout checkpoint starts the line)

The work is ``bert_core.refresh.registry``; ``models:current`` (or ``models:<version>``) names a
registered model wherever a command takes a checkpoint.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve

VersionArg = Annotated[str, typer.Argument(help="A registered version, or current / previous.")]


def _registry(preset: str, config: str | None, set_: list[str] | None):
    from bert_core.refresh.registry import Registry, registry_root

    return Registry(registry_root(resolve(preset, config, set_).storage_root))


def _version(registry: Any, ref: str) -> str:
    from bert_core.refresh.registry import ALIASES, RegistryError

    if ref not in ALIASES:
        return ref
    version = registry.aliases()[ref]
    if version is None:
        raise RegistryError(f"the registry {registry.root} has no {ref} model yet")
    return version


def format_versions(records: list[dict[str, Any]], aliases: dict[str, Any]) -> str:
    """One line per version: alias, version, parent, dump date, steps, tokens, gate decision; below
    it, one line per task model fine-tuned from it: task, score, setting and seed, folder."""
    marks = {aliases.get(a): a for a in ("previous", "current") if aliases.get(a)}
    header = f"{'alias':<9} {'version':<14} {'parent':<14} {'dump':<9} {'steps':>7} {'tokens':>11}  gate"
    lines = [header]
    for r in records:
        gate = r.get("gate") or {}
        lines.append(f"{marks.get(r['version'], ''):<9} {r['version']:<14} {r.get('parent') or '-':<14} "
                     f"{r.get('dump_date') or '-':<9} {r.get('steps', 0):>7} {r.get('tokens_seen', 0):>11}  "
                     f"{gate.get('decision', '-')}")
        for task, m in sorted((r.get("task_models") or {}).items()):
            score = "-" if m.get("score") is None else f"{m['score']:.1f}"
            lines.append(f"{'':<9} └ {task:<12} {m['metric']} {score} on {m['split']}, "
                         f"{m['setting']} seed {m['seed']}: {m['model']}")
    return "\n".join(lines)


def models_list(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Every registered model version, oldest first, with the aliases."""
    registry = _registry(preset, config, set_)
    records = registry.versions()
    if not records:
        typer.echo(f"no model versions in {registry.root} yet; `bertpipe refresh` makes the first")
        return
    typer.echo(format_versions(records, registry.aliases()))


def models_show(version: VersionArg, preset: PresetOpt = "demo", config: ConfigOpt = None,
                set_: SetOpt = None) -> None:
    """A version's whole record (lineage, inputs, suite scores, gate decision) as JSON."""
    registry = _registry(preset, config, set_)
    typer.echo(json.dumps(registry.get(_version(registry, version)), indent=2, sort_keys=True))


def models_promote(version: VersionArg, preset: PresetOpt = "demo", config: ConfigOpt = None,
                   set_: SetOpt = None) -> None:
    """Make a version current by hand (its folder must be whole); the old current becomes previous."""
    registry = _registry(preset, config, set_)
    aliases = registry.promote(_version(registry, version))
    typer.echo(f"current: {aliases['current']} (previous: {aliases['previous'] or '-'})")


def models_rollback(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Make the previous model current again."""
    aliases = _registry(preset, config, set_).rollback()
    typer.echo(f"current: {aliases['current']} (previous: {aliases['previous'] or '-'})")



def models_import(path: Annotated[str, typer.Argument(help="A transformers-layout model folder (config.json, "
                                                           "weights, vocab.txt).")],
                  preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Register a transformers-layout checkpoint as a version of the line; its vocab becomes the
    line's vocab, so that `bertpipe refresh` continues it."""
    from bert_core.refresh.importing import import_model

    cfg = resolve(preset, config, set_)
    record = import_model(path, cfg.storage_root)
    typer.echo(f"imported {path} as {record['version']}, now current (vocab {record['vocab']}); "
               "`bertpipe refresh` continues it, `bertpipe models rollback` undoes the import")
