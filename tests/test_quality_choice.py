"""Version 2 of the quality protocol: the recipe choice's rule and freeze, the every-setting
endpoint's cells and goal, the stage's compact instances, the side-by-side pre-training of the
candidates with one step count from a timing, the runs kept for the evaluation on the same
machine, and that evaluation as the device machine runs it (tiny, on CPU)."""

from __future__ import annotations

import json
import math
import shutil
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
    assert qs.gpu_minute_steps([41.7, 40.2, 44.0], 5) == math.floor(40.2 * 300)
    # lr and weight decay do not change a step's cost; whole words, length and corpus do
    keys = {n: qs.cost_key(v) for n, v in qs.CANDIDATES_V2.items()}
    assert keys["k2"] == keys["k2-lr1e-3"] == keys["k2-wd0.1"] and len(set(keys.values())) == 4
    assert qs.cost_key(qs.CHOSEN_ON_K1) == keys["k1"]
    seq128 = qs.CANDIDATES_V2["k2-seq128"]
    assert (seq128.seq, seq128.batch, seq128.corpus) == (128, 32, "k2")


def tiny_stage(tmp_path: Path, samples_dir: Path) -> tuple[Path, dict[str, str]]:
    """A version-2 stage as prepare writes it, on tiny instances: K1 at 64 tokens, K2 at 128."""
    from benchmarks.quality import search as qs
    from tests.test_data import make_instances

    stage = tmp_path / "stage"
    stage.mkdir()
    folders = {}
    for corpus, seq in (("k1", 64), ("k2", 128)):
        folders[corpus] = Path(make_instances(tmp_path / corpus, samples_dir, num_shards=2, masking="dynamic",
                                              max_seq_length=seq))
        shutil.copytree(tmp_path / corpus / "vocab", stage / f"vocab-{corpus}")
        qs.pack_instances({f"instances-{corpus}-seq{seq}": folders[corpus]}, stage, f"instances-{corpus}.npz.xz")
    plan = {"candidates": "v2", "steps": {"k1": 3, "k2-seq128": 3}, "corpus": {"k1": "k1", "k2-seq128": "k2"},
            "instances": {"k1": "instances-k1-seq64", "k2-seq128": "instances-k2-seq128"},
            "archives": {"k1": "a" * 64, "k2": "b" * 64}}
    (stage / "steps.json").write_text(json.dumps(plan))
    return stage, {c: str(f) for c, f in folders.items()}


def test_the_stage_packs_instances_compactly_and_unpacks_them_row_for_row(tmp_path, samples_dir):
    import numpy as np
    import pyarrow.parquet as pq

    from benchmarks.quality import search as qs
    from bert_core.pretrain.data import PretrainingLoader, vocab_file_of

    stage, folders = tiny_stage(tmp_path, samples_dir)
    assert not list(stage.rglob("seq*/part-*.parquet"))  # the training shards travel in the archive only
    inputs = qs.staged_inputs(stage, json.loads((stage / "steps.json").read_text()), tmp_path / "unpacked")
    instances, vocab_file = inputs["k1"]
    assert vocab_file_of(instances) == str((stage / "vocab-k1" / "vocab.txt").resolve())
    original = Path(folders["k1"]) / "seq64"
    for shard in sorted(original.glob("*.parquet")):
        assert pq.read_table(Path(instances) / "seq64" / shard.name).equals(pq.read_table(shard))
    ours, theirs = PretrainingLoader(instances, 64, 4, seed=7), PretrainingLoader(folders["k1"], 64, 4, seed=7)
    for j in (0, 3):
        a, b = ours.batch(1, j), theirs.batch(1, j)
        assert all(np.array_equal(a[k], b[k]) for k in a)  # the same rows, masked alike


def test_a_compact_checkpoint_expands_to_the_files_saved(tmp_path):
    from benchmarks.quality import search as qs
    from bert_core.model.checkpoint import save_pretrained

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(995))]))
    saved = tmp_path / "saved"
    save_pretrained(qs.model_for(qs.CANDIDATES_V2["k1"], 1000, 7), str(saved), vocab_file=str(vocab))
    trip = tmp_path / "trip"
    shutil.copytree(saved, trip)
    qs.compact_checkpoint(trip)
    assert not (trip / "model.safetensors").exists()
    assert (trip / "model.safetensors.planes.xz").stat().st_size < 0.9 * (saved / "model.safetensors").stat().st_size
    qs.expand_checkpoint(trip)
    assert {p.name: p.read_bytes() for p in trip.iterdir()} == {p.name: p.read_bytes() for p in saved.iterdir()}


@pytest.mark.slow
def test_gpu_minutes_time_the_runs_side_by_side_and_give_them_one_step_count(tmp_path, samples_dir, capsys,
                                                                            monkeypatch):
    """Two candidates (K1 at 64 tokens, K2 at 128 x 32) x two seeds side by side on CPU, a
    1-second timing instead of 30: one step count for the four, logged with the card, steps,
    tokens seen and wall-clock, each checkpoint archived as ``<recipe>-seed<S>``."""
    from benchmarks.quality import search as qs
    from bert_core.model.bert import BertForPreTraining

    stage, _ = tiny_stage(tmp_path, samples_dir)
    monkeypatch.setattr(qs, "TIMING_WARMUP", 2)
    monkeypatch.setattr(qs, "XZ_PRESET", 0)  # the trip back is checked for bookkeeping, not size
    out = tmp_path / "out"
    assert qs.pretrain_all(stage, out, ["k1", "k2-seq128"], seeds=[42, 43], gpu_minutes=0.01, timing_seconds=1.0,
                           unpack_root=tmp_path / "unpacked") == 0
    files = sorted(p.name for p in out.iterdir())  # one archive of all four in parts (18 MB each with this vocab)
    assert 1 < len(files) <= 8 and all(f.startswith("runs.tar.part-") for f in files)
    folder = qs.unpack(out, tmp_path / "back")
    assert sorted(p.name for p in folder.iterdir()) == [f"{n}-seed{s}" for n in ("k1", "k2-seq128") for s in (42, 43)]
    logs = {p.name: json.loads((p / "pretrain-log.json").read_text()) for p in folder.iterdir()}
    counts = {row["steps"] for row in logs.values()}
    assert len(counts) == 1
    (steps,) = counts
    rates = logs["k1-seed42"]["timing_all_steps_per_second"]
    assert steps == max(1, math.floor(min(rates) * 60 * 0.01)) and len(rates) == 4
    for name, row in logs.items():
        assert row["card"] == "cpu" and row["seed"] == int(name[-2:]) and row["gpu_minutes"] == 0.01
        assert row["tokens_seen"] == steps * (32 * 128 if name.startswith("k2-seq128") else 64 * 64)
        assert row["log"][-1]["step"] == steps - 1 and row["wall_minutes"] > 0
    assert BertForPreTraining.from_pretrained(str(folder / "k2-seq128-seed43")).config.vocab_size == 30522
    assert "steps each for 0.01 minutes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="prepared without k2"):
        qs.pretrain_all(stage, out, ["k2"], seeds=[42])


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
    """The choice's glue as the device machine runs it, with a stand-in for fine-tuning: the plan,
    vocabs and tasks' files from the stage, the runs from a folder of checkpoints, every run and B
    at each setting asked for, gains per cell against B of the run's corpus, the choice and the
    packed job cache written (jobs keyed by the accelerator), and a second call reading every
    job from the cache."""
    from benchmarks.quality import cache as bq
    from benchmarks.quality import finetune as quality_finetune
    from benchmarks.quality import search as qs
    from bert_core.model.checkpoint import save_pretrained

    stage = tmp_path / "stage"
    for corpus in ("k1", "k2"):
        (stage / f"vocab-{corpus}").mkdir(parents=True)
        (stage / f"vocab-{corpus}" / "vocab.txt").write_text(
            "\n".join((samples_dir / "models" / "minilm" / "vocab.txt").read_text().splitlines()[:2500]))
    plan = {"candidates": "v2", "steps": {"k2": 9, "k2-wwm": 9, "k1": 9},
            "corpus": {"k2": "k2", "k2-wwm": "k2", "k1": "k1"},
            "vocabs": {"k1": "/elsewhere/k1/vocab.txt", "k2": "/elsewhere/k2/vocab.txt"}}
    (stage / "steps.json").write_text(json.dumps(plan))
    qs.stage_tasks(samples_dir, stage)
    checkpoints = tmp_path / "runs"
    for name, seed in (("k1", 42), ("k1", 43), ("k2", 42)):
        save_pretrained(qs.model_for(qs.CANDIDATES_V2[name], 2500, seed), str(checkpoints / f"{name}-seed{seed}"),
                        vocab_file=str(stage / f"vocab-{name}" / "vocab.txt"))
    monkeypatch.setattr(quality_finetune, "finetune", fake_finetune)
    monkeypatch.setenv("BERTPIPE_SAMPLES", str(tmp_path / "no-samples"))  # only the stage's copy is there
    monkeypatch.setenv(quality_finetune.ACCELERATOR_VARIABLE, "gpu")
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["evaluate", "--stage", str(stage), "--work", str(work), "--checkpoints",
            str(checkpoints), "--sizes", "300", "--subsamples", "1", "--settings", "1,5", "--output",
            str(out / "search.json"), "--cache-out", str(out / "cache.tar.xz")]
    assert qs.main([*args, "--choose", str(out / "choice.json")]) == 0
    result = json.loads((out / "search.json").read_text())
    assert sorted(result["arms"]) == ["B-k1-seed42", "B-k1-seed43", "B-k2-seed42", "B-k2-seed43",
                                      "k1-seed42", "k1-seed43", "k2-seed42"]
    assert sorted(result["arms"]["k1-seed43"]["dev_macro_f1"]) == [
        "sentiment/300/1", "sentiment/300/5", "tweets3/300/1", "tweets3/300/5"]
    assert result["plan"]["vocabs"]["k2"] == str(stage / "vocab-k2" / "vocab.txt")
    choice = json.loads((out / "choice.json").read_text())
    assert (choice["name"], choice["corpus"], choice["not_run"]) == ("k1", "k1", ["k2-wwm"])
    assert choice["cells"] == ["sentiment/300/1", "sentiment/300/5", "tweets3/300/1", "tweets3/300/5"]
    rows = {r["name"]: r for r in choice["candidates"]}
    assert list(rows) == ["k2", "k1"]
    assert rows["k1"]["minimum"] == pytest.approx(10.0) and rows["k2"]["mean"] == pytest.approx(5.0)
    assert qc.frozen_choice(out / "choice.json", "k1")["runs"] == {"k2": [42], "k1": [42, 43]}
    jobs = sorted((work / "search-v2" / "cache").glob("*.json"))
    assert len(jobs) == 7 * 4 and all(json.loads(j.read_text())["key"]["accelerator"] == "gpu" for j in jobs)
    assert bq.pack_cache(work / "search-v2" / "cache", tmp_path / "again.tar.xz") == 28
    assert (tmp_path / "again.tar.xz").read_bytes() == (out / "cache.tar.xz").read_bytes()
    monkeypatch.setattr(quality_finetune, "finetune", failing_finetune)
    assert qs.main(args) == 0
    assert json.loads((out / "search.json").read_text())["choice"]["candidates"] == choice["candidates"]


def test_run_jobs_starts_no_job_after_its_seconds_and_reads_finished_ones_from_the_cache():
    from benchmarks.quality import search as qs

    class Cache(dict):
        def lookup(self, key):
            return self.get(json.dumps(key))

        def store(self, key, value):
            self[json.dumps(key)] = value

    cache = Cache()
    work_list = [({"n": n}, pow, (n, 2)) for n in range(5)]
    assert qs.run_jobs(cache, work_list, 2, seconds=1e-9) == [None] * 5 and not cache
    cache.store({"n": 1}, "finished before")
    assert qs.run_jobs(cache, work_list, 2) == [0, "finished before", 4, 9, 16]
    assert len(cache) == 5


def test_pretrain_keep_runs_only_what_is_missing_and_archives_the_runs_only_when_they_fit(tmp_path, monkeypatch):
    """Runs already in ``--keep`` are not run again (here all are: nothing is trained); their logs
    come back always, their compact archive only when it fits what a device call returns."""
    from benchmarks.quality import search as qs
    from bert_core.model.checkpoint import save_pretrained

    stage, keep = tmp_path / "stage", tmp_path / "keep"
    stage.mkdir()
    (stage / "steps.json").write_text(json.dumps({"candidates": "v2", "steps": {"k1": 3}, "corpus": {"k1": "k1"}}))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(995))]))
    for seed in (42, 43):
        save_pretrained(qs.model_for(qs.CANDIDATES_V2["k1"], 1000, seed), str(keep / f"k1-seed{seed}"),
                        vocab_file=str(vocab))
        (keep / f"k1-seed{seed}" / "pretrain-log.json").write_text(json.dumps({"recipe": "k1", "seed": seed}))
    saved = {p.relative_to(keep): p.read_bytes() for p in keep.rglob("*") if p.is_file()}
    monkeypatch.setattr(qs, "XZ_PRESET", 0)
    out = tmp_path / "out"
    assert qs.pretrain_all(stage, out, ["k1"], seeds=[42, 43], keep=keep) == 0
    assert sorted(p.name for p in out.iterdir()) == ["pretrain-logs.json", "runs.tar"]
    assert json.loads((out / "pretrain-logs.json").read_text())["k1-seed43"]["seed"] == 43
    back = qs.unpack(out, tmp_path / "back")
    assert {p.relative_to(back): p.read_bytes() for p in back.rglob("*") if p.is_file()} == saved
    assert {p.relative_to(keep): p.read_bytes() for p in keep.rglob("*") if p.is_file()} == saved
    monkeypatch.setattr(qs, "RETURN_LIMIT", qs.RETURN_ROOM + 2**16)  # a device call with no room for them
    assert qs.pretrain_all(stage, tmp_path / "small", ["k1"], seeds=[42, 43], keep=keep) == 0
    assert [p.name for p in (tmp_path / "small").iterdir()] == ["pretrain-logs.json"]
    with pytest.raises(SystemExit, match="already holds k1-seed42, k1-seed43: move them away"):
        qs.pretrain_all(stage, out, ["k1"], seeds=[42, 43], gpu_minutes=1.0, keep=keep)
    with pytest.raises(SystemExit, match="pretrain needs --seeds"):
        qs.pretrain_all(stage, out, ["k1"], keep=keep)
