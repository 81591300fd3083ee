"""The model card: ``README.md`` in a transformers-layout model folder, written from what the
folder and its lineage record.

    bertpipe export runs/demo/checkpoints --output runs/demo/hf     (writes hf/README.md)
    bertpipe models show current                                      (the record the card quotes)

The card says what the model is (pre-LN or post-LN BERT, sizes), its vocab (size, casing), what
it was trained on (the corpus and vocab manifests behind its run, with their counts, and the
licences of the data sources where a ``SOURCES.md`` beside the data names them), how long (steps
and token positions), and, once the registry holds it, the suite's scores and the gate's
decision; then how to load it with transformers. Everything is read from manifests, registry
records and the folder's own files; this module writes nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from bert_core import storage

CARD = "README.md"
UNRECORDED_LICENCE = "as given by the data's owner (not recorded)"
SOURCES_FILE = "SOURCES.md"  # written by `bertpipe samples fetch`: one row per source, its licence and folders


# --------------------------------------------------------------------------- what the lineage says


def run_counts(run_manifest: dict[str, Any]) -> dict[str, int]:
    """A pre-training run's optimizer steps and token positions (sequences x their length, an
    upper bound on real tokens: packed sequences are nearly full)."""
    phases = (((run_manifest.get("config") or {}).get("pretrain") or {}).get("phases")) or []
    # a manifest of another shape (written by hand, or by an older version) counts what it holds
    tokens = sum(p.get("sequences", 0) * phases[p["phase"] - 1]["max_seq_length"]
                 for p in (run_manifest.get("stats") or {}).get("phases", []) if 0 < p.get("phase", 0) <= len(phases))
    return {"steps": int((run_manifest.get("counts") or {}).get("steps", 0)), "tokens": int(tokens)}


def _input(manifest: dict[str, Any], stage: str) -> dict[str, Any] | None:
    """The manifest of ``manifest``'s input of ``stage``, read where it lies now; None if gone."""
    for entry in manifest.get("inputs", []):
        if entry.get("stage") == stage and entry.get("uri"):
            uri = storage.relocated(manifest, entry["uri"])
            return storage.read_manifest(uri) if storage.has_manifest(uri) else None
    return None


def lineage(run_manifest: dict[str, Any] | None) -> dict[str, dict[str, Any] | None]:
    """The manifests behind a pre-training run: ``{"run", "instances", "corpus", "vocab"}``."""
    instances = _input(run_manifest, "instances") if run_manifest else None
    return {"run": run_manifest, "instances": instances,
            "corpus": _input(instances, "corpus") if instances else None,
            "vocab": _input(instances, "vocab") if instances else None}


def _sources_table(folder: str) -> list[dict[str, str]]:
    """The rows of a ``SOURCES.md`` table: licence and the folders it covers (``news/, wikipedia/``)."""
    rows = []
    lines = [line for line in storage.read_text(storage.join(folder, SOURCES_FILE)).splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return rows
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=False))
        folders = [f.strip().split(" ")[0] for f in cells.get("files", "").split(",")]
        rows.append({"licence": cells.get("licence", ""), "what": cells.get("what", ""),
                     "folders": [f for f in folders if f.endswith("/")]})
    return rows


def licence_of(path: str) -> str:
    """The licence of an input file or folder: its row in the nearest ``SOURCES.md`` above it
    (the folder the row names is the path's first folder below it), else :data:`UNRECORDED_LICENCE`."""
    uri = storage.to_uri(path.split("*", 1)[0]).rstrip("/")
    parts = uri.split("/")
    for n in range(len(parts) - 1, 0, -1):
        here = "/".join(parts[:n])
        if not here or not storage.exists(storage.join(here, SOURCES_FILE)):
            continue
        below = "/".join(parts[n:]) + "/"
        for row in _sources_table(here):
            if any(below.startswith(folder) for folder in row["folders"]):
                return f"{row['licence']} ({row['what']})"
        break
    return UNRECORDED_LICENCE


# --------------------------------------------------------------------------- the card


def _read_json(uri: str) -> dict[str, Any]:
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else {}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _front_matter(corpus: dict[str, Any] | None, tags: list[str]) -> list[str]:
    datasets = ["wikipedia"] if corpus and corpus["config"].get("wikipedia") else []
    out = ["---", "license: other", "language:", "- en", "library_name: transformers", "tags:"]
    out += [f"- {t}" for t in tags]
    if datasets:
        out += ["datasets:"] + [f"- {d}" for d in datasets]
    return [*out, "---", ""]


def _architecture(hf: dict[str, Any]) -> tuple[list[str], bool]:
    pre_ln = bool(hf.get("pre_layer_norm")) or "auto_map" in hf
    kind = ("pre-LN BERT (LayerNorm before each sub-layer; transformers loads it with the modeling "
            "code written beside the weights, `trust_remote_code=True`)" if pre_ln else
            "post-LN BERT, as in the paper (transformers' own `BertModel`)")
    rows = [f"- {kind}",
            f"- {hf.get('num_hidden_layers')} layers, hidden size {hf.get('hidden_size')}, "
            f"{hf.get('num_attention_heads')} attention heads, feed-forward {hf.get('intermediate_size')}, "
            f"activation {hf.get('hidden_act')}, up to {hf.get('max_position_embeddings')} positions"]
    return rows, pre_ln


def _casing(folder: str, vocab_manifest: dict[str, Any] | None) -> bool | None:
    if vocab_manifest and "lowercase" in vocab_manifest.get("config", {}):
        return bool(vocab_manifest["config"]["lowercase"])
    tok = _read_json(storage.join(folder, "tokenizer_config.json"))
    return bool(tok["do_lower_case"]) if "do_lower_case" in tok else None


def _vocab_lines(folder: str, hf: dict[str, Any], vocab: dict[str, Any] | None) -> list[str]:
    vocab_file = storage.join(folder, "vocab.txt")
    size = len(storage.read_text(vocab_file).splitlines()) if storage.exists(vocab_file) else hf.get("vocab_size")
    lowercase = _casing(folder, vocab)
    casing = {True: "uncased (text is lowercased first)", False: "cased", None: "casing not recorded"}
    lines = [f"- WordPiece, {_fmt(size)} tokens, {casing[lowercase]}"]
    if vocab:
        how = "trained on the corpus below" if vocab["counts"].get("trained", True) else (
            f"taken from {vocab['config'].get('vocab_file') or 'an existing vocab'}")
        lines.append(f"- vocab folder `{vocab['uri']}`: {how}")
    return lines


def _data_lines(lin: dict[str, Any], record: dict[str, Any] | None) -> list[str]:
    corpus, instances = lin["corpus"], lin["instances"]
    lines: list[str] = []
    if record and record.get("imported_from"):
        lines.append(f"- imported from `{record['imported_from']}`; licence: {licence_of(record['imported_from'])}")
    if corpus is None:
        if not lines:
            lines.append("- the corpus is not recorded (a model trained elsewhere)")
        return lines
    c = corpus["counts"]
    lines.append(f"- corpus `{corpus['uri']}`: {_fmt(c.get('documents', 0))} documents, "
                 f"{_fmt(c.get('sentences', 0))} sentences" + (f", dump of {record['dump_date']}"
                                                                if record and record.get("dump_date") else ""))
    for kind in ("wikipedia", "books", "text"):
        for path in corpus["config"].get(kind) or []:
            lines.append(f"  - {kind}: `{path}`; licence: {licence_of(path)}")
    if instances:
        i = instances["counts"]
        lines.append(f"- instances `{instances['uri']}`: " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in i.items() if isinstance(v, int | float) and not isinstance(v, bool)))
    return lines


def _training_lines(run: dict[str, Any] | None, record: dict[str, Any] | None) -> list[str]:
    lines = []
    if run:
        counts = run_counts(run)
        lines.append(f"- this run: {_fmt(counts['steps'])} optimizer steps, {_fmt(counts['tokens'])} token "
                     f"positions, run folder `{run['uri']}`")
        if run.get("init_checkpoint"):
            lines.append(f"- continued from `{run['init_checkpoint']}`")
        last = (run.get("stats") or {}).get("eval") or {}
        if last:
            lines.append(f"- held-out masked-LM loss {_fmt(last.get('mlm_loss'))}, accuracy {_fmt(last.get('mlm_acc'))}")
    if record:
        lines.append(f"- the line so far: {_fmt(record.get('steps', 0))} steps, "
                     f"{_fmt(record.get('tokens_seen', 0))} token positions")
    return lines or ["- not recorded"]


def _registry_lines(record: dict[str, Any]) -> list[str]:
    lines = [f"- version `{record['version']}`, parent `{record.get('parent') or '-'}`"
             + (f", made current {record['promoted']}" if record.get("promoted") else "")]
    suite = record.get("suite") or {}
    for side in ("new", "current"):
        scores = suite.get(side) or {}
        for name, s in (scores.get("mlm") or {}).items():
            lines.append(f"- {'this model' if side == 'new' else 'the model it was judged against'}, "
                         f"masked-LM on {name}: loss {_fmt(s.get('mlm_loss'))}, accuracy {_fmt(s.get('mlm_acc'))}")
        for task, s in (scores.get("finetune") or {}).items():
            lines.append(f"- {'this model' if side == 'new' else 'the model it was judged against'}, "
                         f"{task}: {_fmt(s.get('mean'))} ± {_fmt(s.get('sd'))} over {s.get('n', '?')} seeds")
    gate = record.get("gate")
    if gate:
        lines.append(f"- gate: **{gate.get('decision')}**: {gate.get('why', '')}")
    return lines


def _load_lines(pre_ln: bool) -> list[str]:
    remote = ", trust_remote_code=True" if pre_ln else ""
    return ["```python", "from transformers import AutoModelForPreTraining, AutoTokenizer", "",
            'path = "."  # this folder',
            "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)",
            f"model = AutoModelForPreTraining.from_pretrained(path{remote})",
            'outputs = model(**tokenizer("The cat sat on the mat.", return_tensors="pt"))', "```"]


def model_card(folder: str, run_manifest: dict[str, Any] | None = None, record: dict[str, Any] | None = None) -> str:
    """The card of the model in ``folder``: its run's manifest (lineage), and its registry record
    where the registry holds it."""
    hf = _read_json(storage.join(folder, "config.json"))
    lin = lineage(run_manifest)
    arch, pre_ln = _architecture(hf)
    title = f"bertpipe BERT {record['version']}" if record else "bertpipe BERT"
    md = _front_matter(lin["corpus"], ["bert", "fill-mask", "bertpipe", "pre-ln" if pre_ln else "post-ln"])
    intro = ("A public checkpoint imported as the start of a bertpipe model line; heads it lacked start "
             "from a fixed seed." if record and record.get("imported_from") else
             "Pre-trained by bertpipe with the masked-LM and next-sentence objectives.")
    md += [f"# {title}", "", intro, ""]
    md += ["## Architecture", "", *arch, "", "## Vocab", "", *_vocab_lines(folder, hf, lin["vocab"]), ""]
    md += ["## Training data", "", *_data_lines(lin, record), ""]
    md += ["## Training", "", *_training_lines(lin["run"], record), ""]
    if record:
        md += ["## Evaluation and promotion", "", *_registry_lines(record), ""]
    md += ["## How to load", "", *_load_lines(pre_ln), ""]
    return "\n".join(md)


def run_of(folder: str) -> dict[str, Any] | None:
    """The pre-training run manifest behind a model folder: the folder is a run's ``hf/``, or a
    published model whose manifest names its run; None when neither."""
    parent = folder.rstrip("/").rsplit("/", 1)[0]
    if storage.has_manifest(parent) and storage.read_manifest(parent).get("stage") == "pretrain":
        return storage.read_manifest(parent)
    if storage.has_manifest(folder):
        return _input(storage.read_manifest(folder), "pretrain")
    return None


def write_card(folder: str, record: dict[str, Any] | None = None,
               run_manifest: dict[str, Any] | None = None) -> str:
    """Write ``folder/README.md`` (the model card; the run's manifest defaults to :func:`run_of`'s);
    returns its URI. The card is no shard of the folder's manifest: the registry rewrites it as the
    version is judged and promoted."""
    uri = storage.join(folder, CARD)
    storage.write_text(uri, model_card(folder, run_manifest or run_of(folder), record))
    return uri
