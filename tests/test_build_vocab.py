"""beam_jobs/build_vocab.py (+ bert_core/vocab/wordcount.py, bert_core/vocab/training.py, flows/vocab.py,
flows/cli/vocab.py): real Beam pipelines, the real tokenizers trainer, real Parquet, on documents
made of real sample text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from beam_jobs import build_vocab
from bert_core import storage
from bert_core.config import VocabConfig
from bert_core.vocab.tokenization import Tokenizer, VocabError, load_tokenizer
from bert_core.vocab.training import special_tokens
from bert_core.vocab.wordcount import count_words

SMALL = VocabConfig(vocab_size=2000, num_unused=10)


def write_corpus(folder: Path, docs: list[dict], num_shards: int = 3) -> str:
    """A corpus stage output by its contract: docs-SSSSS-of-NNNNN.parquet + _MANIFEST.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("title", pa.string()),
                        ("sentences", pa.list_(pa.string()))])
    entries = []
    for k in range(num_shards):
        part = sorted(docs[k::num_shards], key=lambda d: d["doc_id"])
        uri = str(folder / f"docs-{k:05d}-of-{num_shards:05d}.parquet")
        cols = {name: [d[name] for d in part] for name in schema.names}
        pq.write_table(pa.Table.from_pydict(cols, schema=schema), uri)
        entries.append(storage.shard_entry(uri, len(part)))
    storage.write_manifest(str(folder), stage="corpus", config={}, shards=entries,
                           counts={"documents": len(docs)})
    return str(folder)


@pytest.fixture(scope="module")
def sentences_by_doc(samples_dir) -> list[dict]:
    """Botchan in 40-line documents and the 300 news articles (131k words of real text)."""
    book = [s for s in (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").split("\n")
            if s.strip()]
    news = [s for s in (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").split("\n")
            if s.strip()]
    docs = [{"doc_id": f"book:botchan/{i}", "source": "books", "title": "Botchan", "sentences": book[i:i + 40]}
            for i in range(0, len(book), 40)]
    docs += [{"doc_id": f"wiki:{i}", "source": "wikipedia", "title": f"News {i}", "sentences": [line]}
             for i, line in enumerate(news)]
    # an empty document is counted, not dropped silently
    docs.append({"doc_id": "wiki:empty", "source": "wikipedia", "title": "Empty", "sentences": []})
    # a null sentence (a corpus bug) is counted too, and the document's other words still count
    docs.append({"doc_id": "wiki:null", "source": "wikipedia", "title": "Null",
                 "sentences": ["The null follows.", None]})
    return docs


@pytest.fixture(scope="module")
def corpus(sentences_by_doc, tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"), sentences_by_doc)


@pytest.fixture(scope="module")
def one_worker(corpus, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("vocab1"))
    build_vocab.run(SMALL, corpus, out, workers=1)
    return out


def digest(folder: str, name: str) -> str:
    return hashlib.sha256(Path(folder, name).read_bytes()).hexdigest()


def test_vocab_layout_manifest_and_stats(one_worker, sentences_by_doc) -> None:
    manifest = storage.read_manifest(one_worker)
    lines = Path(one_worker, "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(lines) == 2000 == manifest["counts"]["vocab_size"]
    assert lines[:15] == special_tokens(10) == ["[PAD]", *(f"[unused{i}]" for i in range(10)),
                                                "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(set(lines)) == len(lines) and any(t.startswith("##") for t in lines)
    assert manifest["stage"] == "vocab"
    assert manifest["config"]["lowercase"] is True and manifest["config"]["strip_accents"] is True
    assert [s["path"] for s in manifest["shards"]] == ["vocab.txt", "tokenizer.json"]
    assert manifest["shards"][0]["sha256"] == digest(one_worker, "vocab.txt")
    assert manifest["inputs"][0]["stage"] == "corpus"

    every_sentence = [s for d in sentences_by_doc for s in d["sentences"] if s is not None]
    words = count_words(every_sentence)
    counts, stats = manifest["counts"], manifest["stats"]
    assert counts["documents"] == len(sentences_by_doc) and counts["documents_without_sentences"] == 1
    assert counts["null_sentences"] == 1
    assert counts["sentences"] == len(every_sentence)
    assert counts["words"] == stats["words"] == sum(words.values())
    assert stats["distinct_words"] == len(words)
    assert stats["unk_rate"] == 0.0  # every character of the corpus is in the alphabet
    assert 1.0 < stats["tokens_per_word"] < 2.0
    assert [tok for tok, _ in stats["top_tokens"][:3]] == ["the", ".", ","]

    tok = load_tokenizer(one_worker)
    assert tok.vocab_size == 2000 and tok.lowercase
    assert tok.encode("The cat sat.") == Tokenizer.from_vocab_file(str(Path(one_worker, "vocab.txt"))).encode(
        "The cat sat.")


def test_same_bytes_with_one_and_two_workers(corpus, one_worker, tmp_path) -> None:
    out = str(tmp_path / "vocab2")
    build_vocab.run(SMALL, corpus, out, workers=2)
    for name in ("vocab.txt", "tokenizer.json"):
        assert digest(out, name) == digest(one_worker, name), name
    assert storage.read_manifest(out)["stats"] == storage.read_manifest(one_worker)["stats"]


def test_counts_fed_as_repeats_reproduce_raw_text_training(one_worker, sentences_by_doc) -> None:
    """The issue's point: feeding counts must give the vocab that training on the text gives."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, trainers

    from bert_core.vocab.tokenization import bert_normalizer, bert_pre_tokenizer

    raw = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = bert_normalizer(lowercase=True)
    raw.pre_tokenizer = bert_pre_tokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=2000, min_frequency=2, limit_alphabet=1000,
                                        special_tokens=special_tokens(10), show_progress=False)
    raw.train_from_iterator((s for d in sentences_by_doc for s in d["sentences"] if s), trainer)
    ours = set(Path(one_worker, "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1])
    theirs = set(raw.get_vocab())
    jaccard = len(ours & theirs) / len(ours | theirs)
    assert jaccard > 0.99, jaccard
    # and scaling the counts down (the shortcut the module docstring rejects) is visibly worse
    from bert_core.vocab.training import train_wordpiece

    words = count_words(s for d in sentences_by_doc for s in d["sentences"] if s)
    scaled = sorted(((w, max(1, c // 10)) for w, c in words.items()), key=lambda wc: (-wc[1], wc[0]))
    shortcut = set(train_wordpiece(lambda: scaled, 2000, num_unused=10))
    assert len(shortcut & theirs) / len(shortcut | theirs) < jaccard


def test_min_count_for_keeps_at_most_max_words() -> None:
    from bert_core.vocab.wordcount import min_count_for

    count_of_counts = {100: 1, 10: 3, 2: 5, 1: 20}  # 29 distinct words
    assert min_count_for(count_of_counts, 29) == 1  # all fit: no bound
    assert min_count_for(count_of_counts, 1000) == 1
    assert min_count_for(count_of_counts, 28) == 2  # the 20 words seen once tie: all go
    assert min_count_for(count_of_counts, 9) == 2
    assert min_count_for(count_of_counts, 8) == 3  # 4 words kept, never a part of a tie
    assert min_count_for(count_of_counts, 1) == 11
    assert min_count_for(count_of_counts, 0) == 101  # nothing kept: build_vocab refuses it


def test_max_words_bound_leaves_the_vocab_unchanged_when_the_corpus_fits(corpus, one_worker, sentences_by_doc,
                                                                          tmp_path) -> None:
    distinct = len(count_words(s for d in sentences_by_doc for s in d["sentences"] if s))
    out = str(tmp_path / "fits")
    build_vocab.run(SMALL.model_copy(update={"max_words": distinct}), corpus, out, workers=2)
    for name in ("vocab.txt", "tokenizer.json"):
        assert digest(out, name) == digest(one_worker, name), name
    counts = storage.read_manifest(out)["counts"]
    assert counts["distinct_words_trained"] == distinct
    assert counts["distinct_words_left_out"] == counts["words_left_out"] == 0
    assert counts["min_word_count"] == 1
    assert storage.read_manifest(one_worker)["counts"]["distinct_words_left_out"] == 0


def test_max_words_bound_trains_on_the_most_frequent_words_and_counts_the_rest(corpus, sentences_by_doc,
                                                                                tmp_path) -> None:
    from bert_core.vocab.training import train_wordpiece
    from bert_core.vocab.wordcount import count_key

    words = count_words(s for d in sentences_by_doc for s in d["sentences"] if s)
    cfg = SMALL.model_copy(update={"max_words": 3000})
    out = str(tmp_path / "bounded")
    build_vocab.run(cfg, corpus, out, workers=2)
    manifest = storage.read_manifest(out)
    counts, t = manifest["counts"], manifest["counts"]["min_word_count"]
    kept = sorted(((w, c) for w, c in words.items() if c >= t), key=count_key)
    # the largest set of the most frequent words that fits, ties at the cut left out together
    assert len(kept) <= 3000 < sum(1 for c in words.values() if c >= t - 1)
    assert counts["distinct_words_trained"] == len(kept)
    assert counts["distinct_words_left_out"] == len(words) - len(kept) > 0
    assert counts["words_left_out"] == sum(c for c in words.values() if c < t)
    assert counts["words"] == manifest["stats"]["words"] == sum(words.values())  # stats: every word
    # exactly the vocab the trainer gives on the kept words alone
    vocab = train_wordpiece(lambda: kept, cfg.vocab_size, cfg.min_frequency, cfg.limit_alphabet, cfg.num_unused)
    lines = Path(out, "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert lines == sorted(vocab, key=vocab.__getitem__)


def test_cased_vocab_keeps_case_and_accents(tmp_path) -> None:
    from typer.testing import CliRunner

    from flows.cli.main import app

    docs = [{"doc_id": f"wiki:{i}", "source": "wikipedia", "title": "t",
             "sentences": ["Émile Zola wrote in Paris.", "THE END of Émile's story, in Paris again."] * 3}
            for i in range(4)]
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", docs, num_shards=1)
    done = CliRunner().invoke(app, ["vocab", "--corpus", corpus, "--output", str(tmp_path / "vocab"), "--cased",
                                    "--vocab-size", "200", "--set", "vocab.num_unused=2", "--set",
                                    "vocab.min_frequency=1", "--workers", "1"])
    assert done.exit_code == 0, done.output
    manifest = storage.read_manifest(str(tmp_path / "vocab"))
    assert manifest["config"]["lowercase"] is False and manifest["config"]["strip_accents"] is False
    vocab = set(Path(tmp_path / "vocab" / "vocab.txt").read_text(encoding="utf-8").split("\n"))
    assert "É" in vocab and "P" in vocab and "é" not in vocab
    assert load_tokenizer(str(tmp_path / "vocab")).tokenize("Émile")[0].startswith("É")


def test_vocab_file_is_validated_and_measured_not_trained(corpus, samples_dir, tmp_path) -> None:
    given = samples_dir / "models" / "minilm" / "vocab.txt"
    out = tmp_path / "given"
    manifest = build_vocab.run(VocabConfig(vocab_file=str(given)), corpus, str(out))
    assert (out / "vocab.txt").read_bytes() == given.read_bytes()
    assert manifest["counts"]["trained"] is False and manifest["counts"]["vocab_size"] == 30522
    assert manifest["config"]["vocab_file"] == str(given)
    assert manifest["stats"]["unk_rate"] < 0.001 and manifest["stats"]["used_tokens"] > 5000
    # without a corpus it only validates (no Beam run, no stats)
    alone = build_vocab.run(VocabConfig(vocab_file=str(given)), None, str(tmp_path / "alone"))
    assert alone["stats"] == {} and alone["inputs"] == []


@pytest.mark.parametrize("text, fix", [
    ("[UNK]\n[CLS]\n[SEP]\n[MASK]\n[PAD]\na\n##a\n", r"\[PAD\] has id 4, expected 0"),
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n##a\n", r"missing \[MASK\]"),
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\na\n", r"line 7: duplicate token 'a'"),
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nThe\nA\n##s\n", r"cased vocab.*set vocab.lowercase=false"),
])
def test_bad_vocab_files_are_refused_with_the_fix(tmp_path, text, fix) -> None:
    bad = tmp_path / "vocab.txt"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(VocabError, match=fix) as err:
        build_vocab.run(VocabConfig(vocab_file=str(bad)), None, str(tmp_path / "out"))
    assert str(bad) in str(err.value)
    assert not storage.has_manifest(str(tmp_path / "out"))


def test_unfinished_corpus_is_refused(tmp_path) -> None:
    (tmp_path / "corpus").mkdir()
    with pytest.raises(storage.UnfinishedWriteError, match="no _MANIFEST.json"):
        build_vocab.run(SMALL, str(tmp_path / "corpus"), str(tmp_path / "vocab"))


def test_cli_vocab(samples_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from flows.cli.main import app

    given = str(samples_dir / "models" / "minilm" / "vocab.txt")
    ok = CliRunner().invoke(app, ["vocab", "--output", str(tmp_path / "v"), "--vocab-file", given])
    assert ok.exit_code == 0, ok.output
    assert "30,522 tokens" in ok.output and "uncased" in ok.output
    bad = CliRunner().invoke(app, ["vocab", "--output", str(tmp_path / "w"), "--vocab-file", given,
                                   "--set", "vocab.lowercase=false"])
    assert bad.exit_code == 1 and "set vocab.lowercase=true" in bad.output


@pytest.mark.slow
def test_on_the_corpus_stage_output_and_prefect_flow(prefect_api, samples_dir, tmp_path) -> None:
    """clean (engineer A's stage, real Beam) -> vocab flow under a real Prefect server."""

    from prefect_server import latest_artifacts

    from beam_jobs import clean_corpus
    from bert_core.config import CorpusConfig, load_config
    from flows.vocab import build_vocab as vocab_flow

    corpus = str(tmp_path / "corpus")
    clean_corpus.run(CorpusConfig(books=[str(samples_dir / "books" / "botchan.txt")]), corpus)
    config = load_config("demo", sets=["workers=1", "vocab.vocab_size=1500", "vocab.num_unused=5"])
    out = str(tmp_path / "vocab")
    assert vocab_flow(config, corpus, out) == out
    created = storage.read_manifest(out)["created"]
    assert vocab_flow(config, corpus, out) == out  # same config and corpus: not redone
    assert storage.read_manifest(out)["created"] == created

    artifacts = latest_artifacts()
    manifest = storage.read_manifest(out)
    assert manifest["inputs"][0]["stage"] == "corpus"
    assert manifest["counts"]["documents"] == storage.read_manifest(corpus)["counts"]["documents"] == 1
    report = artifacts["vocab-report"]
    assert "1,500 tokens" in report and "UNK rate" in report and "data:image/png;base64," in report
