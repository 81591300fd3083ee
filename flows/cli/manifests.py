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


def number(value: Any) -> str:
    """A value as a person reads it: thousands separated, fractions to 4 significant digits."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} ({number(v)})" if isinstance(v, dict) else f"{k} {number(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(number(v) for v in value)
    return str(value)


def table(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    """Two aligned columns: names left, values right-aligned when every one is a number."""
    if not rows:
        return []
    width = max(len(k) for k, _ in rows)
    numeric = all(v.replace(",", "").replace(".", "").replace("-", "").replace("e", "").replace("+", "").isdigit()
                  for _, v in rows)
    vwidth = max(len(v) for _, v in rows) if numeric else 0
    return [f"{indent}{k:<{width}}  {v:>{vwidth}}" for k, v in rows]


# What a stored mask says when the loader masks: nothing was masked on disk.
_MASK_KEYS = ("masked_per_instance", "masked_fraction", "masked_fraction_of_maskable", "mask_token_fraction",
              "kept_fraction", "random_token_fraction")


def format_stats(manifest: dict[str, Any]) -> str:
    """Counts, then one table per stats entry (a per-length summary, or any flat dict), numbers
    rounded; instances masked by the loader (dynamic masking) say so instead of masked fractions of 0."""
    lines = [f"{manifest['stage']} at {manifest['uri']} ({manifest['created']})"]
    lines += table([(k, number(v)) for k, v in manifest.get("counts", {}).items()])
    stats = manifest.get("stats", {})
    if stats and all(isinstance(v, dict) for v in stats.values()):
        # JSON keys come back sorted as text (seq128 < seq64): order per-length blocks by length
        blocks = sorted(stats.items(), key=lambda kv: (kv[1].get("max_seq_length", 0), kv[0]))
    else:
        blocks = [("stats", stats)]
    from bert_core.instances.stats import InstanceStats

    order = list(InstanceStats(max_seq_length=8).summary())  # instance stats in reading order
    dynamic = manifest["stage"] == "instances" and (manifest.get("config") or {}).get("masking") == "dynamic"
    for name, block in blocks:
        if is_histogram(block):
            lines.append(f"{name}: {Histogram.from_json(block).trimmed().format()}")
            continue
        lines.append(f"{name}:")
        keys = sorted(block, key=lambda k: (order.index(k) if k in order else len(order), k))
        rows, histograms = [], []
        if dynamic and "max_seq_length" in block:
            rows.append(("masking", "dynamic: the loader masks each sequence anew every epoch (none stored)"))
        for key in keys:
            value = block[key]
            if key == "counts" or (dynamic and key in _MASK_KEYS):
                continue
            if is_histogram(value):
                histograms.append(f"  {key}: {Histogram.from_json(value).trimmed().format()}")
            else:
                rows.append((key, number(value)))
        lines += table(rows) + histograms
    return "\n".join(lines)


def plain_markdown(md: str) -> str:
    """Markdown as terminal text: headings and emphasis marks dropped, tables as aligned columns."""
    out: list[str] = []
    rows: list[list[str]] = []

    def flush() -> None:
        if rows:
            widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
            out.extend("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows)
            rows.clear()

    for line in md.splitlines():
        text = line.replace("**", "").replace("`", "")
        if text.startswith("|"):
            cells = [c.strip() for c in text.strip().strip("|").split("|")]
            if not all(set(c) <= set(":-") for c in cells):
                rows.append(cells)
            continue
        flush()
        out.append(text.lstrip("#").strip() if text.startswith("#") else text)
    flush()
    return "\n".join(out)
