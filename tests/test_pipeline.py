"""bert_pipeline end to end on a real Prefect server: every stage runs, a second run skips them all,
and the artifacts say what happened."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from bert_core.config import load_config

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
    checkpoint = versions.checkpoint_identity(storage.join(run, "hf"))
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


def test_a_folder_of_another_version_is_redone_not_reused(tmp_path):
    """The one "already done" rule for folders named by what they hold (finetune/<checkpoint>/<task>):
    done only when the manifest records the wanted version; another version is removed, then redone."""
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

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

    with prefect_test_harness(server_startup_timeout=120):
        first, again, changed = runs()
    assert [first["status"], again["status"], changed["status"]] == ["completed", SKIPPED, "completed"]
    assert calls == ["a", "b"]  # the same version is reused, another one redone
    assert is_done(folder, "b") and not is_done(folder, "a") and is_done(folder)
    assert not (tmp_path / "finetune" / "minilm" / "sentiment" / "lr9e-9-bs16-ep1").exists()  # old results gone


def pipeline_config(samples: Path, root: Path):
    return load_config("demo", sets=[
        f"storage_root={root}",
        "corpus.wikipedia=[]", "corpus.text=[]",
        f"corpus.books=[{samples}/books/botchan.txt]",
        "vocab.vocab_size=1000",
        "instances.dupe_factor=1",
        "instances.num_shards=2",
        "pretrain.phases=[{max_seq_length: 64, max_steps: 4, global_batch_size: 16, micro_batch_size: 8, "
        "warmup_steps: 1}, {max_seq_length: 512, max_steps: 2, global_batch_size: 4, micro_batch_size: 2, "
        "warmup_steps: 1}]",
        "pretrain.log_every=1",
        "pretrain.checkpoint_every=2",
        "finetune.tasks=[sentiment]",
        "finetune.seeds=[1]",
        f"finetune.data_dir={samples}/tasks",
        "finetune.max_train_examples=32",
        "finetune.epochs=[1]",
        f"finetune.extra_checkpoints=[{samples}/models/minilm]",
        "finetune.by_checkpoint={minilm: {learning_rates: [5.0e-5], epochs: [1], max_train_examples: 32}}",
    ])


def _flow_runs(client) -> list:
    runs = client.read_flow_runs()
    names = {f.id: f.name for f in client.read_flows()}
    return [(names[r.flow_id], r) for r in runs]


def _task_runs(client, flow_run_id) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    # A child flow run also shows as a placeholder task run "<flow>-<uuid>"; keep our own tasks.
    return {r.name: r for r in runs if not re.search(r"-[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$", r.name)}


def _artifact(client, key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                  sort=ArtifactSort.CREATED_DESC)
    assert found, f"no artifact {key!r}"
    data = found[0].data
    return json.loads(data) if found[0].type == "table" and isinstance(data, str) else data


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
def test_pipeline_runs_every_stage_then_skips_them(samples_dir, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_server import local_prefect_server

    from bert_core import storage
    from flows.pipeline import SKIPPED, bert_pipeline

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = pipeline_config(samples_dir, tmp_path / "data")
    with local_prefect_server(tmp_path / "prefect") as api, temporary_settings({PREFECT_API_URL: api}):
        first = bert_pipeline(cfg)
        assert {s: v["status"] for s, v in first["stages"].items()} == {
            "corpus": "completed", "vocab": "completed", "instances": "completed",
            "pretrain": "completed", "random-init": "completed", "finetune": "completed"}
        # each stage landed in <root>/<stage>/<version> with its manifest
        for stage in ("corpus", "vocab", "instances", "pretrain"):
            out = first["stages"][stage]["output"]
            assert out.startswith(storage.join(str(tmp_path / "data"), stage) + "/")
            assert storage.read_manifest(out)["stage"] == stage
        assert [(j["checkpoint"], j["status"]) for j in first["finetune_jobs"]] == [
            ("pretrained", "completed"), ("random-init", "completed"), ("minilm", "completed")]
        # fine-tuning folders are named by checkpoint and task; the root's index lists them all
        finetune = tmp_path / "data" / "finetune"
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
        from typer.testing import CliRunner

        from flows.cli import app

        shown = CliRunner().invoke(app, ["stats", str(finetune)])
        assert shown.exit_code == 0 and "checkpoints 3, tasks 3" in shown.output, shown.output
        assert {line.split()[0] for line in shown.output.splitlines()[3:6]} == {
            "minilm", "pretrained", "random-init"}

        second = bert_pipeline(cfg)
        assert {v["status"] for v in second["stages"].values()} == {SKIPPED}

        with get_client(sync_client=True) as client:
            def check_runs():
                runs = _flow_runs(client)
                counts = Counter(name for name, _ in runs)
                # the stage flows ran once (first run); the second pipeline run started none
                assert counts == {"bert-pipeline": 2, **STAGE_FLOWS}, counts
                pipelines = sorted((r for n, r in runs if n == "bert-pipeline"),
                                   key=lambda r: r.expected_start_time)
                assert all(r.state.is_completed() for _, r in runs)
                tasks1, tasks2 = (_task_runs(client, r.id) for r in pipelines)
                expected = {"corpus", "vocab", "instances", "pretrain", "random-init-model",
                            "finetune-sentiment-pretrained", "finetune-sentiment-random-init",
                            "finetune-sentiment-minilm"}
                assert set(tasks1) == expected and set(tasks2) == expected
                assert {t.state.name for t in tasks1.values()} == {"Completed"}
                assert {t.state.name for t in tasks2.values()} == {"Cached"}
                assert all(SKIPPED in t.state.message for t in tasks2.values())
                assert {r.name for n, r in runs if n == "finetune"} == {
                    "finetune-sentiment-pretrained", "finetune-sentiment-random-init", "finetune-sentiment-minilm"}
            _eventually(check_runs)

            stages = _artifact(client, "pipeline-stages")
            assert {r["stage"]: r["status"] for r in stages} == {
                s: SKIPPED for s in ("corpus", "vocab", "instances", "pretrain", "random-init", "finetune")}
            results = _artifact(client, "pipeline-finetune-results")
            main = {r["checkpoint"]: r for r in results if r["metric"].endswith("(main)")}
            assert set(main) == {"pretrained", "random-init", "minilm"}
            assert all(0 <= r["mean"] <= 100 and r["n"] == 1 for r in main.values())
            report = _artifact(client, "pipeline-report")
            assert report.count("](data:image/png;base64,") == 4  # loss, accuracy, 2 length histograms
            assert "## Fine-tuning" in report and "minilm" in report
            counts = _artifact(client, "corpus-counts")
            kept = sum(r["records"] for r in counts if r["what"] == "kept")
            read = sum(r["records"] for r in counts if r["what"] == "read")
            assert 0 < kept <= read
            metrics = _artifact(client, "pretrain-metrics")
            assert [r["step"] for r in metrics if r["phase"] == 1][-1] == 4
            assert all(r["loss"] > 0 for r in metrics)
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
            (progress, *_) = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pretrain-progress"])))
            assert float(progress.data) == 100.0
            for key in ("vocab-report", "instances-stats", "finetune-results", "pretrain-report"):
                assert _artifact(client, key)
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # ship the last run logs before the server stops
