"""Commands that read any stage's output folder through its manifest.

    bertpipe stats ./bertpipe-data/instances          (any stage's _MANIFEST.json)
    bertpipe stats ./bertpipe-data/instances --json
    bertpipe stats ./bertpipe-data/finetune           (every checkpoint's fine-tuning results)
    bertpipe verify ./bertpipe-data/instances         (every shard against its manifest's sha256)
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from bert_core.histogram import Histogram, is_histogram


def stats(
    uri: Annotated[str, typer.Argument(help="A stage's output folder (with _MANIFEST.json).")],
    as_json: Annotated[bool, typer.Option("--json", help="The raw stats as JSON.")] = False,
) -> None:
    """Print the counts and statistics stored in a folder's manifest."""
    from bert_core.storage import read_manifest

    manifest = read_manifest(uri)
    if as_json:
        typer.echo(json.dumps({"counts": manifest["counts"], "stats": manifest["stats"]}, indent=2))
    elif manifest["stage"] in ("finetune", "finetune-index"):
        from bert_core.finetune.report import format_manifest

        typer.echo(format_manifest(manifest))
    else:
        typer.echo(format_stats(manifest))


def verify(
    uri: Annotated[str, typer.Argument(help="A stage's output folder; its sub-folders with a manifest too.")],
) -> None:
    """Check every shard of a folder (and of its sub-folders) against its manifest: size and sha256.
    A run that holds the folder's lease (``bert_core.lease``) is named too."""
    from bert_core import lease, storage

    storage.read_manifest(uri)
    held = lease.in_progress(uri)
    if held:
        typer.echo(f"note: {storage.to_uri(uri)} is being written by {lease.Record(**held).describe()}")
    found = storage.glob(storage.join(uri, "**", storage.MANIFEST))
    folders = sorted({storage.to_uri(uri).rstrip("/"), *(m.rsplit("/", 1)[0] for m in found)})
    bad = 0
    for folder in folders:
        manifest = storage.read_manifest(folder)
        problems = storage.shard_problems(folder, manifest, checksums=True)
        bad += len(problems)
        for problem in problems:
            typer.secho(f"  {problem}", fg="red", err=True)
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        typer.echo(f"{status}: {folder} ({len(manifest['shards'])} shards, {manifest['stage']} stage)")
    if bad:
        typer.secho(f"{bad} shard(s) do not match their manifest; re-run the stage that wrote them",
                    fg="red", err=True)
        raise typer.Exit(1)


def format_stats(manifest: dict[str, Any]) -> str:
    """Counts, then one block per stats entry (a per-length summary, or any flat dict)."""
    lines = [f"{manifest['stage']} at {manifest['uri']} ({manifest['created']})"]
    lines += [f"  {k}: {v}" for k, v in manifest.get("counts", {}).items()]
    stats = manifest.get("stats", {})
    if stats and all(isinstance(v, dict) for v in stats.values()):
        # JSON keys come back sorted as text (seq128 < seq64): order per-length blocks by length
        blocks = sorted(stats.items(), key=lambda kv: (kv[1].get("max_seq_length", 0), kv[0]))
    else:
        blocks = [("stats", stats)]
    from bert_core.instances.stats import InstanceStats

    order = list(InstanceStats(max_seq_length=8).summary())  # instance stats in reading order
    for name, block in blocks:
        if is_histogram(block):
            lines.append(f"{name}: {Histogram.from_json(block).trimmed().format()}")
            continue
        lines.append(f"{name}:")
        keys = sorted(block, key=lambda k: (order.index(k) if k in order else len(order), k))
        for key, value in ((k, block[k]) for k in keys):
            if key == "counts":
                continue
            if is_histogram(value):
                value = Histogram.from_json(value).trimmed().format()
            elif isinstance(value, dict):
                value = ", ".join(f"{k}: {v}" for k, v in value.items())
            lines.append(f"  {key}: {value}")
    return "\n".join(lines)
