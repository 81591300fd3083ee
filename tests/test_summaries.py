"""The summaries a person reads at the end of a stage and from `bertpipe stats`: tables with
rounded numbers, no Python reprs, no raw Markdown, and dynamic masking named as such; on real
stage folders made from the sample book."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from beam_jobs import clean_corpus, create_instances
from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec
from flows.cli.main import app
from flows.cli.manifests import number, plain_markdown

REPR = re.compile(r"\{'|': |\d\.\d{7,}")  # a dict's repr, or a float printed in full


@pytest.fixture(scope="module")
def folders(samples_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("summaries")
    corpus = str(tmp / "corpus")
    clean_corpus.run(CorpusConfig(books=[str(samples_dir / "books" / "*.txt")], dedup_near=False), corpus, workers=1)
    return tmp, corpus


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_vocab_prints_a_plain_summary_and_stats_prints_tables(folders):
    tmp, corpus = folders
    vocab = str(tmp / "vocab")
    out = _run("vocab", "--corpus", corpus, "--output", vocab, "--vocab-size", "400", "--set", "workers=1")
    assert "**" not in out and "|---" not in out and not any(line.startswith("#") for line in out.splitlines())
    assert "Vocab at" in out and "UNK rate" in out
    stats = _run("stats", corpus)
    assert not REPR.search(stats), stats
    assert re.search(r"^  documents +[\d,]+$", stats, re.M), stats


@pytest.mark.parametrize("masking", ["static", "dynamic"])
def test_instances_name_dynamic_masking_and_round_their_numbers(folders, masking):
    tmp, corpus = folders
    vocab = str(tmp / "vocab")
    if not (tmp / "vocab" / "_MANIFEST.json").exists():
        _run("vocab", "--corpus", corpus, "--output", vocab, "--vocab-size", "400", "--set", "workers=1")
    out = str(tmp / f"instances-{masking}")
    create_instances.run(InstanceConfig(lengths=[SequenceSpec(max_seq_length=32, max_predictions_per_seq=4)],
                                        dupe_factor=1, num_shards=1, seed=1, masking=masking),
                         corpus, vocab, out, workers=1, min_docs_per_bucket=2)
    stats = _run("stats", out)
    assert not REPR.search(stats), stats
    if masking == "dynamic":
        assert "masking" in stats and "dynamic: the loader masks" in stats and "masked_fraction" not in stats
    else:
        assert re.search(r"^  masked_fraction +0\.\d{1,4}$", stats, re.M), stats


def test_numbers_and_markdown_read_as_text():
    assert (number(4.797745773324984), number(1234567), number(0.1500001)) == ("4.798", "1,234,567", "0.15")
    assert number({"kept": 39, "rejected": {"too_short": 2}}) == "kept 39, rejected (too_short 2)"
    text = plain_markdown("## Vocab\n\n- **size**: 10 `tokens`\n\n| rank | token |\n|---:|---|\n| 1 | `the` |")
    assert text.splitlines() == ["Vocab", "", "- size: 10 tokens", "", "  rank  token", "  1     the"]
