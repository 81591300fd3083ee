"""A saved task model run on new text: one JSON line of predictions per input example.

    bertpipe predict finetune/demo/sst2/model reviews.txt --output predictions.jsonl

The model folder is what :mod:`bert_core.finetune.task_model` saves (its config.json's
``bertpipe`` block names the task, kind, labels and sequence settings). Inputs, by file name:

- ``*.json``: SQuAD-style JSON (``data[].paragraphs[].qas[]``) for a span model;
- ``*.jsonl`` / ``*.ndjson``: one JSON object a line; the text is ``--field`` (default ``text``),
  a pair adds ``text_pair``; span: ``question`` + ``context``; multiple choice: ``context`` +
  ``endings`` (a list); an ``id`` is echoed;
- ``*.tsv``: a header, then rows (the GLUE column names work too: ``sentence``, ``sentence1`` /
  ``sentence2``, ``question1`` / ``question2``, ``question`` / ``sentence``);
- anything else: plain text, one example a line (a pair, or a context and its endings, TAB-separated).

Rows written, by kind: classification ``{label, probabilities: {label: p}}``; regression
``{score}``; span ``{id, answer, start, end, score}`` (character offsets in the context; SQuAD
v2.0: an empty answer with ``start``/``end`` null when the no-answer score wins); token
``{entities: [{text, label, start, end}]}`` (character offsets in the text); multiple choice
``{choice, probabilities}``. Every row says ``truncated`` (the text lost word pieces to
``max_seq_length``; NER splits long sentences into windows and span contexts slide in
``doc_stride`` windows, so neither truncates a context). A record that cannot be read is skipped
to the rejects (``source``, ``id`` = line or record, ``reason``, ``detail``): kept + rejected = read.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from bert_core import storage
from bert_core.finetune.errors import TaskDataError, TaskFileMissing
from bert_core.progress import OnProgress, Update

# Text columns a TSV or JSON record may use besides --field / text_pair (GLUE's names).
TEXT_A = ("sentence", "sentence1", "question1", "question", "#1 String")
TEXT_B = ("text_pair", "sentence2", "question2", "#2 String", "sentence")
SHAPE_REASONS = ("missing_field", "not_text", "empty_text")


@dataclass
class TaskModel:
    """A loaded task model: the network, its tokenizer and its ``bertpipe`` settings."""

    model: Any
    tokenizer: Any
    meta: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def task(self) -> str:
        return self.meta.get("task", self.kind)


def load(model_dir: str) -> TaskModel:
    """The task model saved in ``model_dir``; one line when the folder is missing or is not one."""
    from bert_core.finetune.task_model import load_task_model
    from bert_core.vocab.tokenization import load_tokenizer

    if not storage.exists(model_dir):
        raise TaskFileMissing(f"{model_dir} does not exist; give the folder of a saved task model "
                              "(the one bertpipe finetune writes beside the chosen setting)")
    model, meta = load_task_model(model_dir)
    model.eval()
    return TaskModel(model, load_tokenizer(model_dir), meta)


# --------------------------------------------------------------------------- reading inputs


@dataclass(frozen=True)
class Record:
    where: int | str  # line number (text, JSONL, TSV) or question id (SQuAD JSON)
    fields: dict[str, Any]


def needs(kind: str, task: str, field: str) -> str:
    """What a model of ``kind`` reads, for the one-line error of a wrong input."""
    if kind == "span":
        return (f"a span model ({task}) needs a question and a context: JSONL with question/context "
                "or SQuAD JSON")
    if kind == "multiple_choice":
        return (f"a multiple-choice model ({task}) needs a context and its endings: JSONL with "
                "context/endings, or lines context<TAB>ending<TAB>ending...")
    if kind == "token":
        return f"a token model ({task}) needs a text: one a line, or JSONL with {field!r}"
    return (f"a {kind} model ({task}) needs a text: one a line (a pair TAB-separated), JSONL with "
            f"{field!r} (and text_pair), or a TSV whose header names {field!r}")


def _read(uri: str) -> str:
    """The whole input as text; a missing, empty, cut or non-UTF-8 file is one line."""
    if not storage.exists(uri):
        raise TaskFileMissing(f"{uri} does not exist; give a text, JSONL, TSV or SQuAD JSON file")
    if uri.endswith(".gz"):
        with storage.open_file(uri, "rb") as f:
            raw = f.read()
        try:
            data = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            raise TaskDataError(f"{uri}: the gzip stream is cut short or damaged ({err}); "
                                "fetch or compress the file again") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TaskDataError(f"{uri}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    else:
        text = storage.read_text(uri)
    if not text.strip():
        raise TaskDataError(f"{uri}: the file is empty; give one example a line (or JSONL, TSV, SQuAD JSON)")
    return text.lstrip("\ufeff")


def squad_records(data: Any, uri: str) -> list[Record]:
    """Every question of SQuAD-style ``data`` (``data[].paragraphs[].qas[]``), answers ignored."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise TaskDataError(f"{uri}: a JSON file must be SQuAD-style ({{'data': [{{'paragraphs': "
                            "[{'context', 'qas': [{'id', 'question'}]}]}]}); for one example a "
                            "line use .jsonl")
    records = []
    for a, article in enumerate(data["data"]):
        for p, paragraph in enumerate(article.get("paragraphs", []) if isinstance(article, dict) else []):
            for q, qa in enumerate(paragraph.get("qas", [])):
                qid = str(qa.get("id", f"data[{a}].paragraphs[{p}].qas[{q}]"))
                records.append(Record(qid, {"id": qid, "question": qa.get("question"),
                                            "context": paragraph.get("context")}))
    return records


def read_records(uri: str, kind: str, task: str, field: str) -> tuple[list[Record], list[dict[str, Any]]]:
    """The input's records (one dict of fields each) and the lines that are no record at all."""
    text = _read(uri)
    name = uri.rsplit("/", 1)[-1].removesuffix(".gz")
    rejects: list[dict[str, Any]] = []
    if name.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TaskDataError(f"{uri}: not whole JSON (line {err.lineno}: {err.msg}); the file may be "
                                "cut short: fetch it again (one object a line is .jsonl)") from None
        if kind != "span":
            raise TaskDataError(f"{uri}: SQuAD JSON, but {needs(kind, task, field)}")
        return squad_records(data, uri), rejects
    lines = text.splitlines()
    if name.endswith((".jsonl", ".ndjson")):
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                rejects.append({"source": uri, "id": n, "reason": "bad_json", "detail": err.msg})
                continue
            if not isinstance(obj, dict):
                rejects.append({"source": uri, "id": n, "reason": "bad_json",
                                "detail": f"a {type(obj).__name__}, not an object"})
                continue
            records.append(Record(n, obj))
        return records, rejects
    if kind == "span":
        raise TaskDataError(f"{uri}: {needs(kind, task, field)}")
    if name.endswith(".tsv"):
        header, records = lines[0].split("\t"), []
        for n, line in enumerate(lines[1:], 2):
            if not line.strip():
                continue
            cells = line.split("\t")
            if len(cells) != len(header):
                rejects.append({"source": uri, "id": n, "reason": "bad_columns",
                                "detail": f"{len(cells)} columns, header has {len(header)}"})
                continue
            records.append(Record(n, dict(zip(header, cells, strict=True))))
        return records, rejects
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if kind == "multiple_choice":
            records.append(Record(n, {"context": parts[0], "endings": parts[1:]}))
        else:
            records.append(Record(n, {field: parts[0], **({"text_pair": parts[1]} if len(parts) > 1 else {})}))
    return records, rejects


class Skip(Exception):
    """A record this model cannot read: ``reason`` and ``detail`` go to the rejects."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _text(fields: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, str]:
    """The first of ``keys`` the record has, and its text (a :class:`Skip` when none is usable)."""
    key = next((k for k in keys if k in fields), None)
    if key is None:
        raise Skip("missing_field", f"no {keys[0]!r} field (has {sorted(fields)[:8]})")
    value = fields[key]
    if not isinstance(value, str):
        raise Skip("not_text", f"{key!r} is a {type(value).__name__}, not a string")
    if not value.strip():
        raise Skip("empty_text", f"{key!r} is empty")
    return key, value


def example_of(kind: str, fields: dict[str, Any], field: str) -> dict[str, Any]:
    """A record as the model of ``kind`` reads it (a :class:`Skip` naming what is missing)."""
    out: dict[str, Any] = {"id": fields["id"]} if "id" in fields else {}
    if kind == "span":
        out["question"] = _text(fields, ("question",))[1]
        out["context"] = _text(fields, ("context",))[1]
        out["id"] = str(fields.get("id", ""))
        return out
    if kind == "multiple_choice":
        out["context"] = _text(fields, ("context", "sent1"))[1]
        endings = fields.get("endings")
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise Skip("missing_field", f"'endings' must list at least two strings (got {endings!r})")
        out["endings"] = endings
        return out
    key, out["text"] = _text(fields, (field, *TEXT_A))
    if kind in ("classification", "regression"):
        pair = tuple(k for k in TEXT_B if k != key and k in fields)
        if pair:
            out["text_pair"] = _text(fields, pair)[1]
    return out


# --------------------------------------------------------------------------- running the model


def forward(tm: TaskModel, features: list[dict[str, Any]], batch_size: int,
            tell: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """The model's logits for each feature, batch by batch (token and span rows trimmed to the
    feature's length); ``tell(n)`` after each batch of ``n`` features."""
    import torch

    from bert_core.finetune.data import collate
    from bert_core.finetune.heads import mask_padding

    out: list[np.ndarray] = []
    with torch.no_grad():
        for i in range(0, len(features), batch_size):
            chunk = features[i : i + batch_size]
            batch = collate(tm.kind, chunk, tm.tokenizer.pad_id)
            logits = mask_padding(tm.kind, tm.model(batch["input_ids"], batch["token_type_ids"],
                                                    batch["attention_mask"]), batch["attention_mask"])
            for f, row in zip(chunk, logits.float().numpy(), strict=True):
                out.append(row[: len(f["input_ids"])] if tm.kind in ("token", "span") else row)
            if tell:
                tell(len(chunk))
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _truncated(tokenizer: Any, pairs: list[tuple[str, str | None]], ids: list[list[int]], max_len: int) -> list[bool]:
    """Which encoded pairs lost word pieces: only a sequence at the limit can have."""
    return [len(i) >= max_len and len(tokenizer.encode(a)) + len(tokenizer.encode(b or "")) + (3 if b is not None else 2) > max_len
            for (a, b), i in zip(pairs, ids, strict=True)]


def classify(tm: TaskModel, pairs: list[tuple[str, str | None]], batch_size: int,
             tell: Callable[[int], None] | None = None) -> tuple[np.ndarray, list[bool]]:
    """Logits [N, C] (regression: scores [N]) of text pairs (``text_b`` None: one text), and
    which were truncated to ``max_seq_length``."""
    from bert_core.finetune.glue import Example, encode_pairs

    max_len = tm.meta["max_seq_length"]
    enc = encode_pairs(tm.tokenizer, [Example(str(i), a, b, None) for i, (a, b) in enumerate(pairs)], max_len)
    feats = [{"input_ids": i, "token_type_ids": t, "label": 0}
             for i, t in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]
    outputs = forward(tm, feats, batch_size, tell)
    return np.array(outputs), _truncated(tm.tokenizer, pairs, enc["input_ids"], max_len)


def label_names(tm: TaskModel, n: int) -> list[str]:
    labels = tm.meta.get("labels") or []
    return [str(x) for x in labels] if len(labels) == n else [str(i) for i in range(n)]


def span_answers(tm: TaskModel, examples: list[dict[str, Any]], batch_size: int,
                 tell: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """``{id, answer, start, end, score, null_odds}`` per question, decoded by SQuAD's own
    post-processing over ``doc_stride`` windows of the context."""
    from bert_core.finetune import squad

    meta = tm.meta
    cfg = SimpleNamespace(squad_max_seq_length=meta["max_seq_length"], doc_stride=meta.get("doc_stride", 128),
                          max_query_length=meta.get("max_query_length", 64))
    sq = [squad.SquadExample(e["id"], e["question"], e["context"], -1, "") for e in examples]
    features = squad.make_features(sq, tm.tokenizer, cfg, training=False)
    outputs = forward(tm, features, batch_size, tell)
    version_2 = bool(meta.get("version_2", meta.get("task") == "squad_v2"))
    _, null_odds, nbest = squad.decode(sq, features, outputs, meta.get("n_best_size", 20),
                                       meta.get("max_answer_length", 30), version_2, offsets=True)
    threshold = float(meta.get("null_score_diff_threshold", 0.0))
    rows = []
    for e in sq:
        best = next((c for c in nbest[e.qid] if c["text"] and "start" in c), None)
        null_wins = best is None or (version_2 and null_odds[e.qid] > threshold)
        row = {"id": e.qid, "answer": "", "start": None, "end": None,
               "score": float(null_odds.get(e.qid, 0.0) + best["score"]) if best else 0.0}
        if not null_wins:
            row.update(answer=best["text"], start=best["start"], end=best["end"], score=best["score"])
        row["truncated"] = len(tm.tokenizer.encode(e.question)) > cfg.max_query_length
        if version_2:
            row["null_odds"] = float(null_odds[e.qid])
        rows.append(row)
    return rows


def tag_entities(tm: TaskModel, texts: list[str], batch_size: int,
                 tell: Callable[[int], None] | None = None) -> list[list[dict[str, Any]]]:
    """Entities per text: words split on whitespace, a tag per word from its first word piece,
    chunked as conlleval.pl chunks; ``start``/``end`` are character offsets in the text."""
    from bert_core.finetune.ner import chunks, encode_sentences

    spans = [[(m.start(), m.end()) for m in re.finditer(r"\S+", t)] for t in texts]
    words = [[t[a:b] for a, b in s] for t, s in zip(texts, spans, strict=True)]
    feats = encode_sentences([(w, ["O"] * len(w)) for w in words], tm.tokenizer, {}, tm.meta["max_seq_length"])
    outputs = forward(tm, feats, batch_size, tell)
    labels = label_names(tm, outputs[0].shape[-1]) if outputs else []
    tags = [["O"] * len(w) for w in words]
    for f, logits in zip(feats, outputs, strict=True):
        best = logits.argmax(-1)
        for k, pos in enumerate(f["firsts"]):
            tags[f["sentence"]][f["first_word"] + k] = labels[int(best[pos])]
    out = []
    for text, s, t in zip(texts, spans, tags, strict=True):
        out.append([{"text": text[s[a][0] : s[b - 1][1]], "label": kind, "start": s[a][0], "end": s[b - 1][1]}
                    for kind, a, b in chunks(t)])
    return out


def choose(tm: TaskModel, examples: list[dict[str, Any]], batch_size: int,
           tell: Callable[[int], None] | None = None) -> list[tuple[np.ndarray, bool]]:
    """Softmax over each example's endings (``[CLS] context [SEP] ending [SEP]``, as SWAG trains),
    and whether any was truncated. Examples with the same number of endings share batches."""
    from bert_core.finetune.glue import Example, encode_pairs

    max_len = tm.meta["max_seq_length"]
    results: list[tuple[np.ndarray, bool]] = [(np.zeros(0), False)] * len(examples)
    by_count: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        by_count.setdefault(len(e["endings"]), []).append(i)
    for count, members in by_count.items():
        pairs = [(examples[i]["context"], ending) for i in members for ending in examples[i]["endings"]]
        enc = encode_pairs(tm.tokenizer, [Example("", a, b, None) for a, b in pairs], max_len)
        cut = _truncated(tm.tokenizer, pairs, enc["input_ids"], max_len)
        feats = [{"input_ids": enc["input_ids"][k * count : (k + 1) * count],
                  "token_type_ids": enc["token_type_ids"][k * count : (k + 1) * count], "label": 0}
                 for k in range(len(members))]
        for k, (i, logits) in enumerate(zip(members, forward(tm, feats, batch_size, tell), strict=True)):
            results[i] = (_softmax(logits), any(cut[k * count : (k + 1) * count]))
    return results


def predict_rows(tm: TaskModel, examples: list[dict[str, Any]], batch_size: int = 32,
                 on_progress: OnProgress | None = None) -> list[dict[str, Any]]:
    """One output row per example (``examples`` as :func:`example_of` gives them)."""
    total, done = len(examples), [0]
    unit = "windows" if tm.kind in ("span", "token") else "examples"

    def tell(n: int) -> None:
        done[0] += n
        if on_progress:
            on_progress(Update("predict", tm.task, done[0], None if unit == "windows" else total, unit))

    echo = [{k: e[k] for k in ("id", "text", "text_pair") if k in e} for e in examples]
    if tm.kind == "span":
        return span_answers(tm, examples, batch_size, tell)
    if tm.kind == "token":
        entities = tag_entities(tm, [e["text"] for e in examples], batch_size, tell)
        return [{**x, "entities": ents, "truncated": False} for x, ents in zip(echo, entities, strict=True)]
    if tm.kind == "multiple_choice":
        return [{**x, "choice": int(p.argmax()), "probabilities": [float(v) for v in p], "truncated": cut}
                for x, (p, cut) in zip(echo, choose(tm, examples, batch_size, tell), strict=True)]
    logits, cut = classify(tm, [(e["text"], e.get("text_pair")) for e in examples], batch_size, tell)
    if tm.kind == "regression":
        return [{**x, "score": float(s), "truncated": c} for x, s, c in zip(echo, logits, cut, strict=True)]
    names = label_names(tm, logits.shape[-1])
    rows = []
    for x, p, c in zip(echo, _softmax(logits) if len(logits) else logits, cut, strict=True):
        rows.append({**x, "label": names[int(p.argmax())],
                     "probabilities": {n: float(v) for n, v in zip(names, p, strict=True)}, "truncated": c})
    return rows


# --------------------------------------------------------------------------- the command's work


def rejects_uri(output: str) -> str:
    """Where the rejects of the predictions file ``output`` go: ``<output>.rejects.jsonl``
    (``source``, ``id``, ``reason``, ``detail``), written on every run, empty when none."""
    return f"{output}.rejects.jsonl"


def predict_file(
    model_dir: str, input_uri: str, output: str | None = None, field: str = "text", batch_size: int = 32,
    threads: int | None = None, on_progress: OnProgress | None = None,
    emit: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the task model in ``model_dir`` on ``input_uri``; write one JSON line per kept record
    to ``output`` (or hand each line to ``emit``) and the rejects to :func:`rejects_uri` (with no
    ``output`` they come back in ``rejects``). Returns the counts ``{read, kept, rejected,
    rejected_by_reason}`` (kept + rejected = read) and ``rejects``.

    An input that is missing, empty, cut short, of the wrong shape for the task, or of which no
    record is kept is a :class:`TaskDataError` / :class:`TaskFileMissing` naming the file."""
    from bert_core.finetune.features import count

    tm = load(model_dir)
    if threads:
        import torch

        torch.set_num_threads(threads)
    records, rejects = read_records(input_uri, tm.kind, tm.task, field)
    examples = []
    for r in records:
        try:
            examples.append(example_of(tm.kind, r.fields, field))
        except Skip as skip:
            rejects.append({"source": input_uri, "id": r.where, "reason": skip.reason, "detail": skip.detail})
    rejects.sort(key=lambda r: (isinstance(r["id"], str), r["id"]))
    counts = count(len(records) + sum(r["reason"] in ("bad_json", "bad_columns") for r in rejects), rejects)
    if output is not None:
        storage.write_text(storage.to_uri(rejects_uri(output)), "".join(json.dumps(r) + "\n" for r in rejects))
    if not examples:
        first = rejects[0] if rejects else None
        if first and all(r["reason"] in SHAPE_REASONS for r in rejects):
            where = f"line {first['id']}" if isinstance(first["id"], int) else f"question {first['id']}"
            raise TaskDataError(f"{input_uri}: {where}: {first['detail']}; "
                                f"{needs(tm.kind, tm.task, field)}")
        reasons = ", ".join(f"{k} {n}" for k, n in counts["rejected_by_reason"].items())
        where = f"see {rejects_uri(output)}" if output else "listed above"
        raise TaskDataError(f"{input_uri}: none of its {counts['read']} records was kept ({reasons}; {where}); "
                            f"{needs(tm.kind, tm.task, field)}")
    rows = predict_rows(tm, examples, batch_size, on_progress)
    lines = _json_lines(rows)
    if output is not None:
        storage.write_text(output, "".join(lines))
    elif emit is not None:
        for line in lines:
            emit(line.rstrip("\n"))
    return {**counts, "rejects": rejects, "kind": tm.kind, "task": tm.task}


def _json_lines(rows: list[dict[str, Any]]) -> Iterator[str]:
    for row in rows:
        yield json.dumps(row, ensure_ascii=False) + "\n"
