"""GLUE metrics: accuracy, F1, Matthews correlation, Pearson and Spearman correlation.

    from bert_core.finetune.metrics import matthews_corrcoef

F1 and Matthews correlation are scikit-learn's (``f1_score`` of the positive class,
``matthews_corrcoef``), Pearson and Spearman are scipy's (``pearsonr``, ``spearmanr``), as the
GLUE reference scripts compute them. Every metric is a plain ``float``, and a metric that is
undefined on its input (no true positive, a constant column, fewer than two values) is 0.0,
never NaN, so a degenerate dev set cannot win a hyper-parameter search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.stats
import sklearn.metrics


def accuracy(labels: Sequence, preds: Sequence) -> float:
    labels, preds = np.asarray(labels), np.asarray(preds)
    return float((labels == preds).mean()) if len(labels) else 0.0


def f1_binary(labels: Sequence[int], preds: Sequence[int], positive: int = 1) -> float:
    """F1 of the positive class; 0.0 when there is no true positive."""
    return float(sklearn.metrics.f1_score(labels, preds, pos_label=positive, zero_division=0))


def matthews_corrcoef(labels: Sequence, preds: Sequence) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K); 0.0 if undefined."""
    if len(np.unique(np.concatenate([np.asarray(labels), np.asarray(preds)]))) < 2:
        return 0.0  # one class only (sklearn warns, then returns 0.0 too)
    return float(sklearn.metrics.matthews_corrcoef(labels, preds))


def _defined(x: np.ndarray, y: np.ndarray) -> bool:
    """A correlation needs two values and no constant column."""
    return len(x) >= 2 and np.ptp(x) > 0 and np.ptp(y) > 0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(scipy.stats.pearsonr(x, y).statistic) if _defined(x, y) else 0.0


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of the ranks, ties given their mean rank."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(scipy.stats.spearmanr(x, y).statistic) if _defined(x, y) else 0.0
