"""SQuAD EM / F1 computed exactly as the official evaluate scripts (v1.1 and v2.0).

Both official scripts normalize an answer the same way (lowercase, drop punctuation, drop the
articles a/an/the, collapse whitespace) and take the best score over the gold answers. They
differ on empty answers: v1.1's F1 is 0 when nothing overlaps; v2.0 treats an empty gold or
prediction as "no answer" (F1 = 1 only if both are empty), ignores gold answers that normalize
to nothing, and can apply a no-answer probability threshold and search for the best one.

    python -m bert_core.finetune.squad_eval dev-v2.0.json predictions.json [--na-prob null_odds.json]
"""

from __future__ import annotations

import argparse
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# --------------------------------------------------------------------------- v1.1


def f1_score_v1(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    num_same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score_v1(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def _max_over(metric: Callable[[str, str], float], prediction: str, ground_truths: list[str]) -> float:
    return max(metric(prediction, gt) for gt in ground_truths)


def _questions(dataset: list[dict]) -> Iterable[dict]:
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_v1(dataset: list[dict], predictions: dict[str, str]) -> dict[str, float]:
    """evaluate-v1.1.py: ``dataset`` is the JSON's ``data`` list; a missing prediction scores 0."""
    f1 = exact_match = total = 0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            continue
        ground_truths = [a["text"] for a in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact_match += _max_over(exact_match_score_v1, prediction, ground_truths)
        f1 += _max_over(f1_score_v1, prediction, ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# --------------------------------------------------------------------------- v2.0


def get_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold_toks, pred_toks = get_tokens(a_gold), get_tokens(a_pred)
    num_same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        # Either is no-answer: F1 is 1 if they agree, 0 otherwise.
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def make_qid_to_has_ans(dataset: list[dict]) -> dict[str, bool]:
    return {qa["id"]: bool(qa["answers"]) for qa in _questions(dataset)}


def get_raw_scores(dataset: list[dict], preds: dict[str, str]) -> tuple[dict, dict]:
    exact_scores, f1_scores = {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
        if not gold_answers:
            gold_answers = [""]  # unanswerable: the only correct answer is the empty string
        if qid not in preds:
            continue
        a_pred = preds[qid]
        exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
        f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(
    scores: dict[str, float], na_probs: dict[str, float], qid_to_has_ans: dict[str, bool], thresh: float
) -> dict[str, float]:
    return {
        qid: float(not qid_to_has_ans[qid]) if na_probs[qid] > thresh else s
        for qid, s in scores.items()
    }


def make_eval_dict(exact: dict, f1: dict, qid_list: list[str] | None = None) -> dict[str, float]:
    qids = qid_list or list(exact)
    total = len(qids)
    return {
        "exact": 100.0 * sum(exact[k] for k in qids) / total,
        "f1": 100.0 * sum(f1[k] for k in qids) / total,
        "total": total,
    }


def find_best_thresh(
    preds: dict[str, str], scores: dict[str, float], na_probs: dict[str, float],
    qid_to_has_ans: dict[str, bool],
) -> tuple[float, float]:
    """Best score over thresholds on the no-answer score, and that threshold (official search)."""
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = best_score = num_no_ans
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def evaluate_v2(
    dataset: list[dict], preds: dict[str, str], na_probs: dict[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """evaluate-v2.0.py's output dict (without the precision-recall plots)."""
    has_na_file = na_probs is not None
    na_probs = na_probs if has_na_file else {k: 0.0 for k in preds}
    qid_to_has_ans = make_qid_to_has_ans(dataset)
    has_ans = [k for k, v in qid_to_has_ans.items() if v]
    no_ans = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = get_raw_scores(dataset, preds)
    exact_t = apply_no_ans_threshold(exact_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    f1_t = apply_no_ans_threshold(f1_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    out = make_eval_dict(exact_t, f1_t)
    if has_ans:
        out.update({f"HasAns_{k}": v for k, v in make_eval_dict(exact_t, f1_t, has_ans).items()})
    if no_ans:
        out.update({f"NoAns_{k}": v for k, v in make_eval_dict(exact_t, f1_t, no_ans).items()})
    if has_na_file:
        out["best_exact"], out["best_exact_thresh"] = find_best_thresh(preds, exact_raw, na_probs, qid_to_has_ans)
        out["best_f1"], out["best_f1_thresh"] = find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)
    return out


def is_v2(dataset: list[dict]) -> bool:
    """A v2.0 file marks questions with ``is_impossible``."""
    return any("is_impossible" in qa for qa in _questions(dataset))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_file")
    parser.add_argument("pred_file")
    parser.add_argument("--na-prob", default=None, help="null_odds.json (v2.0)")
    parser.add_argument("--na-prob-thresh", type=float, default=1.0)
    args = parser.parse_args(argv)
    with open(args.data_file) as f:
        dataset = json.load(f)["data"]
    with open(args.pred_file) as f:
        preds = json.load(f)
    if is_v2(dataset) or args.na_prob:
        na = json.load(open(args.na_prob)) if args.na_prob else None
        print(json.dumps(evaluate_v2(dataset, preds, na, args.na_prob_thresh), indent=2))
    else:
        print(json.dumps(evaluate_v1(dataset, preds)))


if __name__ == "__main__":
    main()
