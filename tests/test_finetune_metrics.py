"""Fine-tuning metrics equal the official tools: SQuAD evaluate scripts (v1.1, v2.0),
conlleval.pl (run with perl on the seqeval sample), scikit-learn and scipy for GLUE."""

from __future__ import annotations

import json
import re
import shutil
import string
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from bert_core.finetune import conlleval, metrics, squad_eval

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


# --------------------------------------------------------------------------- GLUE


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_glue_metrics_equal_sklearn_and_scipy(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 200)
    p = np.where(rng.random(200) < 0.7, y, 1 - y)
    assert metrics.accuracy(y, p) == pytest.approx(sklearn.metrics.accuracy_score(y, p), abs=1e-12)
    assert metrics.f1_binary(y, p) == pytest.approx(sklearn.metrics.f1_score(y, p), abs=1e-12)
    assert metrics.matthews_corrcoef(y, p) == pytest.approx(sklearn.metrics.matthews_corrcoef(y, p), abs=1e-12)
    y3, p3 = rng.integers(0, 3, 300), rng.integers(0, 3, 300)
    p3[:150] = y3[:150]
    assert metrics.matthews_corrcoef(y3, p3) == pytest.approx(sklearn.metrics.matthews_corrcoef(y3, p3), abs=1e-12)
    # STS-B-like scores with ties (rounded), so Spearman's tie handling matters
    a = np.round(rng.uniform(0, 5, 150), 1)
    b = np.round(a + rng.normal(0, 1.0, 150), 1)
    assert metrics.pearson(a, b) == pytest.approx(scipy.stats.pearsonr(a, b)[0], abs=1e-12)
    assert metrics.spearman(a, b) == pytest.approx(scipy.stats.spearmanr(a, b)[0], abs=1e-12)


def test_degenerate_metrics_are_zero_not_nan():
    y = [1, 1, 1, 1]
    assert metrics.matthews_corrcoef(y, y) == sklearn.metrics.matthews_corrcoef(y, y) == 0.0
    assert metrics.f1_binary([0, 0], [0, 0]) == sklearn.metrics.f1_score([0, 0], [0, 0], zero_division=0) == 0.0
    assert metrics.f1_binary([1, 0], [0, 1]) == 0.0
    # constant scores (scipy returns NaN with a warning) and too few values
    for x, y in (([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]), ([1.0, 2.0, 3.0], [0.5, 0.5, 0.5]), ([1.0], [2.0]), ([], [])):
        assert metrics.pearson(x, y) == 0.0 and metrics.spearman(x, y) == 0.0
    assert metrics.accuracy([], []) == 0.0


def test_metrics_are_plain_floats_with_the_positive_class_chosen():
    labels, preds = [1, 1, 0, 0, 0], [1, 0, 0, 0, 1]
    values = [metrics.accuracy(labels, preds), metrics.f1_binary(labels, preds),
              metrics.matthews_corrcoef(labels, preds), metrics.pearson(labels, preds),
              metrics.spearman(labels, preds)]
    assert all(type(v) is float for v in values)
    assert metrics.f1_binary(labels, preds) == pytest.approx(0.5)  # tp=1, fp=1, fn=1
    assert metrics.f1_binary(labels, preds, positive=0) == pytest.approx(2 / 3)  # tp=2, fp=1, fn=1


# --------------------------------------------------------------------------- conlleval


def test_conlleval_equals_conlleval_pl_on_seqeval_sample(samples_dir):
    gold_file = samples_dir / "tasks" / "conll" / "ground_truth.txt"
    lines = gold_file.read_text().splitlines(keepends=True)
    counts = conlleval.count_chunks(conlleval.rows_from_lines(lines, delimiter=" "))
    ours = conlleval.report(counts)
    assert shutil.which("perl"), "perl is needed to run the official conlleval.pl"
    official = subprocess.run(
        ["perl", str(samples_dir / "tasks" / "conll" / "conlleval.pl")],
        input=gold_file.read_text(), capture_output=True, text=True, check=True,
    ).stdout
    assert ours == official
    overall = float(re.search(r"FB1:\s+([\d.]+)", official).group(1))
    assert overall == 74.35
    assert round(conlleval.summarize(counts)["f1"], 2) == overall


def test_conlleval_sequences_api_iob1_and_iob2():
    # The same two entities written in IOB1 and IOB2 are the same chunks.
    iob1 = [["I-PER", "I-PER", "O", "I-LOC"], ["I-ORG", "B-ORG", "O"]]
    iob2 = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "B-ORG", "O"]]
    assert conlleval.evaluate(iob1, iob2)["f1"] == 100.0
    guess = [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "I-ORG", "O"]]
    r = conlleval.evaluate(iob2, guess)
    # gold: PER, LOC, ORG, ORG (4); guess: PER(1 token), LOC, ORG(2 tokens) (3); correct: LOC only
    assert (r["phrases"], r["found"], r["correct"]) == (4, 3, 1)
    assert r["precision"] == pytest.approx(100 / 3) and r["recall"] == 25.0


def test_conlleval_rejects_ragged_lines():
    with pytest.raises(ValueError, match="line 2"):
        conlleval.rows_from_lines(["a B-NP B-NP", "b B-NP"], delimiter=" ")


def test_conlleval_ignores_trailing_spaces_like_conlleval_pl(samples_dir):
    # Perl's split drops trailing empty fields: a trailing space is no empty guessed tag.
    lines = (samples_dir / "tasks" / "conll" / "ground_truth.txt").read_text().splitlines(keepends=True)
    spaced = "".join(line.replace("\n", " " * (i % 3) + "\n") if line.strip() else line
                     for i, line in enumerate(lines))
    assert spaced.count(" \n") > 100
    official = subprocess.run(
        ["perl", str(samples_dir / "tasks" / "conll" / "conlleval.pl")],
        input=spaced, capture_output=True, text=True, check=True,
    ).stdout
    rows = conlleval.rows_from_lines(spaced.splitlines(keepends=True), delimiter=" ")
    assert conlleval.report(conlleval.count_chunks(rows)) == official
    assert conlleval.split_fields("EU B-ORG B-ORG  \n") == ["EU", "B-ORG", "B-ORG"]
    assert conlleval.split_fields(" EU B-ORG B-ORG") == ["", "EU", "B-ORG", "B-ORG"]  # as Perl


def test_conlleval_refuses_crlf_lines_naming_the_source():
    with pytest.raises(ValueError, match=r"pred\.txt: line 1 ends in CR LF .*dos2unix pred\.txt"):
        conlleval.rows_from_lines(["EU B-ORG B-ORG\r\n", "\r\n"], delimiter=" ", source="pred.txt")


# --------------------------------------------------------------------------- SQuAD
# Reference: the official evaluate-v1.1.py / evaluate-v2.0.py rules, ported here independently
# (normalize; max over gold answers; v2.0 empty-answer and threshold rules).


def _ref_norm(s):
    s = "".join(c for c in s.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _ref_f1(pred, gold, v2):
    p, g = _ref_norm(pred).split(), _ref_norm(gold).split()
    if v2 and (not p or not g):
        return float(p == g)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def _ref_eval(data, preds, v2, na=None, thresh=1.0):
    em = f1 = 0.0
    total = 0
    for art in data:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                total += 1
                golds = [a["text"] for a in qa["answers"]]
                if v2:
                    golds = [g for g in golds if _ref_norm(g)] or [""]
                if qa["id"] not in preds:
                    continue
                pred = preds[qa["id"]]
                if v2 and na is not None and na[qa["id"]] > thresh:
                    pred = ""
                em += max(float(_ref_norm(pred) == _ref_norm(g)) for g in golds)
                f1 += max(_ref_f1(pred, g, v2) for g in golds)
    return 100 * em / total, 100 * f1 / total


def _perturbed_predictions(data, rng):
    """Exact, article/punctuation/case variants, partial, wrong, empty and missing answers."""
    preds = {}
    for art in data:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                kind = rng.integers(0, 7)
                gold = qa["answers"][0]["text"] if qa["answers"] else ""
                if kind == 6:
                    continue  # missing prediction
                preds[qa["id"]] = [
                    gold, f"The {gold.upper()}!", gold.split()[0] if gold else "x",
                    f"{gold} and a lot more words", "completely wrong", "", f"an {gold}, ",
                ][kind]
    return preds


def test_squad_v1_equals_official(samples_dir):
    real = json.loads((samples_dir / "tasks" / "squad" / "squad.json").read_text())["data"]
    fixture = json.loads((FIXTURES / "squad" / "dev-v1.1.json").read_text())["data"]
    rng = np.random.default_rng(0)
    for data in (real, fixture):
        preds = _perturbed_predictions(data, rng)
        ours = squad_eval.evaluate_v1(data, preds)
        em, f1 = _ref_eval(data, preds, v2=False)
        assert ours["exact_match"] == pytest.approx(em, abs=1e-9)
        assert ours["f1"] == pytest.approx(f1, abs=1e-9)
        assert 0 < ours["exact_match"] < 100 and 0 < ours["f1"] < 100


def test_squad_v2_equals_official_with_threshold():
    data = json.loads((FIXTURES / "squad_v2" / "dev-v2.0.json").read_text())["data"]
    rng = np.random.default_rng(1)
    preds = _perturbed_predictions(data, rng)
    qids = [qa["id"] for a in data for p in a["paragraphs"] for qa in p["qas"]]
    preds = {q: preds.get(q, "") for q in qids}  # v2.0 needs every id to tune a threshold
    na = {q: float(rng.uniform(-3, 3)) for q in qids}
    for thresh in (1.0, 0.0, -1.5):
        ours = squad_eval.evaluate_v2(data, preds, na, na_prob_thresh=thresh)
        em, f1 = _ref_eval(data, preds, v2=True, na=na, thresh=thresh)
        assert ours["exact"] == pytest.approx(em, abs=1e-9)
        assert ours["f1"] == pytest.approx(f1, abs=1e-9)
    best = squad_eval.evaluate_v2(data, preds, na)
    assert (best["best_f1"], best["best_f1_thresh"]) == pytest.approx(_ref_best_thresh(data, preds, na))


def _ref_best_thresh(data, preds, na):
    """The official threshold search, stated directly: answer every question whose no-answer
    score is <= t; an answered unanswerable question scores 1 only if its prediction is the
    empty string (the script tests the raw string), an unanswered one scores 1; start from
    "answer nothing" at t = 0.0 and keep the first strict improvement."""
    qas = {qa["id"]: qa for a in data for p in a["paragraphs"] for qa in p["qas"]}

    def score(t):
        total = 0.0
        for q, qa in qas.items():
            golds = [g["text"] for g in qa["answers"] if _ref_norm(g["text"])] or [""]
            if na[q] <= t:
                total += max(_ref_f1(preds[q], g, True) for g in golds) if qa["answers"] else float(preds[q] == "")
            else:
                total += 0.0 if qa["answers"] else 1.0
        return total

    best_score, best_t = float(sum(1 for qa in qas.values() if not qa["answers"])), 0.0
    for t in sorted(na.values()):
        if score(t) > best_score + 1e-12:
            best_score, best_t = score(t), t
    return 100 * best_score / len(qas), best_t


def test_squad_normalization_cases():
    assert squad_eval.normalize_answer("The  Eiffel-Tower, an icon!") == "eiffeltower icon"
    assert squad_eval.compute_f1("", "") == 1 and squad_eval.compute_f1("cat", "") == 0 and squad_eval.compute_f1("a", "") == 1
    assert squad_eval.f1_score_v1("the cat sat", "cat sat down") == pytest.approx(0.8)
