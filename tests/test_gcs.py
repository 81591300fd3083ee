"""gs:// through a real GCS emulator (gcp-storage-emulator) on 127.0.0.1: the storage seam, manifests,
pipeline stages writing to a bucket, and the whole bert_pipeline with ``storage_root: gs://...``
(pre-training's run folder on a local ``runs_root``, its export copied to the bucket)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from bert_core.config import ConfigError, load_config

# The whole pipeline runs once per test process (conftest's pipeline_run): with pytest-xdist
# every module that reads it runs on the same worker.
pytestmark = pytest.mark.xdist_group("pipeline")

# gcsfs picks its implementation when imported; the emulator speaks only the classic JSON API.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

BUCKET = "bertpipe-test"


def _no_move_to(req, res, storage) -> None:
    """The emulator lacks GCS's objects.moveTo; answer like a bucket without it (400, not 501),
    so gcsfs falls back to copy + delete at once instead of retrying a 5xx for half a minute."""
    from http import HTTPStatus

    res.status = HTTPStatus.BAD_REQUEST
    res.json({"error": {"code": 400, "message": "moveTo is not supported by gcp-storage-emulator"}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs():
    """An in-memory emulator with one bucket; gs:// filesystems are rebuilt to point at it."""
    import fsspec
    import gcsfs.core
    from gcp_storage_emulator import server as emulator

    from bert_core import storage

    port = _free_port()
    handlers = emulator.HANDLERS
    move_to = r"^(/storage/v1)?/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest>.+)$"
    emulator.HANDLERS = ((move_to, {"POST": _no_move_to}), *handlers)
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "FSSPEC_GS_TOKEN")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["FSSPEC_GS_TOKEN"] = "anon"  # the same for Beam workers and DeepSpeed ranks
    fsspec.register_implementation("gs", gcsfs.core.GCSFileSystem, clobber=True)
    # No credential lookup (it would wait for a metadata server that is not there).
    saved_conf = fsspec.config.conf.get("gs")
    fsspec.config.conf["gs"] = {**(saved_conf or {}), "token": "anon"}
    storage._FILESYSTEMS.clear()
    try:
        yield f"gs://{BUCKET}"
    finally:
        storage._FILESYSTEMS.clear()
        if saved_conf is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved_conf
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        emulator.HANDLERS = handlers


def test_storage_round_trip_and_manifest(gcs):
    from bert_core import storage

    root = storage.join(gcs, "roundtrip")
    shard = storage.join(root, "part-00000-of-00001.txt")
    storage.write_text(shard, "hello gcs\n")
    assert storage.read_text(shard) == "hello gcs\n" and storage.exists(shard)
    assert storage.list_files(root) == [shard]
    assert storage.glob(storage.join(root, "*.txt")) == [shard]
    with pytest.raises(storage.UnfinishedWriteError, match="unfinished write"):
        storage.read_manifest(root)
    entry = storage.shard_entry(shard, count=1)
    assert entry["bytes"] == 10
    storage.write_manifest(root, stage="test", config={"a": 1}, shards=[entry], counts={"read": 1})
    m = storage.read_manifest(root)
    assert m["uri"] == root and m["counts"] == {"read": 1} and storage.shard_uris(root, m) == [shard]
    # the manifest is written last, and no temporary object is left in the bucket
    assert [u.rsplit("/", 1)[-1] for u in storage.list_files(root)] == [
        "_MANIFEST.json", "part-00000-of-00001.txt"]


def test_data_stages_write_to_the_bucket(gcs, samples_dir):
    """The real Beam corpus, vocab and instances stages, reading a local book and writing gs://."""
    import pyarrow.parquet as pq

    from beam_jobs import build_vocab, clean_corpus, create_instances
    from bert_core import storage
    from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec, VocabConfig
    from bert_core.vocab.tokenization import load_tokenizer

    corpus = storage.join(gcs, "corpus", "v1")
    manifest = clean_corpus.run(CorpusConfig(books=[str(samples_dir / "books" / "botchan.txt")]), corpus)
    assert manifest["uri"] == corpus
    docs = 0
    for shard in storage.shard_uris(corpus):
        with storage.open_file(shard, "rb") as f:
            table = pq.read_table(f)
        assert table.column_names[:4] == ["doc_id", "source", "title", "sentences"]
        docs += table.num_rows
    assert docs == manifest["counts"]["books"]["kept"] >= 1

    vocab = storage.join(gcs, "vocab", "v1")
    build_vocab.run(VocabConfig(vocab_size=600, min_frequency=2, num_unused=0), corpus, vocab)
    tokenizer = load_tokenizer(vocab)
    assert tokenizer.vocab_size == 600
    assert storage.read_manifest(vocab)["inputs"][0]["uri"] == corpus

    # instances on two worker processes: what they wrote under the attempt's names moves into place
    instances = storage.join(gcs, "instances", "v1")
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                            dupe_factor=1, num_shards=2, shard_multiple_of=1)
    made = create_instances.run(config, corpus, vocab, instances, workers=2)
    assert storage.read_manifest(instances)["counts"] == made["counts"]
    seq64 = storage.read_manifest(storage.join(instances, "seq64"))
    assert seq64["counts"]["instances"] > 0
    storage.check_shards(storage.join(instances, "seq64"), seq64, checksums=True)
    assert not storage.filesystem(instances).glob(storage.split_protocol(instances)[1] + "/_attempt-*")


def test_pipeline_refuses_a_bucket_run_folder_before_any_work(gcs, tmp_path):
    from bert_core.preflight import runs_base

    with pytest.raises(ConfigError, match="runs_root"):
        runs_base(load_config("demo", sets=[f"storage_root={gcs}/refused"]))
    with pytest.raises(ConfigError, match="runs_root=gs://"):
        load_config("demo", sets=[f"runs_root={gcs}/runs"])
    assert runs_base(load_config("demo", sets=[f"storage_root={gcs}/x", f"runs_root={tmp_path}"])) == str(tmp_path)


@pytest.mark.slow
def test_whole_pipeline_on_the_bucket_makes_what_the_local_run_makes(gcs, pipeline_run, samples_dir,
                                                                      make_pipeline_config, tmp_path):
    """bert_pipeline with storage_root gs:// and the local run's settings: Beam stages on 2 worker
    processes, DeepSpeed ranks reading instances from the bucket, the model copied there and
    fine-tuned from it. Each data stage writes the bytes the local run wrote; a second run finds
    every manifest in the bucket and skips everything."""

    from bert_core import storage
    from flows.pipeline import SKIPPED, bert_pipeline

    root, runs = f"{gcs}/pipeline", tmp_path / "runs"
    # the local run's settings; one checkpoint fine-tuned, the local run covers the other two
    cfg = make_pipeline_config(samples_dir, root, f"runs_root={runs}", "finetune.extra_checkpoints=[]",
                          "finetune.random_init_baseline=false")
    assert cfg.workers == 2
    first = bert_pipeline(cfg)
    second = bert_pipeline(cfg)

    stages, local = first["stages"], pipeline_run.first["stages"]
    assert {s: v["status"] for s, v in stages.items()} == {
        "corpus": "completed", "vocab": "completed", "instances": "completed", "pretrain": "completed",
        "model": "completed", "finetune": "completed"}
    for stage in ("corpus", "vocab", "instances", "model"):
        out = stages[stage]["output"]
        assert out.startswith(f"{root}/{stage if stage != 'model' else 'models'}/"), out
        manifest = storage.read_manifest(out)
        assert manifest["stage"] == stage and manifest["uri"] == out
        assert all(storage.exists(u) for u in storage.shard_uris(out, manifest))
    # the bucket holds the documents, vocab and instances the local run wrote, byte for byte
    for stage in ("corpus", "vocab", "instances"):
        ours, theirs = (storage.read_manifest(s[stage]["output"]) for s in (stages, local))
        assert ours["counts"] == theirs["counts"], stage
        assert [(s["path"], s["sha256"]) for s in ours["shards"]] == [
            (s["path"], s["sha256"]) for s in theirs["shards"]], stage
    for seq in ("seq64", "seq512"):
        ours, theirs = (storage.read_manifest(f"{s['instances']['output']}/{seq}") for s in (stages, local))
        assert [s["sha256"] for s in ours["shards"]] == [s["sha256"] for s in theirs["shards"]], seq
        counts = [s["count"] for s in ours["shards"]]
        assert len(counts) == 2 and max(counts) - min(counts) <= 1 and sum(counts) > 0
    # DeepSpeed's run folder is local and trains on those instances as the local run did
    run = stages["pretrain"]["output"]
    ours, theirs = (storage.read_manifest(r) for r in (run, local["pretrain"]["output"]))
    assert run.startswith(str(runs)) and ours["counts"] == theirs["counts"]
    assert ours["stats"]["first_loss"] == pytest.approx(theirs["stats"]["first_loss"], rel=1e-3)
    # the model in the bucket is its export, byte for byte
    model = storage.read_manifest(stages["model"]["output"])
    # (the model card, README.md, is rewritten by the registry as scores come in: no shard of it)
    exported = {Path(p).name: storage.sha256(str(p)) for p in Path(run, "hf").iterdir()
                if p.is_file() and p.name != "README.md"}
    assert {s["path"]: s["sha256"] for s in model["shards"]} == exported
    [job] = first["finetune_jobs"]
    assert job["status"] == "completed" and job["output"].startswith(f"{root}/finetune/")
    ft = storage.read_manifest(job["output"])
    assert ft["config"]["tasks"] == ["sentiment"] and stages["model"]["output"] in json.dumps(ft)
    ours = ft["stats"]["summary"]["sentiment"]
    theirs = storage.read_manifest(pipeline_run.first["finetune_jobs"][0]["output"])["stats"]["summary"]["sentiment"]
    assert ours["final"]["n"] == theirs["final"]["n"] == 1 and 0 <= ours["final"]["mean"] <= 100
    # the second run resumes from the bucket's manifests: nothing is redone
    assert {v["status"] for v in second["stages"].values()} == {SKIPPED}
    assert [j["status"] for j in second["finetune_jobs"]] == [SKIPPED]
