"""GLUE metrics: accuracy, F1, Matthews correlation, Pearson and Spearman correlation.

Plain numpy, written to equal scikit-learn's ``accuracy_score``, ``f1_score`` (binary),
``matthews_corrcoef`` and scipy's ``pearsonr`` / ``spearmanr`` (tests/test_finetune_metrics.py
checks that), so the finetune package needs neither at run time.

    from bert_core.finetune.metrics import matthews_corrcoef
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def accuracy(labels: Sequence, preds: Sequence) -> float:
    labels, preds = np.asarray(labels), np.asarray(preds)
    return float((labels == preds).mean()) if len(labels) else 0.0


def f1_binary(labels: Sequence[int], preds: Sequence[int], positive: int = 1) -> float:
    """F1 of the positive class; 0.0 when there is no true positive (sklearn's zero_division=0)."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    tp = int(((preds == positive) & (labels == positive)).sum())
    fp = int(((preds == positive) & (labels != positive)).sum())
    fn = int(((preds != positive) & (labels == positive)).sum())
    if tp == 0:
        return 0.0
    return 2 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(labels: Sequence, preds: Sequence) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K, as sklearn computes it); 0 if undefined."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    classes = np.unique(np.concatenate([labels, preds]))
    index = {c: i for i, c in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    for t, p in zip(labels, preds, strict=True):
        confusion[index[t], index[p]] += 1
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    n_correct, n = np.trace(confusion), confusion.sum()
    cov_ytyp = n_correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n**2 - np.dot(p_sum, p_sum)
    cov_ytyt = n**2 - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xm, ym = x - x.mean(), y - y.mean()
    denom = np.sqrt((xm * xm).sum() * (ym * ym).sum())
    return float((xm * ym).sum() / denom) if denom else 0.0


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (scipy.stats.rankdata(method='average'))."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of the average ranks (scipy.stats.spearmanr)."""
    return pearson(_average_ranks(np.asarray(x)), _average_ranks(np.asarray(y)))
