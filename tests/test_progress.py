"""Progress of the long stages: the Beam stages on the sample with two worker processes (and on
a Dask cluster) count up to their inputs, a run whose output is not a terminal prints no
progress, fine-tuning counts its jobs and steps, and a stage flow's progress artifact ends at
100%."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from beam_jobs import build_vocab, clean_corpus, create_instances
from bert_core import storage
from bert_core.config import CorpusConfig, FinetuneConfig, ModelConfig, load_config
from bert_core.progress import Meter, Update

SAMPLE_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"
FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


def inputs(samples_dir: Path) -> CorpusConfig:
    return CorpusConfig(wikipedia=[str(samples_dir / SAMPLE_DUMP)], books=[str(samples_dir / "books" / "*.txt")],
                        text=[str(samples_dir / "text" / "tweets.jsonl")])


def input_bytes(cfg: CorpusConfig) -> int:
    return sum(storage.size(f) for pattern in (*cfg.wikipedia, *cfg.books, *cfg.text) for f in storage.glob(pattern))


def phases(updates: list[Update]) -> dict[str, list[Update]]:
    by_phase: dict[str, list[Update]] = {}
    for u in updates:
        by_phase.setdefault(u.phase, []).append(u)
    return by_phase


def assert_counts_up(updates: list[Update], total: int | None) -> None:
    """Never backwards, and the last count is ``total`` (the phase's own, when it has one)."""
    done = [u.done for u in updates]
    assert done == sorted(done), done
    assert done[-1] == total and all(u.total in (None, total) for u in updates)


@pytest.fixture(scope="module")
def corpus_run(samples_dir, tmp_path_factory) -> tuple[str, list[Update], int]:
    cfg = inputs(samples_dir)
    out = str(tmp_path_factory.mktemp("corpus"))
    updates: list[Update] = []
    clean_corpus.run(cfg, out, workers=2, bytes_per_worker=0, on_progress=updates.append)
    return out, updates, input_bytes(cfg)


def test_corpus_counts_every_byte_of_its_inputs_on_two_workers(corpus_run) -> None:
    out, updates, total = corpus_run
    assert {u.phase for u in updates} == {"reading inputs"}
    assert_counts_up(updates, total)
    manifest = storage.read_manifest(out)
    read = sum(c["read"] for c in manifest["counts"].values() if isinstance(c, dict))
    assert updates[-1].extra["records"] == read
    assert not os.path.exists(os.path.join(out, "_progress"))  # the counts go with the run


def test_vocab_and_instances_count_the_corpus_documents(corpus_run, tmp_path) -> None:
    corpus, _, _ = corpus_run
    documents = storage.read_manifest(corpus)["counts"]["documents"]
    cfg = load_config("demo")
    updates: list[Update] = []
    manifest = build_vocab.run(cfg.vocab, corpus, str(tmp_path / "vocab"), workers=2, on_progress=updates.append)
    steps = phases(updates)
    assert list(steps) == ["counting words", "training WordPiece", "measuring the vocab"]
    assert_counts_up(steps["counting words"], documents)
    # the trainer reads the words it is given twice: its alphabet, then the training
    assert_counts_up(steps["training WordPiece"], 2 * manifest["counts"]["distinct_words_trained"])

    updates.clear()
    create_instances.run(cfg.instances, corpus, str(tmp_path / "vocab"), str(tmp_path / "instances"), workers=2,
                         on_progress=updates.append)
    steps = phases(updates)
    assert list(steps) == ["reading documents", "creating instances", "writing shards"]
    assert_counts_up(steps["reading documents"], documents)
    assert steps["writing shards"][-1].done == len(list((tmp_path / "instances").glob("seq*/**/*.parquet")))
    assert not (tmp_path / "instances" / "_progress").exists() and not (tmp_path / "vocab" / "_progress").exists()


def test_corpus_counts_every_byte_on_a_dask_cluster(samples_dir, tmp_path) -> None:
    from dask.distributed import LocalCluster

    cfg = inputs(samples_dir)
    updates: list[Update] = []
    # worker processes, as a real cluster has: an in-process cluster started after another one in
    # the same process sometimes runs a bundle twice or not at all, and the job's own count check
    # then stops it (kept + rejected != read)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        clean_corpus.run(cfg, str(tmp_path / "out"), runner="dask", shared_storage=True,
                         beam_args=[f"--dask_client_address={cluster.scheduler_address}"],
                         on_progress=updates.append)
    assert_counts_up(updates, input_bytes(cfg))


def test_a_run_whose_output_is_no_terminal_prints_no_progress(samples_dir, tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "flows.cli", "corpus", "--books", str(samples_dir / "books" / "*.txt"),
                          "--output", str(tmp_path / "out"), "--workers", "1"],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                         env={**os.environ, "TERM": "xterm", "COLUMNS": "120"}, timeout=300)
    assert run.returncode == 0, run.stderr
    printed = run.stdout + run.stderr
    assert "corpus at" in printed  # the summary
    for noise in ("reading inputs", "ETA", "MB/s", "\r", "\x1b["):
        assert noise not in printed, (noise, printed)
    assert not (tmp_path / "out" / "_progress").exists()


def test_the_meter_says_rate_and_eta() -> None:
    meter = Meter()
    first = Update("corpus", "reading inputs", 0, 4 << 20, "bytes")
    assert meter.describe(first, now=0.0) == "corpus, reading inputs: 0 B of 4.0 MB (0%)"
    later = Update("corpus", "reading inputs", 1 << 20, 4 << 20, "bytes", {"records": 1200})
    assert meter.describe(later, now=2.0) == ("corpus, reading inputs: 1.0 MB of 4.0 MB (25%), 1,200 records, "
                                              "512.0 kB/s, ETA 0:00:06")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, samples_dir) -> str:
    import torch

    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import save_pretrained

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-bert")
    model = BertModel(ModelConfig(size="tiny", vocab_size=30522, max_position_embeddings=128))
    save_pretrained(model, str(out), vocab_file=str(samples_dir / "models" / "minilm" / "vocab.txt"))
    return str(out)


def test_finetuning_counts_its_jobs_and_each_jobs_steps(tiny_checkpoint, tmp_path) -> None:
    from bert_core.finetune.report import run_many

    cfg = FinetuneConfig(num_train_epochs=1, batch_size=8, max_seq_length=64, learning_rate=1e-4, threads=1)
    updates: list[Update] = []
    run_many(["mrpc"], [1, 2], str(FIXTURES), tiny_checkpoint, cfg, str(tmp_path / "o"), on_progress=updates.append)
    steps = phases(updates)
    assert [u.done for u in steps["jobs"]] == [0, 1, 2] and {u.total for u in steps["jobs"]} == {2}
    jobs = [p for p in steps if p != "jobs"]
    assert jobs == ["mrpc lr1e-4-bs8-ep1 seed=1", "mrpc lr1e-4-bs8-ep1 seed=2"]
    for job in jobs:
        assert_counts_up(steps[job], steps[job][0].total)
        assert [u.done for u in steps[job]] == list(range(1, steps[job][0].total + 1))


@pytest.mark.slow
def test_a_stage_flows_progress_artifact_ends_at_100(prefect_api, samples_dir, tmp_path) -> None:
    from prefect_server import latest_artifacts

    from flows.corpus import clean_corpus as corpus_flow

    books = str(samples_dir / "books" / "*.txt")
    config = load_config("demo", sets=["workers=1", "corpus.wikipedia=[]", f"corpus.books=[{books}]", "corpus.text=[]"])
    assert corpus_flow(config, str(tmp_path / "corpus")) == str(tmp_path / "corpus")
    assert latest_artifacts()["corpus-progress"] == 100.0


@pytest.mark.slow
def test_the_finetune_flows_progress_artifact_counts_its_jobs_to_100(prefect_api, tiny_checkpoint, tmp_path) -> None:
    from prefect_server import latest_artifacts

    from flows.finetune import finetune

    config = load_config("demo")
    config.finetune = FinetuneConfig(num_train_epochs=1, batch_size=8, max_seq_length=64, learning_rate=1e-4,
                                     threads=1, tasks=["mrpc"], seeds=[1, 2], data_dir=str(FIXTURES))
    finetune(config, checkpoint=tiny_checkpoint, output=str(tmp_path / "o"))
    assert latest_artifacts()["finetune-progress"] == 100.0
