"""Every fine-tuning task end to end on our fixtures (a tiny random BERT learns each), the real
sentiment sample on MiniLM, DeepSpeed vs single process, seeds summary, CLI and Prefect flow."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_core.config import FinetuneConfig
from bert_core.finetune import TASKS, conlleval, squad_eval
from bert_core.finetune.report import run_many, summarize
from bert_core.finetune.train import run_job

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
TINY = dict(num_train_epochs=1, batch_size=8, max_seq_length=64, squad_max_seq_length=96,
            doc_stride=24, max_query_length=24, learning_rate=1e-4, threads=1)
SETTING = "lr1e-4-bs8-ep1"  # TINY's one setting, as its folder is named


# Epochs and a rate at which the tiny random BERT learns each fixture's few dozen training
# examples, and what "learned" means there (0-100, scored on those training examples): well
# above the majority class or chance, below what the seeded run reaches, so a model that stops
# learning fails while a small change of numerics does not.
LEARN = dict(TINY, num_train_epochs=5, learning_rate=3e-3)
LEARN_SLOWER = {"sst2": 10, "qqp": 10, "squad": 10}  # epochs at 1e-3: these do not learn at 3e-3
LEARNED = {"cola": 80, "stsb": 60, "mnli": 60, "squad": 50, "squad_v2": 50}  # the others: 90


def learn_settings(task: str) -> dict:
    if task == "ner_bilstm":  # its BiLSTM trains ten epochs per epoch on frozen features
        return dict(LEARN, num_train_epochs=1)
    if task in LEARN_SLOWER:
        return dict(LEARN, num_train_epochs=LEARN_SLOWER[task], learning_rate=1e-3)
    return LEARN


def trained_on_its_eval_splits(task: str, tmp_path: Path) -> Path:
    """A copy of the task's fixture whose evaluation splits are its training split."""
    spec = TASKS[task]
    folder = tmp_path / "data" / spec.folder
    shutil.copytree(FIXTURES / spec.folder, folder)
    train = [p for p in folder.iterdir() if p.name.startswith("train")]
    for split in (p for p in folder.iterdir() if not p.name.startswith("train")):
        shutil.copy(next(t for t in train if t.suffix == split.suffix), split)
    return tmp_path / "data"


@pytest.mark.parametrize("task", sorted(TASKS.keys() - {"sentiment"}))
def test_every_task_learns_its_fixture(task, tiny_checkpoint, samples_dir, tmp_path):
    from bert_core.finetune.grid import Setting
    from bert_core.finetune.report import percent

    data = trained_on_its_eval_splits(task, tmp_path)
    cfg = FinetuneConfig(**learn_settings(task))
    m = run_job(task, str(data), tiny_checkpoint, cfg, seed=1, output=str(tmp_path))
    setting = Setting(cfg.learning_rate, cfg.batch_size, cfg.num_train_epochs).name
    job = tmp_path / TASKS[task].name / setting / "seed=1"
    saved = json.loads((job / "metrics.json").read_text())
    assert saved["main"] == m["main"] and m["main_metric"] in m["flat"]
    assert percent(task, m["main"]) >= LEARNED.get(task, 90), m["flat"]
    assert m["train"]["last_loss"] < m["train"]["first_loss"]
    for name in m["predictions"]:
        assert (job / name).stat().st_size > 0
    assert all(v == 0 for k, v in m["counts"].items() if k.endswith("_rejected"))
    # the job's model: its task model folder (a feature-based task saves none)
    assert (m["model"] is None) == (task == "ner_bilstm") and (job / "model" / "config.json").exists() == (
        task != "ner_bilstm")
    if m["model"]:
        from bert_core.finetune.task_model import load_task_model

        _, meta = load_task_model(str(job / m["model"]))
        assert meta["task"] == task and meta["seed"] == 1 and meta["setting"]["name"] == setting
        if task == "squad_v2":  # predict applies the threshold tuned on dev
            assert meta["null_score_diff_threshold"] == m["metrics"]["dev"]["null_score_diff_threshold"]
    if task in ("squad", "squad_v2"):
        # the written predictions score the same with the official-rule evaluator
        dev = next((data / TASKS[task].folder).glob("dev-*.json"))
        articles = json.loads(dev.read_text())["data"]
        preds = json.loads((job / "predictions.json").read_text())
        assert set(preds) == {qa["id"] for a in articles for p in a["paragraphs"] for qa in p["qas"]}
        if task == "squad":
            assert squad_eval.evaluate_v1(articles, preds)["f1"] == pytest.approx(m["main"])
        else:
            null_odds = json.loads((job / "null_odds.json").read_text())
            assert set(null_odds) == set(preds)
            assert squad_eval.evaluate_v2(articles, preds)["f1"] == pytest.approx(m["main"])
            # the tuned threshold is at least as good as the default 0.0
            assert m["main"] >= m["metrics"]["dev"]["f1_at_threshold_0"]
    if task in ("ner", "ner_bilstm") and shutil.which("perl"):
        official = subprocess.run(
            ["perl", str(samples_dir / "tasks" / "conll" / "conlleval.pl")],
            stdin=(job / "valid_predictions.txt").open(), capture_output=True, text=True, check=True,
        ).stdout
        assert f"FB1: {m['main']:6.2f}" in official


@pytest.mark.slow
def test_deepspeed_engine_trains_like_the_plain_loop(tiny_checkpoint, tmp_path):
    """The same job under a one-rank DeepSpeed engine (gloo, CPU) gives the same losses and metric.
    The engine's run is a process of its own (it sets up torch.distributed); the plain one runs here."""
    from bert_core.finetune.train import main

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = [f"--set={k}={v}" for k, v in TINY.items()]
    args = ["--task", "rte", "--data", str(FIXTURES), "--checkpoint", tiny_checkpoint, "--seed", "3", *sets]
    main([*args, "--output", str(tmp_path / "plain")])
    subprocess.run([sys.executable, "-m", "bert_core.finetune.train", *args, "--output", str(tmp_path / "ds"),
                    "--set=deepspeed=true"], check=True, env=env, capture_output=True)
    out = {name: json.loads((tmp_path / name / "rte" / SETTING / "seed=3" / "metrics.json").read_text())
           for name in ("plain", "ds")}
    assert out["ds"]["train"]["deepspeed"] and not out["plain"]["train"]["deepspeed"]
    for key in ("first_loss", "last_loss"):
        assert out["ds"]["train"][key] == pytest.approx(out["plain"]["train"][key], rel=1e-4)
    assert out["ds"]["main"] == out["plain"]["main"]
    # the engine's job saves its model too, the same weights as the plain loop's (to float noise)
    from bert_core.finetune.task_model import load_task_model

    models = {name: load_task_model(str(tmp_path / name / "rte" / SETTING / "seed=3" / "model"))[0]
              for name in ("plain", "ds")}
    for (key, a), b in zip(models["plain"].state_dict().items(), models["ds"].state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3, msg=key)


@pytest.mark.slow
def test_sentiment_on_minilm_beats_the_majority_class(samples_dir, tmp_path):
    """Real product-review/tweet ratings, real MiniLM weights: clearly better than chance."""
    # A slice of the real files (same format) keeps the test small; the dev split is hash based.
    data = tmp_path / "tasks" / "sentiment"
    data.mkdir(parents=True)
    for f in (samples_dir / "tasks" / "sentiment").glob("*.txt"):
        (data / f.name).write_text("\n".join(f.read_text().splitlines()[:600]) + "\n")
    # 20 steps only, so a higher rate than the paper's grid (which assumes thousands of steps)
    cfg = FinetuneConfig(num_train_epochs=1, batch_size=16, max_seq_length=48, learning_rate=2e-4,
                         max_train_examples=320, threads=1)
    m = run_job("sentiment", str(tmp_path / "tasks"), str(samples_dir / "models" / "minilm"), cfg,
                seed=1, output=str(tmp_path / "out"))
    preds = (tmp_path / "out" / "sentiment" / "lr2e-4-bs16-ep1" / "seed=1" / "dev_predictions.tsv"
             ).read_text().splitlines()[1:]
    from bert_core.finetune.glue import read_sentiment

    gold = {e.guid: e.label for e in read_sentiment(str(data), "dev")[0]}
    majority = max(list(gold.values()).count(lab) for lab in set(gold.values())) / len(gold)
    assert len(preds) == len(gold) > 120  # 15% of the slice is dev, 15% test
    assert m["flat"]["test/accuracy"] > majority - 0.1  # the held-out test split is scored too
    assert m["main"] > majority + 0.05, (m["main"], majority)


def test_bad_records_are_rejected_with_reasons_never_dropped(tiny_checkpoint, tmp_path):
    rte = tmp_path / "RTE"
    shutil.copytree(FIXTURES / "RTE", rte)
    lines = (rte / "train.tsv").read_text().splitlines()
    lines += ["99\tonly two columns", "100\ta\tb\tmaybe"]
    (rte / "train.tsv").write_text("\n".join(lines) + "\n")
    m = run_job("rte", str(tmp_path), tiny_checkpoint, FinetuneConfig(**TINY), 1, str(tmp_path / "o"))
    assert m["counts"]["train_rejected"] == 2 and m["counts"]["train_examples"] == len(lines) - 1 - 2
    rejects = [json.loads(x) for x in (tmp_path / f"o/rte/{SETTING}/seed=1/rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["bad_columns", "unknown_label"]
    assert all(r["source"].endswith("train.tsv") for r in rejects)


def test_seeds_summary_keeps_every_value_and_failures(tiny_checkpoint, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURES / "MRPC", data / "MRPC")  # swag has no data here: it must fail alone
    cfg = FinetuneConfig(**TINY)
    from bert_core import storage

    # an earlier run's results are replaced, never mixed in; a folder that is not ours stays
    stale = tmp_path / "o" / "mrpc" / "lr9e-9-bs8-ep1" / "seed=1"
    stale.mkdir(parents=True)
    (stale / "metrics.json").write_text("{}")
    storage.write_manifest(str(tmp_path / "o" / "mrpc"), stage="finetune", config={}, task="mrpc")
    (tmp_path / "o" / "swag").mkdir()
    (tmp_path / "o" / "swag" / "notes.txt").write_text("mine")
    index = run_many(["mrpc", "swag"], [1, 2], str(data), tiny_checkpoint, cfg, str(tmp_path / "o"),
                     versions={"mrpc": "v1", "swag": "v2"})
    assert index["stage"] == "finetune-index"
    assert index["counts"] == {"checkpoints": 1, "tasks": 2, "jobs": 4, "succeeded": 2, "failed": 2}
    assert {(f["task"], f["seed"]) for f in index["failures"]} == {("swag", 1), ("swag", 2)}
    assert not stale.parent.exists() and (tmp_path / "o" / "swag" / "notes.txt").exists()

    # the task with a finished job has its folder and manifest; the one whose every job failed has none
    manifest = storage.read_manifest(str(tmp_path / "o" / "mrpc"))
    assert manifest["stage"] == "finetune" and manifest["task"] == "mrpc" and manifest["version"] == "v1"
    assert manifest["counts"] == {"jobs": 2, "succeeded": 2, "failed": 0}
    assert manifest["checkpoint_name"] == Path(tiny_checkpoint).name and manifest["config"]["tasks"] == ["mrpc"]
    summary = manifest["stats"]["summary"]
    f1 = summary["mrpc"]["metrics"]["dev/f1"]
    assert f1["n"] == 2 and set(f1["values"]) == {"1", "2"}
    assert summary["mrpc"]["selected"] == SETTING and summary["mrpc"]["final_label"] == "dev (also used for selection)"
    assert not storage.has_manifest(str(tmp_path / "o" / "swag"))
    swag = index["stats"]["swag"]
    assert swag["failed_seeds"] == [1, 2] and swag["selected"] is None and swag["final"] is None
    assert index["stats"]["mrpc"]["selected"] == SETTING and index["stats"]["mrpc"]["version"] == "v1"
    # one metrics.json per finished job, report.md and the published model's files
    shards = [s["path"] for s in manifest["shards"]]
    assert len([p for p in shards if not p.startswith("model/")]) == 3 and "model/config.json" in shards
    assert manifest["model"]["setting"] == SETTING and manifest["model"]["seed"] in (1, 2)
    assert (tmp_path / "o" / "mrpc" / "report.md").exists()
    failed = summarize([r for r in (
        {"task": "swag", "setting": {"name": SETTING}, "seed": s, "ok": False, "error": "FileNotFoundError: swag"}
        for s in (1, 2))])["summary"]["swag"]
    assert failed["failed_seeds"] == [1, 2] and "FileNotFoundError" in failed["errors"]["1"]
    setting = {"name": "lr1e-4-bs8-ep1"}
    results = [{"task": "rte", "setting": setting, "seed": s, "ok": True, "metrics": {"flat": {"dev/accuracy": v}}}
               for s, v in ((1, 0.5), (2, 0.7), (3, 0.9))]
    stats = summarize(results)
    assert stats["grid"]["rte"]["lr1e-4-bs8-ep1"]["metrics"]["dev/accuracy"]["mean"] == pytest.approx(0.7)
    assert stats["summary"]["rte"]["final"]["mean"] == pytest.approx(70.0)  # reported on 0-100
    assert stats["summary"]["rte"]["final"]["sd"] == pytest.approx(20.0)


def test_cli_finetune_and_features(tiny_checkpoint, tmp_path):
    # Prefect's log handlers set up on the real stderr, not on CliRunner's, which is closed when a
    # later test's flow logs
    import prefect.main  # noqa: F401
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from flows.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["finetune", "--task", "sst2,wnli", "--data", str(FIXTURES), "--checkpoint",
                            tiny_checkpoint, "--output", str(tmp_path / "ft"), "--seeds", "4",
                            "--learning-rates", "1e-4", "--epochs", "1", "--set", "finetune.batch_size=8",
                            "--set", "finetune.threads=1"])
    assert r.exit_code == 0, r.output
    assert "sst2" in r.stdout and "dev mean ± sd (0-100)" in r.stdout and "✓" in r.stdout
    assert (tmp_path / "ft" / "wnli" / "lr1e-4-bs8-ep1" / "seed=4" / "metrics.json").exists()
    r = runner.invoke(app, ["finetune", "--task", "sst2", "--data", ".", "--checkpoint", ".", "--output", ".",
                            "--learning-rates", "1e-4,1e-4"])
    assert r.exit_code == 2 and "--learning-rates '1e-4,1e-4'" in r.output and "distinct" in r.output
    r = runner.invoke(app, ["finetune", "--task", "nosuch", "--data", ".", "--checkpoint", ".", "--output", "."])
    assert r.exit_code == 2 and "unknown task" in r.output
    r = runner.invoke(app, ["features", "--checkpoint", tiny_checkpoint, "--input",
                            str(FIXTURES / "ner" / "valid.txt"), "--output", str(tmp_path / "f.parquet"),
                            "--layers", "sum_last_four", "--threads", "1"])
    assert r.exit_code == 0, r.output
    table = pq.read_table(tmp_path / "f.parquet")
    assert table.num_rows == 16 and len(table["features"][0].as_py()[0]) == 128


def test_demo_data_dir_layout(samples_dir):
    """Every task of the demo preset reads real data that `samples fetch` laid out, no fixtures."""
    from bert_core.config import load_config
    from bert_core.finetune import get_task, task_dir
    from bert_core.finetune.ner import read_conll

    cfg = load_config("demo")
    assert cfg.finetune.data_dir == "samples/tasks" and "swag" not in cfg.finetune.tasks
    data_dir = str(samples_dir / "tasks")
    for name in cfg.finetune.tasks:
        folder = task_dir(data_dir, get_task(name))
        assert folder == str(samples_dir / "tasks" / get_task(name).folder)
    train, rejects = read_conll(str(samples_dir / "tasks" / "ner" / "train.txt"))
    valid, _ = read_conll(str(samples_dir / "tasks" / "ner" / "valid.txt"))
    assert not rejects and len(train) == 4 * len(valid) > 0
    assert {t[2:] for _, tags in train for t in tags if t != "O"} >= {"NP", "VP", "PP"}


def test_demo_summary_reads_the_scores_against_the_commoner_class(samples_dir):
    from collections import Counter

    from bert_core.finetune.glue import read_sentiment
    from flows.demo import baseline_lines, demo_config

    cfg = demo_config(str(samples_dir), [])
    test, _ = read_sentiment(str(samples_dir / "tasks" / "sentiment"), "test")
    share = max(Counter(e.label for e in test).values()) / len(test)
    assert len(test) >= 1000 and 0.5 < share < 0.8  # both classes are there, one more often
    sentiment, few_labels, minilm = baseline_lines(cfg)
    assert f"all {len(test)} test sentences scores {100 * share:.1f}" in sentiment
    assert few_labels.startswith("  sentiment@300 is sentiment trained on 300 of its labelled examples")
    assert minilm.startswith("  minilm is fine-tuned with learning_rates=") and "max_train_examples" in minilm


def test_the_demo_tells_the_quality_protocols_story_from_its_committed_results():
    """The demo's quality lines are read from the newest committed results, and the README quotes
    the same primary figures and, per task, the pre-trained model against TF-IDF + LR."""
    from flows.demo import quality_lines, quality_results

    path = quality_results()
    result = json.loads(path.read_text())
    lines = quality_lines()
    readme = " ".join((path.parent.parent / "README.md").read_text().split())
    for e in result["primary"]:
        figure = f"{e['gain']:+.1f} [{e['ci_low']:+.1f}, {e['ci_high']:+.1f}]"
        assert any(figure in line for line in lines) and figure in readme
    beside = [re.search(r"pre-trained ([\d.]+), TF-IDF \+ LR ([\d.]+) \((\S+) ahead", line) for line in lines]
    assert len([m for m in beside if m]) == len(result["tasks"])
    for ours, tfidf, ahead in (m.groups() for m in beside if m):
        assert (f"{tfidf} against {ours}" if ahead == "TF-IDF" else f"{ours} against {tfidf}") in readme
    assert quality_lines(path.parent / "missing.json") == []


def test_a_learning_curve_task_is_its_task_on_a_stratified_draw():
    from collections import Counter

    import numpy as np

    from bert_core.finetune import get_task
    from bert_core.finetune.data import stratified_subset, subsample, training_subset
    from bert_core.finetune.glue import read_glue

    rows = [{"id": i, "label": label} for i, label in enumerate("a" * 70 + "b" * 25 + "c" * 5)]
    for size, want in ((3, {"a": 1, "b": 1, "c": 1}), (10, {"a": 7, "b": 2, "c": 1}),
                       (33, {"a": 23, "b": 8, "c": 2}), (100, {"a": 70, "b": 25, "c": 5})):
        out = stratified_subset(rows, size, np.random.default_rng(1), label=lambda r: r["label"])
        assert Counter(r["label"] for r in out) == want, size
        assert [r["id"] for r in out] == sorted(r["id"] for r in out)  # the rows keep their order
    draws = {tuple(r["id"] for r in stratified_subset(rows, 10, np.random.default_rng(s), label=lambda r: r["label"]))
             for s in range(5)}
    assert len(draws) > 1  # the rng decides which rows

    task = get_task("SST2@8")
    assert (task.name, task.base, task.train_size, task.folder) == ("sst2@8", "sst2", 8, "SST-2")
    train, _ = read_glue("sst2", str(FIXTURES / "SST-2"), "train")
    first, again = training_subset(task, train), training_subset(get_task("sst2@8"), train)
    assert [e.guid for e in first] == [e.guid for e in again] and len(first) == 8  # one draw, always
    assert Counter(e.label for e in first) == {"0": 4, "1": 4}  # 15 and 17 of the 32, in their shares
    assert training_subset(get_task("sst2"), train) == train
    assert first == subsample(train, 8, "sst2", draw=0) != subsample(train, 8, "sst2", draw=1)
    for name, needle in (("squad@30", "classification tasks only"), ("sst2@x", "number of training examples"),
                         ("sst2@0", "number of training examples"), ("nope@3", "unknown task")):
        with pytest.raises(KeyError, match=needle):
            get_task(name)
    with pytest.raises(ValueError, match="asks for 999 training examples"):
        training_subset(get_task("sst2@999"), train)


def test_a_learning_curve_point_is_reported_beside_its_task(tiny_checkpoint, tmp_path):
    from bert_core import storage
    from flows.demo import finetune_lines

    cfg = FinetuneConfig(**TINY)
    run_many(["sst2", "sst2@8"], [1], str(FIXTURES), tiny_checkpoint, cfg, str(tmp_path / "o"),
             versions={"sst2": "v1", "sst2@8": "v2"})
    counts = {t: json.loads((tmp_path / "o" / t / SETTING / "seed=1" / "metrics.json").read_text())["counts"]
              for t in ("sst2", "sst2@8")}
    assert counts["sst2@8"]["train_examples"] == 8 < counts["sst2"]["train_examples"]
    assert counts["sst2@8"]["dev_examples"] == counts["sst2"]["dev_examples"]  # scored on the same split
    assert storage.read_manifest(str(tmp_path / "o" / "sst2@8"))["task"] == "sst2@8"
    jobs = [{"task": t, "checkpoint": "tiny", "status": "completed", "output": str(tmp_path / "o" / t)}
            for t in ("sst2", "sst2@8")]
    header, full, few = finetune_lines(jobs)
    assert full.lstrip().startswith("sst2 (dev/accuracy") and few.lstrip().startswith("sst2@8 (dev/accuracy")
    assert "(n=1" in few and "±" in few


def test_prefect_flow_fans_out_and_survives_a_failure(prefect_api, tiny_checkpoint, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        TaskRunFilter,
        TaskRunFilterName,
    )

    from bert_core.config import load_config
    from flows.finetune import finetune

    data = tmp_path / "data"
    shutil.copytree(FIXTURES / "WNLI", data / "WNLI")
    cfg = load_config("demo")
    cfg.finetune = FinetuneConfig(**TINY, tasks=["wnli", "swag"], seeds=[1, 2], data_dir=str(data))
    out = finetune(cfg, checkpoint=tiny_checkpoint, output=str(tmp_path / "o"))
    from bert_core import storage

    index = storage.read_manifest(out)
    assert index["counts"] == {"checkpoints": 1, "tasks": 2, "jobs": 4, "succeeded": 2, "failed": 2}
    assert {(f["task"], f["seed"]) for f in index["failures"]} == {("swag", 1), ("swag", 2)}
    ckpt = Path(tiny_checkpoint).name
    # the task folder records the version the pipeline would look for
    from flows.versions import checkpoint_identity, finetune_version

    wnli = storage.read_manifest(f"{out}/wnli")
    assert wnli["version"] == finetune_version(cfg, "wnli", checkpoint_identity(tiny_checkpoint, cfg.storage_root))

    from prefect_server import latest_artifacts

    rows = latest_artifacts()["finetune-results"]
    wnli = [r for r in rows if r["task"] == "wnli"]
    assert len(wnli) == 1 and wnli[0]["selected"] == "✓" and wnli[0]["dev per seed (0-100)"].count(":") == 2
    assert "±" in wnli[0]["dev mean ± sd (0-100)"] and wnli[0]["final split"] == "dev (also used for selection)"
    assert any(r["task"] == "swag" and r["failed seeds"] == "1,2" for r in rows)

    jobs = {f"finetune-{t}-{ckpt}-{SETTING}-seed{s}" for t in ("wnli", "swag") for s in (1, 2)}
    with get_client(sync_client=True) as client:
        names = {t.name for t in client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=sorted(jobs))))}
        flow_runs = {r.name for r in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"finetune-wnli+swag-{ckpt}"])))}
    assert jobs <= names
    assert flow_runs == {f"finetune-wnli+swag-{ckpt}"}


def test_conlleval_reads_our_prediction_format():
    rows = conlleval.rows_from_lines(["EU B-ORG B-ORG", "rejects O O", "", "Peter B-PER I-PER"], " ")
    assert conlleval.summarize(conlleval.count_chunks(rows))["f1"] == 100.0


def test_checkpoint_data_and_output_through_fsspec(tiny_checkpoint, tmp_path):
    """Object-store style URIs (memory:// here, gs:// in production) for checkpoint, data and output."""
    from bert_core import storage

    for f in Path(tiny_checkpoint).iterdir():
        with storage.open_file(f"memory://ft-ckpt/{f.name}", "wb") as out:
            out.write(f.read_bytes())
    for f in (FIXTURES / "WNLI").iterdir():
        storage.write_text(f"memory://ft-data/WNLI/{f.name}", f.read_text())
    m = run_job("wnli", "memory://ft-data", "memory://ft-ckpt", FinetuneConfig(**TINY), 2, "memory://ft-out")
    saved = json.loads(storage.read_text(f"memory://ft-out/wnli/{SETTING}/seed=2/metrics.json"))
    assert saved["main"] == m["main"] and saved["checkpoint"] == "memory://ft-ckpt"
    assert storage.exists(f"memory://ft-out/wnli/{SETTING}/seed=2/dev_predictions.tsv")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_and_batches_on_the_resolved_device(precision, tiny_checkpoint, tmp_path):
    """accelerator=cpu runs the GPU's code path: the device from bert_core.device, the model and
    every batch moved there, outputs read back with .cpu(); bf16 runs the forward under autocast."""
    import torch

    from bert_core.device import resolve_device

    device = resolve_device("cpu", 0)
    seen: list[tuple[torch.device, torch.dtype]] = []

    def record(module, args, output):
        if isinstance(output, torch.Tensor) and isinstance(module, torch.nn.Linear):
            seen.append((args[0].device, output.dtype))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        cfg = FinetuneConfig(**TINY, accelerator="cpu", precision=precision)
        m = run_job("rte", str(FIXTURES), tiny_checkpoint, cfg, seed=1, output=str(tmp_path))
    finally:
        handle.remove()
    assert m["train"]["device"] == str(device) and m["train"]["precision"] == precision
    assert m["train"]["examples_per_second"] > 0 and m["main"] == m["main"]
    assert seen and {d for d, _ in seen} == {device}
    assert {t for _, t in seen} == {torch.bfloat16 if precision == "bf16" else torch.float32}


def test_gpu_job_without_cuda_fails_with_one_line(tiny_checkpoint, tmp_path):
    import torch

    from bert_core.config import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as err:
        run_job("rte", str(FIXTURES), tiny_checkpoint, FinetuneConfig(**TINY, accelerator="gpu"), seed=1,
                output=str(tmp_path))
    assert "\n" not in str(err.value) and "accelerator" in str(err.value)
