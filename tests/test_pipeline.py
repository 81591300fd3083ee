"""bert_pipeline end to end on a real Prefect server: every stage runs, a second run skips them all,
and the artifacts say what happened."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from prefect_server import pipeline_artifact, pipeline_flow_runs

from bert_core.config import load_config

# The whole pipeline runs once per test process (conftest's pipeline_run): with pytest-xdist
# every module that reads it runs on the same worker.
pytestmark = pytest.mark.xdist_group("pipeline")

STAGE_FLOWS = {"corpus": 1, "vocab": 1, "instances": 1, "pretrain": 1, "finetune": 3}


def test_version_folders_are_pinned():
    """The same config on the same inputs lands in the same folder: these names are what stored
    stages are found by, so a change here re-runs every stage of every existing storage root."""
    from bert_core import storage
    from flows import versions

    root = "memory://pin"  # part of every identity, so part of the pinned names
    storage.write_text(f"{root}/raw/books/a.txt", "One sentence here. Another one there.\n")
    cfg = load_config("demo", sets=[f"storage_root={root}", "corpus.wikipedia=[]", "corpus.text=[]",
                                    f"corpus.books=[{root}/raw/books/*.txt]"])

    def finished(folder: str, stage: str) -> str:
        storage.write_text(storage.join(folder, "part-0"), stage)
        storage.write_manifest(folder, stage=stage, config={}, inputs=[],
                               shards=[storage.shard_entry(storage.join(folder, "part-0"))])
        assert versions.is_done(folder)
        return folder

    corpus = versions.corpus_folder(cfg)
    assert not versions.is_done(corpus)
    finished(corpus, "corpus")
    vocab = finished(versions.vocab_folder(cfg, corpus), "vocab")
    instances = finished(versions.instances_folder(cfg, corpus, vocab), "instances")
    version = versions.pretrain_version(cfg, instances, vocab)
    run = finished(storage.join(root, "runs", "pretrain", version), "pretrain")
    checkpoint = versions.checkpoint_identity(storage.join(run, "hf"), root)
    finetune = {t: versions.finetune_version(cfg, t, checkpoint) for t in ("sentiment", "squad", "ner")}
    assert [corpus, vocab, instances] == [f"{root}/corpus/43c8ea87d3aa", f"{root}/vocab/cdda87d05cf4",
                                          f"{root}/instances/b999c24aeb8c"]
    assert version == "9a6e3f30a8e9"
    assert finetune == {"sentiment": "891bfdf2d593", "squad": "a2c1a1c7b32b", "ner": "8aed296f2d3c"}
    # a job's version is its own settings, whatever else the fan-out runs beside it
    alone = cfg.model_copy(deep=True)
    alone.finetune.random_init_baseline, alone.finetune.extra_checkpoints = False, []
    assert {t: versions.finetune_version(alone, t, checkpoint) for t in finetune} == finetune
    # fine-tuning folders are named for a reader; the version is in their manifest
    assert versions.finetune_folder(cfg, "minilm") == f"{root}/finetune/minilm"


def test_a_folder_of_another_version_is_redone_not_reused(prefect_api, tmp_path):
    """The one "already done" rule for folders named by what they hold (finetune/<checkpoint>/<task>):
    done only when the manifest records the wanted version; another version is removed, then redone."""
    from prefect import flow

    from bert_core import storage
    from flows.versions import SKIPPED, is_done, run_once, unwrap

    folder = str(tmp_path / "finetune" / "minilm" / "sentiment")
    calls = []

    def work(version: str, stale: bool = False):
        def write() -> None:
            calls.append(version)
            storage.write_text(f"{folder}/lr1e-4-bs16-ep1/seed=1/metrics.json", version)
            if stale:
                storage.write_text(f"{folder}/lr9e-9-bs16-ep1/seed=1/metrics.json", "old grid")
            storage.write_manifest(folder, stage="finetune", config={}, version=version)
        return write

    @flow
    def runs() -> list:
        return [unwrap(run_once("ft", folder, work("a", stale=True), version="a")),
                unwrap(run_once("ft", folder, work("a"), version="a")),
                unwrap(run_once("ft", folder, work("b"), version="b"))]

    first, again, changed = runs()
    assert [first["status"], again["status"], changed["status"]] == ["completed", SKIPPED, "completed"]
    assert calls == ["a", "b"]  # the same version is reused, another one redone
    assert is_done(folder, "b") and not is_done(folder, "a") and is_done(folder)
    assert not (tmp_path / "finetune" / "minilm" / "sentiment" / "lr9e-9-bs16-ep1").exists()  # old results gone


def _task_runs(client, flow_run_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    # A child flow run also shows as a placeholder task run "<flow>-<uuid>"; keep our own tasks.
    return {r.name: r for r in runs if not re.search(r"-[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$", r.name)}


def _eventually(check, timeout: float = 60):
    """Task-run states reach the API through events: give the server a moment to record them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.mark.slow
def test_every_stage_lands_in_its_version_folder_and_a_second_run_skips_them(pipeline_run):
    from bert_core import storage
    from flows.pipeline import SKIPPED

    first, root = pipeline_run.first, pipeline_run.root
    assert {s: v["status"] for s, v in first["stages"].items()} == {
        "corpus": "completed", "vocab": "completed", "instances": "completed",
        "pretrain": "completed", "random-init": "completed", "finetune": "completed"}
    # each stage landed in <root>/<stage>/<version> with its manifest
    for stage in ("corpus", "vocab", "instances", "pretrain"):
        out = first["stages"][stage]["output"]
        assert out.startswith(storage.join(str(root), stage) + "/")
        assert storage.read_manifest(out)["stage"] == stage
    assert {v["status"] for v in pipeline_run.second["stages"].values()} == {SKIPPED}


@pytest.mark.slow
def test_finetune_folders_are_named_by_checkpoint_and_task_and_indexed(pipeline_run):
    from typer.testing import CliRunner

    from bert_core import storage
    from flows.cli.main import app

    first = pipeline_run.first
    assert [(j["checkpoint"], j["status"]) for j in first["finetune_jobs"]] == [
        ("pretrained", "completed"), ("random-init", "completed"), ("minilm", "completed")]
    finetune = pipeline_run.root / "finetune"
    for j in first["finetune_jobs"]:
        assert j["output"] == str(finetune / j["checkpoint"] / "sentiment")
        manifest = storage.read_manifest(j["output"])
        assert manifest["checkpoint_name"] == j["checkpoint"] and manifest["version"]
        selected = manifest["stats"]["summary"]["sentiment"]["selected"]
        assert (Path(j["output"]) / selected / "seed=1" / "metrics.json").exists()
    # each checkpoint at its own grid: the preset's for the tiny models, by_checkpoint's for MiniLM
    grids = {j["checkpoint"]: sorted(storage.read_manifest(j["output"])["stats"]["grid"]["sentiment"])
             for j in first["finetune_jobs"]}
    assert grids == {"pretrained": ["lr1e-3-bs16-ep1", "lr3e-4-bs16-ep1"],
                     "random-init": ["lr1e-3-bs16-ep1", "lr3e-4-bs16-ep1"], "minilm": ["lr5e-5-bs16-ep1"]}
    index = storage.read_manifest(str(finetune))
    assert index["stage"] == "finetune-index" and list(index["stats"]) == [
        "minilm/sentiment", "pretrained/sentiment", "random-init/sentiment"]
    shown = CliRunner().invoke(app, ["stats", str(finetune)])
    assert shown.exit_code == 0 and "checkpoints 3, tasks 3" in shown.output, shown.output
    assert {line.split()[0] for line in shown.output.splitlines()[3:6]} == {
        "minilm", "pretrained", "random-init"}
    assert [j["status"] for j in pipeline_run.second["finetune_jobs"]] == ["skipped (cached)"] * 3


@pytest.mark.slow
def test_prefect_records_every_run_by_what_it_is(pipeline_run):
    from prefect.client.orchestration import get_client

    from flows.pipeline import SKIPPED

    stages = pipeline_run.first["stages"]
    with get_client(sync_client=True) as client:
        def check_runs():
            runs = pipeline_flow_runs(client, pipeline_run.tag)
            counts = Counter(name for name, _ in runs)
            # the stage flows ran once (first run); the second pipeline run started none
            assert counts == {"bert-pipeline": 2, **STAGE_FLOWS}, counts
            assert all(r.state.is_completed() for _, r in runs)
            pipelines = sorted((r for n, r in runs if n == "bert-pipeline"), key=lambda r: r.expected_start_time)
            # named by the config and the start; each stage by the folder it wrote
            assert all(re.fullmatch(r"demo-\d{4}-\d\d-\d\d-\d{4}", r.name) for r in pipelines), pipelines
            for stage in ("corpus", "vocab", "instances", "pretrain"):
                (run,) = [r for n, r in runs if n == stage]
                assert stages[stage]["output"].endswith("/" + run.name) and run.name.startswith(f"{stage}/")
            assert {r.name for n, r in runs if n == "finetune"} == {
                "finetune-sentiment-pretrained", "finetune-sentiment-random-init", "finetune-sentiment-minilm"}
            tasks1, tasks2 = (_task_runs(client, r.id) for r in pipelines)
            expected = {"corpus", "vocab", "instances", "pretrain", "random-init-model",
                        "finetune-sentiment-pretrained", "finetune-sentiment-random-init",
                        "finetune-sentiment-minilm"}
            assert set(tasks1) == expected and set(tasks2) == expected
            assert {t.state.name for t in tasks1.values()} == {"Completed"}
            assert {t.state.name for t in tasks2.values()} == {"Cached"}
            assert all(SKIPPED in t.state.message for t in tasks2.values())
        _eventually(check_runs)


@pytest.mark.slow
def test_artifacts_say_what_happened_on_one_scale(pipeline_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.pipeline import SKIPPED

    tag = pipeline_run.tag
    with get_client(sync_client=True) as client:
        stages = pipeline_artifact(client, tag, "pipeline-stages")
        assert {r["stage"]: r["status"] for r in stages} == {
            s: SKIPPED for s in ("corpus", "vocab", "instances", "pretrain", "random-init", "finetune")}
        results = pipeline_artifact(client, tag, "pipeline-finetune-results")
        main = {r["checkpoint"]: r for r in results if r["metric"].endswith("(main)")}
        assert set(main) == {"pretrained", "random-init", "minilm"}
        # every score on the 0-100 scale, to one decimal (sentiment accuracy: over a half here)
        scores = [r[k] for r in results if "mean" in r for k in ("mean", "sd")]
        assert scores and all(0 <= v <= 100 and round(v, 1) == v for v in scores), results
        assert all(r["mean"] > 1 and r["n"] == 1 for r in main.values()), main
        report = pipeline_artifact(client, tag, "pipeline-report")
        assert report.count("](data:image/png;base64,") == 4  # loss, accuracy, 2 length histograms
        assert "## Fine-tuning" in report and "minilm" in report
        # the demo trains the masked LM only: no next-sentence curve or title anywhere
        assert not pipeline_run.config.instances.next_sentence_prediction
        pretrain_report = pipeline_artifact(client, tag, "pretrain-report", parsed=False)
        assert pretrain_report.description == "Pre-training (MLM) loss and accuracy"
        words = re.sub(r"\(data:image/png;base64,[^)]*\)", "", pretrain_report.data)
        assert "![accuracy]" in words and "nsp" not in words.lower()
        counts = pipeline_artifact(client, tag, "corpus-counts")
        kept = sum(r["records"] for r in counts if r["what"] == "kept")
        read = sum(r["records"] for r in counts if r["what"] == "read")
        assert 0 < kept <= read
        metrics = pipeline_artifact(client, tag, "pretrain-metrics")
        assert [r["step"] for r in metrics if r["phase"] == 1][-1] == 4
        assert all(r["loss"] > 0 for r in metrics) and not any("nsp_acc" in r for r in metrics)
        (progress, *_) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pretrain-progress"])))
        assert float(progress.data) == 100.0
        assert "random_next" not in json.dumps(pipeline_artifact(client, tag, "instances-stats"))
        for key in ("vocab-report", "finetune-results"):
            assert pipeline_artifact(client, tag, key)
