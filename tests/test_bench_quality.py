"""The quality benchmark's statistics and splitting helpers (the benchmark itself runs for hours)."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from benchmarks.bench_quality import (
    RECIPES,
    best_setting,
    cpu_per_step,
    mean_sd,
    split_indices,
    steps_in_budget,
    welch_interval,
)


def test_split_is_disjoint_complete_and_fixed_by_seed():
    train, dev, test = split_indices(5000, 700, 1200, seed=7)
    assert (len(train), len(dev), len(test)) == (3100, 700, 1200)
    assert set(train) | set(dev) | set(test) == set(range(5000))
    assert not (set(train) & set(dev) or set(train) & set(test) or set(dev) & set(test))
    assert split_indices(5000, 700, 1200, seed=7) == (train, dev, test)
    assert split_indices(5000, 700, 1200, seed=8)[2] != test


def test_split_refuses_to_leave_no_training_examples():
    with pytest.raises(ValueError, match="no training examples"):
        split_indices(100, 50, 50, seed=1)


def test_welch_interval_matches_scipy_and_satterthwaite_df():
    a = [0.81, 0.83, 0.80, 0.84, 0.82]
    b = [0.70, 0.75, 0.66, 0.73, 0.71, 0.69]
    out = welch_interval(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert out["gain"] == pytest.approx(sum(a) / 5 - sum(b) / 6)
    assert (out["ci_low"], out["ci_high"]) == pytest.approx((ci.low, ci.high))
    va, vb = stats.tvar(a) / 5, stats.tvar(b) / 6
    assert out["df"] == pytest.approx((va + vb) ** 2 / (va**2 / 4 + vb**2 / 5))
    assert out["df"] < 9  # unequal variances: fewer degrees of freedom than the pooled test


def test_welch_interval_edge_cases():
    assert math.isnan(welch_interval([0.9], [0.5, 0.6])["ci_low"])
    flat = welch_interval([0.8, 0.8], [0.7, 0.7])
    assert flat["ci_low"] == flat["ci_high"] == pytest.approx(0.1)


def test_mean_sd_and_best_setting():
    assert mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_sd([0.5]) == (0.5, 0.0)
    dev = {(1e-4, 2.0): 0.80, (3e-4, 2.0): 0.85, (1e-3, 2.0): 0.85}
    assert best_setting(dev) == (3e-4, 2.0)  # a tie goes to the first listed


def test_steps_in_budget_and_cpu_per_step():
    assert steps_in_budget(30, 0.5) == 3600
    assert steps_in_budget(0.001, 10.0) == 1
    # start-up CPU before step 1 is not a step's cost; the late rows give the slope
    rows = [{"kind": "train", "step": s, "cpu_seconds": 20.0 + 0.5 * s} for s in (1, 10, 20, 30, 40)]
    rows.insert(3, {"kind": "eval", "step": 20, "mlm_acc": 0.1})
    assert cpu_per_step(rows) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one step"):
        cpu_per_step([{"step": 1, "cpu_seconds": 3.0}])


def test_recipes_are_product_settings():
    from bert_core.config import load_config

    for name, recipe in RECIPES.items():
        cfg = load_config("demo", None, recipe.instance_sets() + recipe.pretrain_sets(100, 2))
        assert cfg.instances.lengths[0].max_seq_length == recipe.seq, name
        assert cfg.instances.next_sentence_prediction == recipe.next_sentence_prediction, name
        assert cfg.pretrain.phases[0].micro_batch_size * 2 == recipe.global_batch, name
        assert cfg.pretrain.phases[0].warmup_steps == round(100 * recipe.warmup_fraction), name


def test_held_out_sentences_in_the_corpus_are_found(tmp_path):
    """A dev or test example counts when its text, or its longest sentence of 8+ words, is a corpus
    sentence; a short common phrase does not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.bench_quality import held_out_in_corpus
    from bert_core.finetune.glue import Example

    sentences = ["This camera is the best thing I ever bought.", "Perfect.",
                 "The battery died after two days and support never answered."]
    pq.write_table(pa.table({"doc_id": ["d"], "sentences": [sentences]}), tmp_path / "docs-00000-of-00001.parquet")

    def example(text):
        return Example(guid=text[:8], text_a=text, text_b=None, label="positive")

    split = {"dev": [example("this camera is the BEST thing i ever bought!"), example("Perfect.")],
             "test": [example("Sadly. The battery died after two days and support never answered."),
                      example("The battery died after two days.")]}
    assert held_out_in_corpus(split, tmp_path) == 2


def test_gain_interval_is_over_pre_training_runs_when_each_arm_has_several():
    from benchmarks.bench_quality import gain_interval, runs_of

    def arm(run_scores):
        runs = [{"seed": 42 + k, "test_scores": s, "mean": sum(s) / len(s)} for k, s in enumerate(run_scores)]
        return {"runs": runs, "test_scores": [x for s in run_scores for x in s]}

    # tight seeds within each run, runs far apart: the interval over runs is the wide one
    a = arm([[80.0, 80.2], [76.0, 76.2], [79.0, 79.2]])
    b = arm([[77.0, 77.2], [76.5, 76.7], [77.5, 77.7]])
    over_runs = gain_interval(a, b)
    assert over_runs["over"] == "3 vs 3 runs"
    ci = stats.ttest_ind([80.1, 76.1, 79.1], [77.1, 76.6, 77.6], equal_var=False).confidence_interval(0.95)
    assert (over_runs["ci_low"], over_runs["ci_high"]) == pytest.approx((ci.low, ci.high))
    pooled = welch_interval(a["test_scores"], b["test_scores"])
    assert over_runs["ci_high"] - over_runs["ci_low"] > pooled["ci_high"] - pooled["ci_low"]

    # an arm written before runs were recorded is one run with the default seed
    legacy = {"checkpoint": "x", "test_scores": [78.0, 79.0], "mean": 78.5}
    assert runs_of(legacy)[0]["seed"] == 42 and runs_of(legacy)[0]["mean"] == 78.5
    assert gain_interval(legacy, {"test_scores": [77.0, 77.5], "mean": 77.25})["over"] == "fine-tuning seeds of one run"
