"""SQuAD v1.1 / v2.0: JSON reader, sliding-window features, span decoding, official EM/F1.

    bertpipe finetune --task squad_v2 --data squad_data --checkpoint runs/demo/hf --output finetune/demo

Follows google-research/bert's run_squad.py. Writes ``predictions.json``,
``nbest_predictions.json`` and (v2.0) ``null_odds.json``, the files the official evaluate
scripts read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from bert_core import storage
from bert_core.finetune import squad_eval
from bert_core.finetune.errors import TaskDataError, TaskFileMissing


@dataclass(frozen=True)
class SquadExample:
    qid: str
    question: str
    context: str
    answer_start: int  # char offset of the first answer, -1 if unanswerable
    answer_text: str


def _find_files(folder: str) -> tuple[str, str, bool]:
    files = storage.glob(storage.join(folder, "*.json"))
    train = [f for f in files if f.rsplit("/", 1)[-1].startswith("train")]
    dev = [f for f in files if f.rsplit("/", 1)[-1].startswith("dev")]
    if train and dev:
        return train[0], dev[0], False
    if len(files) == 1:
        return files[0], files[0], True
    raise TaskFileMissing(
        f"{folder}: expected train-v1.1.json + dev-v1.1.json (or -v2.0), or a single *.json; "
        f"found {[f.rsplit('/', 1)[-1] for f in files]}"
    )


def read_squad(uri: str) -> tuple[list[SquadExample], list[dict[str, Any]], list[dict]]:
    """Examples, rejects (answer not found at answer_start) and the raw ``data`` list (for eval).

    Files: ``<folder>/train-v1.1.json`` + ``dev-v1.1.json`` (or v2.0). A folder with a single
    ``*.json`` (the 5-question sample) uses it for both, recorded as ``train_is_dev`` in the counts.
    """
    try:
        data = json.loads(storage.read_text(uri))["data"]
    except (json.JSONDecodeError, KeyError) as err:
        raise TaskDataError(f"{uri}: not a SQuAD JSON file with a 'data' list ({err})") from None
    examples, rejects = [], []
    for article in data:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                impossible = bool(qa.get("is_impossible", False)) or not qa["answers"]
                if impossible:
                    examples.append(SquadExample(qa["id"], qa["question"], context, -1, ""))
                    continue
                answer = qa["answers"][0]
                start, text = int(answer["answer_start"]), answer["text"]
                if context[start : start + len(text)] != text:
                    rejects.append({"source": uri, "id": qa["id"], "reason": "answer_not_at_offset",
                                    "detail": f"{text!r} is not at char {start} of the context"})
                    continue
                examples.append(SquadExample(qa["id"], qa["question"], context, start, text))
    return examples, rejects, data


def _doc_spans(n_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    while True:
        length = min(n_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length >= n_tokens:
            return spans
        start += min(length, stride)


def _is_max_context(spans: list[tuple[int, int]], span_index: int, position: int) -> bool:
    """run_squad.py's rule: a token belongs to the window where min(left, right) context + 0.01*len is largest."""
    best_score, best = None, None
    for i, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best = score, i
    return best == span_index


def make_features(
    examples: list[SquadExample], tokenizer: Any, cfg: Any, training: bool
) -> list[dict[str, Any]]:
    """The question (at most ``max_query_length`` tokens) and a window of the context form
    ``[CLS] question [SEP] context [SEP]``; windows start every ``doc_stride`` tokens.
    """
    features = []
    for ex_index, ex in enumerate(examples):
        q_ids = tokenizer.encode(ex.question)[: cfg.max_query_length]
        ctx_ids, offsets = tokenizer.encode_with_offsets(ex.context)
        max_tokens = cfg.squad_max_seq_length - len(q_ids) - 3
        spans = _doc_spans(len(ctx_ids), max_tokens, cfg.doc_stride)
        tok_start = tok_end = -1
        if ex.answer_start >= 0:
            a_start, a_end = ex.answer_start, ex.answer_start + len(ex.answer_text)
            inside = [i for i, (s, e) in enumerate(offsets) if e > a_start and s < a_end]
            if inside:
                tok_start, tok_end = inside[0], inside[-1]
        for span_index, (start, length) in enumerate(spans):
            prefix = [tokenizer.cls_id, *q_ids, tokenizer.sep_id]
            input_ids = prefix + ctx_ids[start : start + length] + [tokenizer.sep_id]
            types = [0] * len(prefix) + [1] * (length + 1)
            ctx_offset = len(prefix)  # position of the window's first context token
            label = [0, 0]  # [CLS]: no answer in this window
            if tok_start >= 0 and start <= tok_start and tok_end < start + length:
                label = [tok_start - start + ctx_offset, tok_end - start + ctx_offset]
            if training and ex.answer_start >= 0 and label == [0, 0] and tok_start < 0:
                continue  # answer text has no token (whitespace only): nothing to learn
            features.append({
                "input_ids": input_ids, "token_type_ids": types, "label": label,
                "example_index": ex_index, "ctx_offset": ctx_offset,
                "token_to_char": [offsets[start + i] for i in range(length)],
                "max_context": [_is_max_context(spans, span_index, start + i) for i in range(length)],
            })
    return features


def _top(logits: np.ndarray, n: int) -> list[int]:
    return [int(i) for i in np.argsort(-logits, kind="stable")[:n]]


def decode(
    examples: list[SquadExample], features: list[dict[str, Any]], outputs: list[np.ndarray],
    n_best_size: int, max_answer_length: int, version_2: bool, offsets: bool = False,
) -> tuple[dict[str, str], dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Best non-null answer per question, null score diffs (v2.0) and the n-best lists.

    The best span over the ``n_best_size`` top starts x ends (end >= start, at most
    ``max_answer_length`` tokens, start in the window where it has the most context) is mapped
    back to the original text through the tokenizer's character offsets. v2.0: the no-answer
    score is the ``[CLS]`` span; ``null_score_diff_threshold`` is tuned on dev (the official
    script's best-F1 threshold) and the predictions apply it. With ``offsets`` each n-best
    answer also gives its ``start`` and ``end`` character offsets in the context.
    """
    by_example: dict[int, list[int]] = {}
    for i, f in enumerate(features):
        by_example.setdefault(f["example_index"], []).append(i)
    best_text, null_odds, nbest_all = {}, {}, {}
    for ex_index, ex in enumerate(examples):
        candidates = []  # (score, start_char, end_char)
        score_null = math.inf
        for i in by_example.get(ex_index, []):
            f, logits = features[i], outputs[i]
            start_logits, end_logits = logits[:, 0], logits[:, 1]
            score_null = min(score_null, float(start_logits[0] + end_logits[0]))
            n_ctx = len(f["token_to_char"])
            for s in _top(start_logits, n_best_size):
                for e in _top(end_logits, n_best_size):
                    cs, ce = s - f["ctx_offset"], e - f["ctx_offset"]
                    if not (0 <= cs < n_ctx and 0 <= ce < n_ctx) or ce < cs:
                        continue
                    if ce - cs + 1 > max_answer_length or not f["max_context"][cs]:
                        continue
                    candidates.append((float(start_logits[s] + end_logits[e]),
                                       f["token_to_char"][cs][0], f["token_to_char"][ce][1]))
        candidates.sort(key=lambda c: -c[0])
        nbest, seen = [], set()
        for score, a, b in candidates:
            text = ex.context[a:b]
            if text in seen:
                continue
            seen.add(text)
            nbest.append({"text": text, "score": score, **({"start": a, "end": b} if offsets else {})})
            if len(nbest) >= n_best_size:
                break
        if version_2 and math.isfinite(score_null):
            nbest.append({"text": "", "score": score_null})
        if not nbest:
            nbest = [{"text": "empty", "score": 0.0}]  # run_squad.py's placeholder
        scores = np.array([c["score"] for c in nbest])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        for c, p in zip(nbest, probs, strict=True):
            c["probability"] = float(p)
        non_null = [c for c in nbest if c["text"]]
        best = non_null[0] if non_null else {"text": "", "score": score_null}
        best_text[ex.qid] = best["text"]
        if version_2:
            null_odds[ex.qid] = float(score_null - best["score"]) if non_null else 0.0
        nbest_all[ex.qid] = nbest
    return best_text, null_odds, nbest_all


def prepare(task: str, folder: str, tokenizer: Any, cfg: Any) -> Any:
    from bert_core.finetune.data import TaskData

    train_uri, dev_uri, train_is_dev = _find_files(folder)
    train_ex, train_rejects, _ = read_squad(train_uri)
    dev_ex, dev_rejects, dev_data = read_squad(dev_uri)
    if cfg.max_train_examples:
        train_ex = train_ex[: cfg.max_train_examples]
    version_2 = task == "squad_v2" or squad_eval.is_v2(dev_data)
    train_feats = make_features(train_ex, tokenizer, cfg, training=True)
    dev_feats = make_features(dev_ex, tokenizer, cfg, training=False)

    def finish(split: str, outputs: list[Any]) -> tuple[dict[str, float], dict[str, Any]]:
        answers, null_odds, nbest = decode(dev_ex, dev_feats, outputs, cfg.n_best_size,
                                           cfg.max_answer_length, version_2)
        files: dict[str, Any] = {"nbest_predictions.json": nbest}
        if not version_2:
            files["predictions.json"] = answers
            return squad_eval.evaluate_v1(dev_data, answers), files
        # Tune the threshold on dev as the official script does, then apply it.
        tuned = squad_eval.evaluate_v2(dev_data, answers, null_odds)

        def apply(t: float) -> dict[str, str]:
            return {q: ("" if null_odds[q] > t else a) for q, a in answers.items()}

        # The official search starts from "answer nothing" at threshold 0.0, which assumes
        # probabilities in [0, 1]; with score differences (which can be negative) "nothing"
        # needs a threshold below every score, so both candidates are tried.
        candidates = [tuned["best_f1_thresh"], min(null_odds.values(), default=0.0) - 1.0]
        scored = [(squad_eval.evaluate_v2(dev_data, apply(t)), t) for t in candidates]
        result, thresh = max(scored, key=lambda r: r[0]["f1"])
        final = apply(thresh)
        zero = squad_eval.evaluate_v2(dev_data, apply(0.0))
        result.update(null_score_diff_threshold=thresh, best_f1=tuned["best_f1"],
                      best_exact=tuned["best_exact"], exact_at_threshold_0=zero["exact"],
                      f1_at_threshold_0=zero["f1"])
        files.update({"predictions.json": final, "null_odds.json": null_odds})
        return result, files

    counts = {"train_examples": len(train_ex), "train_rejected": len(train_rejects),
              "train_features": len(train_feats), "dev_examples": len(dev_ex),
              "dev_rejected": len(dev_rejects), "dev_features": len(dev_feats),
              "train_is_dev": int(train_is_dev)}
    return TaskData(kind="span", num_labels=2, train=train_feats, evals={"dev": dev_feats},
                    finish=finish, counts=counts, rejects=train_rejects + dev_rejects)
