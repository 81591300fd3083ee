"""The quality protocol's recipe choice: its rule and freeze, the every-setting endpoint's cells
and goal, the candidates' runs kept and skipped when finished, and the evaluation of the runs on
dev (tiny, on CPU)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from scipy import stats

from benchmarks.quality import choice as qc

TASKS = ["sentiment", "tweets3"]
CELLS = qc.cells(TASKS, qc.CHOICE_SIZES)


def gains_with(minimum: float, mean: float) -> dict[str, float]:
    """32 cells whose smallest gain is ``minimum`` and whose mean is ``mean``."""
    rest = (len(CELLS) * mean - minimum) / (len(CELLS) - 1)
    assert rest >= minimum
    return {c: minimum if i == 5 else rest for i, c in enumerate(CELLS)}


def choice_of(rows: dict[str, tuple[float, float]]) -> dict:
    return qc.choose({n: gains_with(*mm) for n, mm in rows.items()}, dict.fromkeys(rows, "k2"), CELLS)


def test_the_rule_takes_the_largest_minimum_then_the_largest_mean_then_the_table_order():
    # a clear largest minimum wins whatever the means
    assert choice_of({"a": (1.0, 9.0), "b": (2.25, 3.0), "c": (0.5, 12.0)})["name"] == "b"
    # within 1.0 of the largest minimum (2.5): a (2.0), b and d (1.5, on the edge); not c (1.25) for all its mean
    choice = choice_of({"a": (2.0, 3.0), "b": (2.5, 3.375), "c": (1.25, 10.0), "d": (1.5, 3.75)})
    assert choice["within_minimum_margin"] == ["a", "b", "d"]
    assert choice["largest_mean_among_them"] == pytest.approx(3.75)
    # d has the largest mean, b is within 0.5 of it and higher in the table; a is 0.75 below
    assert choice["tied_on_mean"] == ["b", "d"] and choice["name"] == "b"
    assert choice_of({"a": (2.0, 3.0), "b": (2.5, 3.0), "d": (1.5, 3.75)})["name"] == "d"
    # the record: every candidate's 32 gains, minimum and mean, in table order
    rows = {r["name"]: r for r in choice["candidates"]}
    assert list(rows) == ["a", "b", "c", "d"] and len(rows["c"]["gains"]) == 32
    assert (rows["c"]["minimum"], rows["c"]["mean"]) == pytest.approx((1.25, 10.0))
    assert choice["corpus"] == "k2"


def test_the_rule_refuses_a_candidate_without_every_cell():
    partial = gains_with(1.0, 2.0)
    del partial[CELLS[-1]]
    with pytest.raises(qc.ChoiceRefused, match="candidate b has no gain in 1 of the 32 cells, first tweets3/1000/8"):
        qc.choose({"a": gains_with(1.0, 2.0), "b": partial}, {"a": "k2", "b": "k2"}, CELLS)
    assert qc.gains({"x": [60.0, 62.0]}, {"x": [50.0, 51.0, 52.0]}) == {"x": pytest.approx(10.0)}
    with pytest.raises(qc.ChoiceRefused, match="no random-init scores for 1 cell"):
        qc.gains({"x": [1.0], "y": [2.0]}, {"x": [0.0]})


def test_the_protocol_grid_and_its_choice_on_dev_are_the_products_and_give_the_committed_settings():
    """A version's grid is the product's (learning rates x poolings x layer-wise decays), expanded
    to the very settings its committed results list, and the product's choice on dev, given each
    arm's committed dev scores, selects the setting each arm was scored with."""
    from benchmarks.quality.finetune import product_setting
    from benchmarks.quality.protocol import chosen_on_dev
    from benchmarks.quality.spec import protocol

    committed = json.loads((Path(__file__).resolve().parent.parent / "docs" / "quality-v3.json").read_text())
    grid = protocol("v3")["grid"]
    assert protocol("v2")["grid"] == grid
    # the quick mode's two settings, as its jobs' cache keys hold them
    assert protocol("v2", quick=True)["grid"] == protocol("v3", quick=True)["grid"] == [
        {"learning_rate": 3e-4, "pooling": "cls", "layerwise_lr_decay": decay, "epochs": 1.0, "min_steps": 2}
        for decay in (1.0, 0.8)]
    assert json.dumps(grid) == json.dumps(committed["protocol"]["grid"])  # values, types and order
    assert len({product_setting(s).name for s in grid}) == len(grid)
    chosen = 0
    for arm in committed["arms"]:
        for task, entry in arm["settings"].items():
            if "grid" in entry:  # arms with a grid on dev (not TF-IDF's C, nor C's fixed setting)
                assert [{k: v for k, v in row.items() if k != "dev"} for row in entry["grid"]] == grid
                scored = [row["dev"] for row in entry["grid"]]
                assert chosen_on_dev(task, grid, scored) == entry["selected"], (arm["arm"], task)
                chosen += 1
    assert chosen >= 4


def test_frozen_choice_refuses_a_missing_file_another_recipe_and_a_file_without_a_choice(tmp_path):
    path = tmp_path / "quality-v2-choice.json"
    with pytest.raises(qc.ChoiceRefused) as missing:
        qc.frozen_choice(path, "k2")
    assert "is missing" in str(missing.value) and "\n" not in str(missing.value)
    qc.write_choice(choice_of({"k2": (1.0, 2.0), "k1": (0.5, 1.0)}), path)
    assert qc.frozen_choice(path, "k2")["name"] == "k2"
    with pytest.raises(qc.ChoiceRefused, match="froze the recipe k2, not k1: run the test phase with --recipe k2"):
        qc.frozen_choice(path, "k1")
    path.write_text("[1, 2]")
    with pytest.raises(qc.ChoiceRefused, match="holds no recipe choice"):
        qc.frozen_choice(path, "k2")
    assert issubclass(qc.ChoiceRefused, SystemExit)  # uncaught: one line and status 1, no traceback


def test_every_setting_cells_have_welch_intervals_over_run_means_and_the_goal_lists_failing_cells():
    def run(offset: float, spread: float) -> dict[str, list[float]]:
        return {c: [50 + offset + spread * k + (5 if c.startswith("tweets3/100/") else 0) for k in range(5)]
                for c in qc.cells(TASKS, qc.ENDPOINT_SIZES)}

    a_runs = [run(4.0, 0.5), run(6.0, 0.25), run(5.0, 1.0)]
    b_runs = [run(0.0, 0.5), run(1.0, 0.5), run(-1.0, 0.75)]
    a_runs[0]["sentiment/300/2"] = [40.0] * 5  # one run far below in one cell: its interval crosses 0
    for r in a_runs:
        r["tweets3/1000/7"] = [45.0] * 5  # A below B in every run: a regression
    endpoint = qc.every_setting_cells(a_runs, b_runs, TASKS)
    assert len(endpoint) == 48 and endpoint[0]["cell"] == "sentiment/100/1"
    by_cell = {row["cell"]: row for row in endpoint}
    a = [statistics.fmean(r["sentiment/300/2"]) for r in a_runs]
    b = [statistics.fmean(r["sentiment/300/2"]) for r in b_runs]
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    row = by_cell["sentiment/300/2"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert row["gain"] == pytest.approx(statistics.fmean(a) - statistics.fmean(b)) and row["runs"] == [3, 3]
    assert by_cell["tweets3/1000/7"]["flag"] == "REGRESSION" and by_cell["tweets3/1000/7"]["gain"] < 0
    assert by_cell["sentiment/1000/1"]["flag"] == "" and by_cell["sentiment/1000/1"]["ci_low"] > 0
    goal = qc.goal_every_setting(endpoint, TASKS)
    assert goal == {"goal": "every setting", "cells": 32, "passed_cells": 30, "pass": False,
                    "failing": ["sentiment/300/2", "tweets3/1000/7"]}
    # a cell with one run a side has no interval: it fails, and a cell not run at all is marked so
    endpoint = qc.every_setting_cells(a_runs[:1], b_runs, TASKS)
    assert math.isnan(endpoint[0]["ci_low"])
    assert qc.goal_every_setting(endpoint, TASKS)["passed_cells"] == 0
    assert qc.every_setting_cells([{}], b_runs, TASKS)[0]["flag"] == "not run"


def test_recipe_names_and_the_step_count_of_a_timing():
    from benchmarks.quality import search as qs

    assert qs.recipe_names("v2") == ["k2", "k2-lr1e-3", "k2-wd0.1", "k2-wwm", "k2-seq128", "k1"]
    assert qs.recipe_names("k1,k2-wwm") == ["k1", "k2-wwm"]
    with pytest.raises(SystemExit, match="unknown recipe k3"):
        qs.recipe_names("k1,k3")
    # lr and weight decay do not change a step's cost; whole words, length and corpus do
    keys = {n: qs.cost_key(v) for n, v in qs.CANDIDATES_V2.items()}
    assert keys["k2"] == keys["k2-lr1e-3"] == keys["k2-wd0.1"] and len(set(keys.values())) == 4
    assert qs.cost_key(qs.CHOSEN_ON_K1) == keys["k1"]
    seq128 = qs.CANDIDATES_V2["k2-seq128"]
    assert (seq128.seq, seq128.batch, seq128.corpus) == (128, 32, "k2")


def fake_finetune(checkpoint: str, data: dict, split: str, num_labels: int, setting: dict, seed: int,
                  pad_id: int = 0) -> dict[str, float]:
    """Dev scores by checkpoint: random init 50, K1's runs 60, K2's 55 (plus the setting's rate)."""
    name = Path(checkpoint).name
    base = 50.0 if name.startswith("random-init") else 60.0 if name.startswith("k1-") else 55.0
    return {"accuracy": base, "macro_f1": base + 1000 * setting["learning_rate"] + len(data["train"]) / 1000}


def failing_finetune(*args, **kwargs) -> dict[str, float]:
    raise AssertionError("a finished job ran again")


def test_evaluate_every_setting_reads_the_stage_and_local_checkpoints_and_writes_the_choice(
        tmp_path, samples_dir, monkeypatch):
    """The choice's glue with a stand-in for fine-tuning: the plan and vocabs from ``--work``, the
    runs from a folder of checkpoints, every run and B at each setting asked for, gains per cell
    against B of the run's corpus, the choice written (jobs keyed by the accelerator), and a
    second call reading every job from the cache."""
    from benchmarks.quality import finetune as quality_finetune
    from benchmarks.quality import search as qs
    from bert_core.model.checkpoint import save_pretrained

    work, out = tmp_path / "work", tmp_path / "out"
    vocabs = {c: work / c / "vocab" / "vocab.txt" for c in ("k1", "k2")}
    for vocab in vocabs.values():
        vocab.parent.mkdir(parents=True)
        vocab.write_text("\n".join((samples_dir / "models" / "minilm" / "vocab.txt").read_text().splitlines()[:2500]))
    plan = {"steps": {"k2": 9, "k2-wwm": 9, "k1": 9}, "corpus": {"k2": "k2", "k2-wwm": "k2", "k1": "k1"},
            "vocabs": {c: str(v) for c, v in vocabs.items()}}
    (work / "search-v2").mkdir()
    (work / "search-v2" / "plan.json").write_text(json.dumps(plan))
    checkpoints = tmp_path / "runs"
    for name, seed in (("k1", 42), ("k1", 43), ("k2", 42)):
        save_pretrained(qs.model_for(qs.CANDIDATES_V2[name], 2500, seed), str(checkpoints / f"{name}-seed{seed}"),
                        vocab_file=str(vocabs[name]))
    monkeypatch.setattr(quality_finetune, "finetune", fake_finetune)
    monkeypatch.setenv(quality_finetune.ACCELERATOR_VARIABLE, "gpu")
    args = ["evaluate", "--work", str(work), "--samples", str(samples_dir), "--checkpoints", str(checkpoints),
            "--sizes", "300", "--subsamples", "1", "--settings", "1,5", "--output", str(out / "search.json")]
    assert qs.main([*args, "--choose", str(out / "choice.json")]) == 0
    result = json.loads((out / "search.json").read_text())
    assert sorted(result["arms"]) == ["B-k1-seed42", "B-k1-seed43", "B-k2-seed42", "B-k2-seed43",
                                      "k1-seed42", "k1-seed43", "k2-seed42"]
    assert sorted(result["arms"]["k1-seed43"]["dev_macro_f1"]) == [
        "sentiment/300/1", "sentiment/300/5", "tweets3/300/1", "tweets3/300/5"]
    assert result["plan"]["vocabs"]["k2"] == str(vocabs["k2"])
    choice = json.loads((out / "choice.json").read_text())
    assert (choice["name"], choice["corpus"], choice["not_run"]) == ("k1", "k1", ["k2-wwm"])
    assert choice["cells"] == ["sentiment/300/1", "sentiment/300/5", "tweets3/300/1", "tweets3/300/5"]
    rows = {r["name"]: r for r in choice["candidates"]}
    assert list(rows) == ["k2", "k1"]
    assert rows["k1"]["minimum"] == pytest.approx(10.0) and rows["k2"]["mean"] == pytest.approx(5.0)
    assert qc.frozen_choice(out / "choice.json", "k1")["runs"] == {"k2": [42], "k1": [42, 43]}
    jobs = sorted((work / "search-v2" / "cache").glob("*.json"))
    assert len(jobs) == 7 * 4 and all(json.loads(j.read_text())["key"]["accelerator"] == "gpu" for j in jobs)
    monkeypatch.setattr(quality_finetune, "finetune", failing_finetune)
    assert qs.main(args) == 0
    assert json.loads((out / "search.json").read_text())["choice"]["candidates"] == choice["candidates"]


def test_run_jobs_reads_finished_ones_from_the_cache():
    from benchmarks.quality import search as qs

    class Cache(dict):
        def lookup(self, key):
            return self.get(json.dumps(key))

        def store(self, key, value):
            self[json.dumps(key)] = value

    cache = Cache()
    work_list = [({"n": n}, pow, (n, 2)) for n in range(5)]
    cache.store({"n": 1}, "finished before")
    assert qs.run_jobs(cache, work_list, 2) == [0, "finished before", 4, 9, 16]
    assert len(cache) == 5


def test_pretrain_keeps_the_runs_and_runs_only_what_is_missing(tmp_path):
    """Runs already in ``--keep`` are not run again (here all are: nothing is trained), and a
    recipe the plan has no step count for is refused."""
    from benchmarks.quality import search as qs

    work, keep = tmp_path / "work", tmp_path / "keep"
    (work / "search-v2").mkdir(parents=True)
    (work / "search-v2" / "plan.json").write_text(json.dumps({"steps": {"k1": 3}, "corpus": {"k1": "k1"}}))
    for seed in (42, 43):
        (keep / f"k1-seed{seed}").mkdir(parents=True)
        (keep / f"k1-seed{seed}" / "pretrain-log.json").write_text(json.dumps({"recipe": "k1", "seed": seed}))
    assert qs.pretrain_all(work, keep, ["k1"], [42, 43]) == 0
    with pytest.raises(SystemExit, match="prepared without k2"):
        qs.pretrain_all(work, keep, ["k2"], [42])
