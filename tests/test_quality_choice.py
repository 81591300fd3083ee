"""The quality protocol's recipe choice: its rule and freeze, the every-setting endpoint's cells
and goal, and the choice's three steps end to end through the product path (tiny, on CPU)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
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
    assert issubclass(qc.ChoiceRefused, SystemExit)  # the command line: one line and status 2, no traceback


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


def test_candidates_that_differ_in_optimizer_settings_only_share_a_calibration():
    from benchmarks.quality import search as qs
    from benchmarks.quality.spec import RECIPES, candidates

    # lr and weight decay do not change a step's cost; whole words, length and corpus do
    keys = {n: qs.cost_key(v) for n, v in candidates("v3").items()}
    assert keys["k2"] == keys["k2-lr1e-3"] == keys["k2-wd0.1"] and len(set(keys.values())) == 4
    assert qs.cost_key(RECIPES[qs.REFERENCE]) == keys["k1"]
    seq128 = candidates("v3")["k2-seq128"]
    assert (seq128.seq, seq128.batch, seq128.corpus) == (128, 32, "k2")


def tiny_samples(folder: Path) -> None:
    """K1's sources (a book, a play, a dump) and the tasks' files, small and in their real formats."""
    import shutil

    from tests.test_bench_quality import write_tiny_samples
    from tests.test_quality_corpus import write_samples

    write_samples(folder / "sources")
    for part in ("books", "plays", "wikipedia"):
        shutil.move(folder / "sources" / part, folder / part)
    write_tiny_samples(folder)


@pytest.mark.slow
def test_the_choice_trains_through_bertpipe_pretrain_and_chooses_on_dev(tmp_path, capsys):
    """prepare, pretrain --candidates and choose on tiny data through the product path: the
    corpus, instances and a calibration run of ``bertpipe pretrain`` give the step counts; each run
    is a ``bertpipe pretrain`` folder, not run again once finished; B is the product's random
    init; every run and B are fine-tuned on dev, the choice written, and a second choose reads
    every job from the cache. Wrong inputs stop in one line."""
    from benchmarks.quality.__main__ import main
    from benchmarks.quality.search import REFERENCE, read_plan

    samples, work, keep, out = tmp_path / "samples", tmp_path / "work", tmp_path / "runs", tmp_path / "out"
    tiny_samples(samples)
    common = ["--protocol", "v3", "--work", str(work), "--samples", str(samples)]
    with pytest.raises(SystemExit, match=f"^{work / 'choice' / 'plan.json'} is missing: run benchmarks.quality "
                                         "prepare"):
        main(["pretrain", "--candidates", *common, "--keep", str(keep)])
    assert main(["prepare", *common, "--quick", "--corpus", "k1"]) == 0
    plan = read_plan(work, "v3")
    assert list(plan["steps"]) == ["k1"] and plan["calibrated"] == {REFERENCE: [REFERENCE, "k1"]}
    assert plan["steps"]["k1"] == plan["calibration_steps"] == 4  # K1 is the reference's cost class
    assert (work / "choice" / f"calibration-{REFERENCE}-quick" / "done.json").exists()
    with pytest.raises(SystemExit, match="^pretrain --candidates needs --keep"):
        main(["pretrain", "--candidates", *common])
    with pytest.raises(SystemExit, match="no finished run of a candidate"):
        main(["choose", *common, "--checkpoints", str(tmp_path / "empty")])
    assert main(["pretrain", "--candidates", *common, "--keep", str(keep), "--seeds", "42,43", "--scale", "0.5"]) == 0
    for seed in (42, 43):
        done = json.loads((keep / f"k1-seed{seed}" / "done.json").read_text())
        assert done["steps"] == 2 and done["last_loss"] > 0
        assert (keep / f"k1-seed{seed}" / "hf" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["pretrain", "--candidates", *common, "--keep", str(keep), "--seeds", "42,43"]) == 0
    assert "not run again: k1-seed42, k1-seed43" in capsys.readouterr().out
    args = ["choose", *common, "--checkpoints", str(keep), "--sizes", "10", "--subsamples", "1",
            "--output", str(out / "search.json")]
    assert main([*args, "--choose", str(out / "choice.json")]) == 0
    result = json.loads((out / "search.json").read_text())
    assert sorted(result["arms"]) == ["B-k1-seed42", "B-k1-seed43", "k1-seed42", "k1-seed43"]
    assert result["arms"]["k1-seed43"]["pretrain"]["steps"] == 2
    cells = ["sentiment/10/1", "sentiment/10/2", "tweets3/10/1", "tweets3/10/2"]
    assert sorted(result["arms"]["B-k1-seed42"]["dev_macro_f1"]) == cells
    b = Path(result["arms"]["B-k1-seed42"]["checkpoint"])
    for name in ("config.json", "vocab.txt"):  # B: the runs' model and vocab
        assert (b / name).read_bytes() == (keep / "k1-seed42" / "hf" / name).read_bytes()
    choice = json.loads((out / "choice.json").read_text())
    assert (choice["name"], choice["corpus"], choice["cells"], choice["runs"]) == ("k1", "k1", cells, {"k1": [42, 43]})
    assert len(list((work / "choice" / "cache").glob("*.json"))) == 4 * 4
    capsys.readouterr()
    assert main(args) == 0
    assert "16 of 16 jobs reused" in capsys.readouterr().out



def test_a_refusal_on_the_command_line_is_one_line_and_status_2(tmp_path):
    """A step that refuses its input ends the command in its one line, exit 2 as the product's
    commands, with no traceback."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.quality", "choose", "--work", str(tmp_path),
                           "--checkpoints", str(tmp_path)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"{tmp_path / 'choice' / 'plan.json'} is missing: run benchmarks.quality "
                                        f"prepare --work {tmp_path} first"]
