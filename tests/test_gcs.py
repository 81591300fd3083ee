"""gs:// through a real GCS emulator (gcp-storage-emulator) on 127.0.0.1: the storage seam, manifests,
and pipeline stages writing to a bucket."""

from __future__ import annotations

import os
import socket

import pytest

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
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST",)}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
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


def test_corpus_and_vocab_stages_write_to_the_bucket(gcs, samples_dir):
    """The real Beam corpus and vocab stages, reading a local book and writing gs://."""
    import pyarrow.parquet as pq

    from beam_jobs.build_vocab import build_vocab
    from beam_jobs.clean_corpus import clean
    from bert_core import storage
    from bert_core.config import CorpusConfig, VocabConfig
    from bert_core.tokenization import load_vocab_dir

    corpus = storage.join(gcs, "corpus", "v1")
    manifest = clean(CorpusConfig(books=[str(samples_dir / "books" / "botchan.txt")]), corpus)
    assert manifest["uri"] == corpus
    docs = 0
    for shard in storage.shard_uris(corpus):
        with storage.open_file(shard, "rb") as f:
            table = pq.read_table(f)
        assert table.column_names[:4] == ["doc_id", "source", "title", "sentences"]
        docs += table.num_rows
    assert docs == manifest["counts"]["books"]["kept"] >= 1

    vocab = storage.join(gcs, "vocab", "v1")
    build_vocab(corpus, vocab, VocabConfig(vocab_size=600, min_frequency=2, num_unused=0))
    tokenizer = load_vocab_dir(vocab)
    assert tokenizer.vocab_size == 600
    assert storage.read_manifest(vocab)["inputs"][0]["uri"] == corpus
