"""Frozen contextual features from any checkpoint (the paper's feature-based approach) -> Parquet.

    bertpipe features --checkpoint samples/models/minilm --input tests/fixtures/tasks/ner/valid.txt         --output features.parquet --layers concat_last_four

One vector per *word* (its first word piece, as in the paper's CoNLL ablation) from a choice
of layers. Input is a text file (one sentence a line) or a CoNLL column file; rejected
sentences go to ``<output>.rejects.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from bert_core import storage
from bert_core.finetune.errors import TaskDataError, TaskFileMissing

LAYER_CHOICES = ("embeddings", "last", "second_to_last", "sum_last_four", "concat_last_four", "all")


def combine_layers(hidden_states: Sequence[Any], layers: str) -> Any:
    """``hidden_states`` = (embeddings, layer 1, ..., layer L), each [B, T, H] -> [B, T, D].

    ``layers``: ``embeddings``, ``last``, ``second_to_last``, ``sum_last_four``,
    ``concat_last_four``, ``all`` (sum of every encoder layer).
    """
    import torch

    encoder = hidden_states[1:]
    if layers == "embeddings":
        return hidden_states[0]
    if layers == "last":
        return encoder[-1]
    if layers == "second_to_last":
        return encoder[-2] if len(encoder) > 1 else encoder[-1]
    if layers == "sum_last_four":
        return torch.stack(encoder[-4:]).sum(0)
    if layers == "concat_last_four":
        last4 = list(encoder[-4:])
        # A model with fewer than 4 layers repeats its first one, so dim stays 4 x hidden.
        last4 = [last4[0]] * (4 - len(last4)) + last4
        return torch.cat(last4, dim=-1)
    if layers == "all":
        return torch.stack(encoder).sum(0)
    raise TaskDataError(f"layers={layers!r}; choose one of {', '.join(LAYER_CHOICES)}")


def feature_dim(hidden_size: int, layers: str) -> int:
    return hidden_size * (4 if layers == "concat_last_four" else 1)


def word_features(
    model: Any, tokenizer: Any, sentences: Sequence[Sequence[str]], layers: str = "last",
    max_seq_length: int = 128, batch_size: int = 32,
) -> list[np.ndarray]:
    """Frozen features, one [n_words, dim] float32 array per sentence (first piece of each word)."""
    import torch

    from bert_core.finetune.data import collate
    from bert_core.finetune.ner import encode_sentences

    if layers not in LAYER_CHOICES:
        raise TaskDataError(f"layers={layers!r}; choose one of {', '.join(LAYER_CHOICES)}")
    dim = feature_dim(model.config.hidden_size, layers)
    windows = encode_sentences([(list(w), ["O"] * len(w)) for w in sentences], tokenizer, {},
                               max_seq_length)
    out = [np.zeros((len(w), dim), dtype=np.float32) for w in sentences]
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            chunk = windows[i : i + batch_size]
            batch = collate("token", chunk, tokenizer.pad_id)
            hs = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                       output_hidden_states=True).hidden_states
            feats = combine_layers(hs, layers).float().numpy()  # [B, T, D]
            for f, row in zip(chunk, feats, strict=True):
                words = out[f["sentence"]]
                words[f["first_word"] : f["first_word"] + len(f["firsts"])] = row[f["firsts"]]
    return out


def rejects_uri(output: str) -> str:
    """Where the rejects of the features file ``output`` go.

    ``<output>.rejects.jsonl``: records ``source``, ``id``, ``reason``, ``detail``, one per
    dropped CoNLL sentence (``id`` its first bad line); written on every run, empty when nothing
    was dropped.
    """
    return f"{output}.rejects.jsonl"


def input_format_of(uri: str, input_format: str | None) -> str:
    fmt = input_format or ("conll" if uri.endswith((".conll", "train.txt", "valid.txt", "test.txt",
                                                     ".train", ".testa", ".testb")) else "text")
    if fmt not in ("text", "conll"):
        raise TaskDataError(f"--format {fmt!r}: use text or conll")
    return fmt


def read_input(uri: str, fmt: str) -> tuple[list[list[str]], list[list[str]] | None, list[dict[str, Any]], int]:
    """Words per sentence, tags (CoNLL only), rejects and the number of sentences read.

    A text file has one sentence a line, words split on whitespace; a CoNLL column file keeps
    its tags. Sentences longer than a window are split at word boundaries.
    """
    try:
        if fmt == "conll":
            from bert_core.finetune.ner import read_conll

            sentences, rejects = read_conll(uri)
            return [w for w, _ in sentences], [t for _, t in sentences], rejects, len(sentences) + len(rejects)
        lines = [line.split() for line in storage.read_text(uri).splitlines()]
    except UnicodeDecodeError as err:
        raise TaskDataError(f"{uri}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    words = [w for w in lines if w]
    return words, None, [], len(words)


def count(read: int, rejects: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sentences read, kept and rejected (by reason); kept + rejected = read."""
    by_reason: dict[str, int] = {}
    for r in rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    return {"read": read, "kept": read - len(rejects), "rejected": len(rejects), "rejected_by_reason": by_reason}


def nothing_kept(uri: str, fmt: str, counts: dict[str, Any], rejects_file: str) -> str:
    """The one-line error for an input of which no sentence is kept."""
    if counts["read"] == 0:
        return (f"{uri}: no sentences (the file is empty or blank); give one sentence a line "
                "(--format text) or CoNLL columns (word ... tag, blank line between sentences)")
    reasons = ", ".join(f"{reason} {n}" for reason, n in counts["rejected_by_reason"].items())
    fix = "the last column must be O, B-TYPE or I-TYPE"
    if fmt == "conll":
        fix += ", or pass --format text if it is plain text (one sentence a line)"
    return (f"{uri}: none of its {counts['read']} sentences was kept ({reasons}; see {rejects_file}); "
            f"{fix}")


def extract_file(
    checkpoint: str, input_uri: str, output: str, layers: str = "last", input_format: str | None = None,
    max_seq_length: int = 128, threads: int = 2,
) -> dict[str, Any]:
    """Read ``input_uri``, write its frozen features to the Parquet file ``output`` and its rejects
    beside it; return the counts (sentences read, kept, rejected, rejected_by_reason).

    Output columns: ``sentence_id: int32``, ``words: list<string>``,
    ``features: list<list<float32>>`` (words x dim), ``tags: list<string>`` (CoNLL input only).
    The file's schema metadata (key ``bertpipe``, JSON) records checkpoint, input, layers, dim, the
    counts ``{read, kept, rejected, rejected_by_reason}`` (sentences; kept + rejected = read) and
    the rejects file. An input with no sentence kept is an error (:func:`nothing_kept`) and no
    Parquet file is written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from bert_core.model.bert import BertModel
    from bert_core.vocab.tokenization import load_tokenizer

    if not storage.exists(input_uri):
        raise TaskFileMissing(f"{input_uri} does not exist; give a text file (one sentence a line) or a CoNLL file")
    fmt = input_format_of(input_uri, input_format)
    words, tags, rejects, read = read_input(input_uri, fmt)
    counts = count(read, rejects)
    rejects_file = storage.to_uri(rejects_uri(output))
    storage.write_text(rejects_file, "".join(json.dumps(r) + "\n" for r in rejects))
    if not words:
        raise TaskDataError(nothing_kept(input_uri, fmt, counts, rejects_file))
    torch.set_num_threads(threads)
    model = BertModel.from_pretrained(checkpoint)
    feats = word_features(model, load_tokenizer(checkpoint), words, layers, max_seq_length)
    columns = {
        "sentence_id": pa.array(range(len(words)), pa.int32()),
        "words": pa.array(words, pa.list_(pa.string())),
        "features": pa.array([f.tolist() for f in feats], pa.list_(pa.list_(pa.float32()))),
    }
    if tags is not None:
        columns["tags"] = pa.array(tags, pa.list_(pa.string()))
    meta = {"checkpoint": storage.to_uri(checkpoint), "layers": layers, "input": storage.to_uri(input_uri),
            "dim": feature_dim(model.config.hidden_size, layers), "counts": counts, "rejects": rejects_file}
    table = pa.table(columns).replace_schema_metadata({"bertpipe": json.dumps(meta)})
    with storage.open_file(output, "wb") as f:
        pq.write_table(table, f)
    return counts
