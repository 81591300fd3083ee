"""The paper's fine-tuning protocol: a grid of settings x seeds, the best setting chosen on dev,
reported on the final (test) split; job names, folders, report.md and the artifact.

A tiny random BERT on an easy sentiment set (vaderSentiment's file format) where a learning rate
of 1e-9 learns nothing and 1e-3 learns the task: the selection has one right answer."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from bert_core import storage
from bert_core.config import VERSIONED_WHEN_SET, FinetuneConfig, ModelConfig, config_hash
from bert_core.finetune.glue import read_sentiment
from bert_core.finetune.grid import Setting, job_dir, job_name, settings
from bert_core.finetune.report import best, run_many, select, summarize

GOOD = "great wonderful excellent lovely amazing perfect happy best".split()
BAD = "awful terrible horrible worst ugly sad boring broken".split()
FILLER = "the a movie phone this it was is and very".split()
WINNER, LOSER = "lr1e-3-bs16-ep2", "lr1e-9-bs16-ep2"


@pytest.fixture(scope="module")
def sentiment_data(tmp_path_factory) -> Path:
    """300 sentences, the sign of the rating given by the sentiment words in them."""
    rng = random.Random(0)
    lines = []
    for i in range(300):
        positive = rng.random() < 0.5
        words = rng.sample(GOOD if positive else BAD, 2) + rng.sample(FILLER, 3)
        rng.shuffle(words)
        lines.append(f"{i}\t{2.0 if positive else -2.0}\t{' '.join(words)}")
    folder = tmp_path_factory.mktemp("tasks") / "sentiment"
    folder.mkdir()
    (folder / "easy_GroundTruth.txt").write_text("\n".join(lines) + "\n")
    return folder.parent


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, samples_dir) -> str:
    import torch

    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import save_pretrained

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "tiny-bert"
    model = BertModel(ModelConfig(size="tiny", vocab_size=30522, max_position_embeddings=64))
    save_pretrained(model, str(out), vocab_file=str(samples_dir / "models" / "minilm" / "vocab.txt"))
    return str(out)


def test_setting_names_and_selection_rule():
    assert Setting(3e-5, 32, 3.0).name == "lr3e-5-bs32-ep3"
    assert Setting(2e-4, 16, 1.5).name == "lr2e-4-bs16-ep1.5"
    assert job_name("sst2", "minilm", Setting(3e-5, 32, 3), 2) == "finetune-sst2-minilm-lr3e-5-bs32-ep3-seed2"
    assert len(FinetuneConfig().grid()) == 18  # the paper's grid is the default
    assert FinetuneConfig(learning_rate=1e-4).learning_rates == [1e-4]  # one value: a one-point grid

    def job(name, seed, dev, test):
        return {"task": "sentiment", "setting": {"name": name}, "seed": seed, "ok": True,
                "metrics": {"flat": {"dev/accuracy": dev, "test/accuracy": test}}}

    # b has the best single seed, a the best mean: the mean over seeds decides
    results = [job("a", 1, 0.80, 0.70), job("a", 2, 0.80, 0.72), job("b", 1, 0.95, 0.9), job("b", 2, 0.55, 0.5)]
    stats = summarize(results)
    assert select("sentiment", stats["grid"]["sentiment"]) == "a"
    final = stats["summary"]["sentiment"]["final"]
    assert final["mean"] == pytest.approx(71.0) and final["n"] == 2  # test split, 0-100
    assert stats["summary"]["sentiment"]["final_label"] == "test"


def test_pooling_and_layerwise_decay_are_grid_axes_whose_defaults_keep_names_and_versions():
    cfg = FinetuneConfig(learning_rates=[3e-4, 1e-3], batch_sizes=[32], epochs=[6], poolings=["cls", "mean"],
                         layerwise_lr_decays=[1.0, 0.8])
    assert [s.name for s in settings(cfg)] == [
        "lr3e-4-bs32-ep6", "lr3e-4-bs32-ep6-lld0.8", "lr3e-4-bs32-ep6-mean", "lr3e-4-bs32-ep6-mean-lld0.8",
        "lr1e-3-bs32-ep6", "lr1e-3-bs32-ep6-lld0.8", "lr1e-3-bs32-ep6-mean", "lr1e-3-bs32-ep6-mean-lld0.8"]
    assert len(FinetuneConfig(poolings=["cls", "mean"]).grid()) == 36
    # each job runs one point, with the version a config of those single values has
    for s in settings(cfg):
        one = s.job_config(cfg)
        assert (one.pooling, one.layerwise_lr_decay, one.poolings, one.layerwise_lr_decays) == (
            s.pooling, s.layerwise_lr_decay, None, None)
        assert Setting.of(one) == s and Setting.from_dict(s.as_dict()) == s
        assert config_hash(one) == config_hash(FinetuneConfig(
            learning_rate=s.learning_rate, batch_size=s.batch_size, num_train_epochs=s.num_train_epochs,
            pooling=s.pooling, layerwise_lr_decay=s.layerwise_lr_decay))
    # at the defaults: the names, folders and versions stored before the axes existed
    plain = Setting(3e-5, 32, 3.0)
    assert plain == Setting(3e-5, 32, 3.0, "cls", 1.0) and plain.name == "lr3e-5-bs32-ep3"
    assert job_dir("finetune/minilm", "sst2", plain, 2).endswith("finetune/minilm/sst2/lr3e-5-bs32-ep3/seed=2")
    old_row = {"learning_rate": 3e-5, "batch_size": 32, "num_train_epochs": 3.0, "name": "lr3e-5-bs32-ep3"}
    assert Setting.from_dict(old_row) == plain
    fields = FinetuneConfig.model_fields
    later = {n for n, f in fields.items() if f.json_schema_extra == VERSIONED_WHEN_SET}
    assert {"poolings", "layerwise_lr_decays"} <= later
    for ft in (FinetuneConfig(), FinetuneConfig(pooling="mean", layerwise_lr_decay=0.8)):
        assert config_hash(ft) == config_hash(ft.model_dump(mode="json", exclude=later) | {
            k: getattr(ft, k) for k in later if getattr(ft, k) != fields[k].default})
        assert settings(ft)[0].pooling == ft.pooling  # the one value is the grid's one point
    assert config_hash(FinetuneConfig(poolings=["cls", "mean"])) != config_hash(FinetuneConfig())
    # the one value or the grid, not both; the grid's values checked like the one value
    for bad, match in (({"pooling": "mean", "poolings": ["cls", "mean"]}, "both set"),
                       ({"layerwise_lr_decays": [1.0, 1.5]}, r"\(0, 1\]"),
                       ({"poolings": ["mean", "mean"]}, "distinct"), ({"poolings": ["max"]}, "poolings")):
        with pytest.raises(ValueError, match=match):
            FinetuneConfig(**bad)


def test_the_choice_on_dev_with_a_pooling_axis():
    cfg = FinetuneConfig(learning_rates=[1e-3], batch_sizes=[16], epochs=[2], poolings=["cls", "mean"])
    cls_, mean = settings(cfg)

    def job(setting, seed, dev, test):
        return {"task": "sentiment", "setting": setting.as_dict(), "seed": seed, "ok": True,
                "metrics": {"flat": {"dev/accuracy": dev, "test/accuracy": test}}}

    # the settings differ in their pooling alone: the better mean on dev wins, and is reported
    stats = summarize([job(cls_, 1, 0.70, 0.9), job(cls_, 2, 0.74, 0.9), job(mean, 1, 0.80, 0.6), job(mean, 2, 0.78, 0.62)])
    assert stats["summary"]["sentiment"]["selected"] == mean.name == "lr1e-3-bs16-ep2-mean"
    assert stats["summary"]["sentiment"]["setting"]["pooling"] == "mean"
    assert stats["summary"]["sentiment"]["final"]["mean"] == pytest.approx(61.0)
    # a tie goes to the setting first in grid order; another metric than the task's, when named
    tied = [job(cls_, 1, 0.75, 0.5), job(mean, 1, 0.75, 0.5)]
    assert select("sentiment", summarize(tied)["grid"]["sentiment"]) == cls_.name
    assert select("sentiment", summarize(tied)["grid"]["sentiment"], metric="test/accuracy") == cls_.name
    assert best({"a": 1.0, "b": 2.0, "c": 2.0}) == "b" and best({}) is None


def test_a_grid_over_pooling_runs_each_point_and_selects_on_dev(sentiment_data, tiny_checkpoint, tmp_path):
    """Real jobs: a rate that learns nothing and one that learns, each with either pooling."""
    cfg = FinetuneConfig(tasks=["sentiment"], seeds=[1], learning_rates=[1e-9, 1e-3], batch_sizes=[16], epochs=[2],
                         poolings=["cls", "mean"], max_seq_length=16, threads=1)
    out = tmp_path / "ft"
    index = run_many(["sentiment"], [1], str(sentiment_data), tiny_checkpoint, cfg, str(out))
    names = [s.name for s in settings(cfg)]
    assert names == [LOSER, f"{LOSER}-mean", WINNER, f"{WINNER}-mean"]
    manifest = storage.read_manifest(str(out / "sentiment"))
    grid = manifest["stats"]["grid"]["sentiment"]
    assert sorted(grid) == sorted(names) and manifest["counts"] == {"jobs": 4, "succeeded": 4, "failed": 0}
    for name in names:  # each job ran its own point, in a folder named by it
        metrics = json.loads((out / "sentiment" / name / "seed=1" / "metrics.json").read_text())
        assert metrics["setting"]["name"] == name
        assert metrics["setting"]["pooling"] == ("mean" if name.endswith("-mean") else "cls")
    dev = {n: grid[n]["metrics"]["dev/accuracy"]["mean"] for n in names}
    chosen = index["stats"]["sentiment"]["selected"]
    assert chosen == best(dev) and chosen.startswith(WINNER) and dev[chosen] > max(dev[LOSER], dev[f"{LOSER}-mean"]) + 0.2


def final_split_accuracy(job: Path, data: Path) -> float:
    """Accuracy recomputed from a job's test predictions against the test split's labels."""
    gold = {e.guid: e.label for e in read_sentiment(str(data / "sentiment"), "test")[0]}
    dev_ids = {e.guid for e in read_sentiment(str(data / "sentiment"), "dev")[0]}
    assert gold and not dev_ids & gold.keys()
    rows = [line.split("\t") for line in (job / "test_predictions.tsv").read_text().splitlines()[1:]]
    assert {guid for guid, _ in rows} == gold.keys()
    return sum(gold[guid] == label for guid, label in rows) / len(rows)


@pytest.mark.slow
def test_prefect_flow_runs_the_grid_and_selects_the_rate_that_learns(prefect_api, sentiment_data, tiny_checkpoint, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from bert_core.config import load_config
    from flows.finetune import finetune

    cfg = load_config("demo")
    cfg.finetune = FinetuneConfig(tasks=["sentiment"], seeds=[1, 2], data_dir=str(sentiment_data),
                                  learning_rates=[1e-9, 1e-3], batch_sizes=[16], epochs=[2],
                                  max_seq_length=16, threads=1, max_parallel_jobs=2)
    output = str(tmp_path / "finetune" / "tiny-bert")
    assert finetune(cfg, checkpoint=tiny_checkpoint, output=output) == output

    names = {f"finetune-sentiment-tiny-bert-{s}-seed{seed}" for s in (WINNER, LOSER) for seed in (1, 2)}

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(task_run_filter=TaskRunFilter(
                name=TaskRunFilterName(any_=sorted(names))))
            return {r.name for r in runs}, await client.read_latest_artifacts()

    task_runs, artifacts = asyncio.run(read())

    # names and folders say what each job is
    assert names <= task_runs
    manifest = storage.read_manifest(f"{output}/sentiment")
    assert manifest["counts"] == {"jobs": 4, "succeeded": 4, "failed": 0}
    model_files = {"config.json", "model.safetensors", "README.md", "vocab.txt", "tokenizer_config.json"}
    model_files |= {"tokenizer.json"} if (Path(tiny_checkpoint) / "tokenizer.json").exists() else set()
    assert {s["path"] for s in manifest["shards"]} == {"report.md"} | {
        f"{s}/seed={seed}/metrics.json" for s in (WINNER, LOSER) for seed in (1, 2)} | {
        f"model/{name}" for name in model_files}
    # the chosen setting's best seed on dev is published; the jobs' own models are gone
    dev_per_seed = manifest["stats"]["grid"]["sentiment"][WINNER]["metrics"]["dev/accuracy"]["values"]
    assert manifest["model"] == manifest["stats"]["model"] == {
        "setting": WINNER, "seed": int(best(dev_per_seed)), "path": "model"}
    assert not list((tmp_path / "finetune").glob("tiny-bert/sentiment/*/seed=*/model"))
    index = storage.read_manifest(output)
    assert index["stage"] == "finetune-index" and list(index["stats"]) == ["sentiment"]
    assert index["stats"]["sentiment"]["selected"] == WINNER

    # selection: the rate that learns, on dev; reported on test
    summary = manifest["stats"]["summary"]["sentiment"]
    assert summary["selected"] == WINNER and summary["final_label"] == "test"
    grid = manifest["stats"]["grid"]["sentiment"]
    assert grid[WINNER]["metrics"]["dev/accuracy"]["mean"] > grid[LOSER]["metrics"]["dev/accuracy"]["mean"] + 0.2

    # the final score is computed on the test split: recompute it from the written predictions
    test_scores = []
    for seed in (1, 2):
        job = tmp_path / "finetune" / "tiny-bert" / "sentiment" / WINNER / f"seed={seed}"
        accuracy = final_split_accuracy(job, sentiment_data)
        assert json.loads((job / "metrics.json").read_text())["flat"]["test/accuracy"] == pytest.approx(accuracy)
        test_scores.append(100 * accuracy)
    assert summary["final"]["mean"] == pytest.approx(sum(test_scores) / 2)

    # the full grid in the artifact and in report.md, the selected row marked
    table = next(a for a in artifacts if a.key == "finetune-results")
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [(r["setting"], r["selected"]) for r in rows] == [(LOSER, ""), (WINNER, "✓")]
    chosen = rows[1]
    assert chosen["final split"] == "test" and chosen["final mean ± sd (0-100)"].startswith(
        f"{summary['final']['mean']:.1f} ± ")
    assert rows[0]["final mean ± sd (0-100)"] == "" and "±" in rows[0]["dev mean ± sd (0-100)"]
    report = (tmp_path / "finetune" / "tiny-bert" / "sentiment" / "report.md").read_text()
    assert f"| sentiment | accuracy | {WINNER} | test |" in report
    assert f"| sentiment | {LOSER} |  |" in report and f"| sentiment | {WINNER} | ✓ |" in report
    assert "0-100" in report


def test_cli_grid_selection_report_and_stats(sentiment_data, tiny_checkpoint, tmp_path):
    """The same protocol in one process (one seed): selection, report.md, final split, stats."""
    from typer.testing import CliRunner

    from flows.cli.main import app

    runner = CliRunner()
    out = tmp_path / "ft"
    r = runner.invoke(app, ["finetune", "--task", "sentiment", "--data", str(sentiment_data), "--checkpoint",
                            tiny_checkpoint, "--output", str(out), "--seeds", "1", "--learning-rates",
                            "1e-9,1e-3", "--batch-sizes", "16", "--epochs", "2",
                            "--set", "finetune.threads=1", "--set", "finetune.max_seq_length=16"])
    assert r.exit_code == 0, r.output
    chosen = [line for line in r.stdout.splitlines() if "✓" in line]
    assert len(chosen) == 1 and WINNER in chosen[0] and LOSER in r.stdout
    manifest = storage.read_manifest(str(out / "sentiment"))
    summary = manifest["stats"]["summary"]["sentiment"]
    assert summary["selected"] == WINNER and summary["final_split"] == "test"
    accuracy = final_split_accuracy(out / "sentiment" / WINNER / "seed=1", sentiment_data)
    assert summary["final"]["mean"] == pytest.approx(100 * accuracy)
    dev = manifest["stats"]["grid"]["sentiment"]
    assert dev[WINNER]["metrics"]["dev/accuracy"]["mean"] > dev[LOSER]["metrics"]["dev/accuracy"]["mean"] + 0.2
    report = (out / "sentiment" / "report.md").read_text()
    assert f"| sentiment | accuracy | {WINNER} | test | {100 * accuracy:.1f} ± 0.0 (n=1) |" in report
    assert f"| sentiment | {LOSER} |  |" in report and f"| sentiment | {WINNER} | ✓ |" in report
    # the checkpoint's folder lists its tasks; a task's folder shows its whole grid
    r = runner.invoke(app, ["stats", str(out)])
    assert r.exit_code == 0, r.output
    assert "jobs 2, succeeded 2, failed 0" in r.output and "0-100" in r.output
    [row] = [line for line in r.output.splitlines() if line.startswith("tiny-bert ")]
    assert "sentiment" in row and WINNER in row and f"{100 * accuracy:.1f} ± 0.0 (n=1)" in row
    assert manifest["version"] in row
    r = runner.invoke(app, ["stats", str(out / "sentiment")])
    assert r.exit_code == 0, r.output
    assert [line for line in r.output.splitlines() if "✓" in line] == chosen
