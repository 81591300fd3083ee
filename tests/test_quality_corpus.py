"""The quality protocol's corpora on tiny real files: the dictd books, the task-text filter, the
genre set-aside and the per-genre counts (benchmarks/quality/corpus.py)."""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import json
import tarfile
from pathlib import Path

import pytest

from benchmarks.quality import corpus as qc
from benchmarks.text import distinct_text as dt
from bert_core.finetune.glue import Example

HELD_OUT = "The held out sentence has at least eight words in it."


def dictd_number(n: int) -> str:
    digits = ""
    while True:
        digits = dt._DICTD_DIGITS[n % 64] + digits
        n //= 64
        if not n:
            return digits


def write_dictd(folder: Path, entries: list[tuple[str, str]]) -> tuple[bytes, str]:
    """A dictd database: the entries' text one after another, an index of (headword, offset, length)."""
    data, rows = b"", []
    for headword, text in entries:
        raw = text.encode()
        rows.append(f"{headword}\t{dictd_number(len(data))}\t{dictd_number(len(raw))}")
        data += raw
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.dict.dz").write_bytes(gzip.compress(data))
    (folder / "tiny.index").write_text("\n".join(sorted(rows)) + "\n")
    return data, "\n".join(sorted(rows)) + "\n"


ENTRIES = [
    ("00databaseinfo", "This database was converted by a tool and carries a long notice about it.\n"),
    ("Abase", 'Abase \\A*base"\\ ([.a]*b[=a]s"), v. t. [F. abaisser; L. ad + bassus low.]\n'
              "   To lower or depress; to throw or cast down; as, to abase the eye. [Archaic]\n"
              "   --Bacon.\n   [1913 Webster]\n\n"),
    ("abase", 'Abase \\A*base"\\, v. t.\n   [1913 Webster]\n\n'),  # a second headword, another (short) entry
    ("bogus", "bogus\n /boh'g@s/, adj.\n\n    Non-functional, false or useless, as a {bogon} is; said of\n"
              "    programs, data and the people who make them.\n\n"),
    ("CANNON", "CANNON, n.  An instrument employed in the rectification of national\nboundaries.\n\n"),
    ("3com", "3com\n n.\n\n    A company that made network cards for many years in a row.\n\n"),
]


def test_dictd_database_becomes_one_prose_paragraph_per_entry_and_one_document_per_letter(tmp_path):
    data, index = write_dictd(tmp_path / "usr" / "share" / "dictd", ENTRIES)
    assert [h for h, _ in dt.dictd_entries(data, index)] == ["Abase", "abase", "bogus", "CANNON", "3com"]
    assert dt.dictd_documents(data, index) == {
        "a": ["To lower or depress; to throw or cast down; as, to abase the eye."],
        "b": ["Non-functional, false or useless, as a bogon is; said of programs, data and the people who make them."],
        "c": ["An instrument employed in the rectification of national boundaries."],
        "other": ["A company that made network cards for many years in a row."],
    }
    # through the source's archive, as fetch reads it: the book format, one file a letter
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "usr", arcname="./usr")
    source = dt.Source("dict-tiny", "debian", "dict-tiny", "1", archive.name, "", "public domain", "tiny",
                       "dictd", next(s for s in dt.SOURCES if s.markup == "dictd").include)
    docs = dict(dt.documents(source, archive))
    assert sorted(docs) == ["a.txt", "b.txt", "c.txt", "other.txt"]
    assert docs["c.txt"] == "An instrument employed in the rectification of national boundaries.\n"
    assert {s.name for s in dt.SOURCES if s.markup == "dictd"} == {"dict-devil", "dict-jargon", "dict-gcide"}
    assert {dt.GENRES[s.name] for s in dt.SOURCES} == {"manuals", "scripture", "reference"}


def write_samples(folder: Path, paragraphs: int = 40, speeches: int = 30, tweets: int = 50) -> None:
    """A sample folder as ``samples fetch`` lays it out: a book, a play, a dump and the tweets CSV."""
    (folder / "books").mkdir(parents=True)
    book = [f"Paragraph {n} of the novel tells of the town, the school and the cat number {n}." for n in range(paragraphs)]
    book[3] = f"The teacher came in late. {HELD_OUT} Then he sat down."
    (folder / "books" / "novel.txt").write_text("\n\n".join(book) + "\n")
    (folder / "plays").mkdir()
    speech = "\n\n".join(f"**KING**\n\nSpeech {n} of the king is long enough to be a speech of his." for n in range(speeches))
    (folder / "plays" / "a-play.md").write_text(f"# A Play\n\n## ACT I\n\n{speech}\n")
    pages = "".join(
        f"<page><title>Page {n}</title><ns>0</ns><id>{n + 1}</id><revision><text>Article {n} is about a place. "
        f"It has a river and a hill number {n}.{' ' + HELD_OUT if n == 2 else ''}</text></revision></page>\n"
        for n in range(12))
    (folder / "wikipedia").mkdir()
    (folder / "wikipedia" / "tiny.xml.bz2").write_bytes(bz2.compress(f"<mediawiki>\n{pages}</mediawiki>\n".encode()))
    (folder / "text").mkdir()
    with open(folder / "text" / "tweets.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["sentiment", "confidence", "text"])
        for n in range(tweets):
            out.writerow(["neutral", "1", HELD_OUT if n == 7 else f"tweet number {n} says the weather is fine today"])


@pytest.fixture()
def prepared(tmp_path):
    samples = tmp_path / "samples"
    write_samples(samples)
    examples = [Example("t:1", HELD_OUT, None, "neutral"), Example("t:2", "short one", None, "neutral")]
    return qc.prepare("k1", tmp_path / "work", samples, examples, log=lambda m: None)


def written_text(prepared) -> str:
    from bert_core.corpus.wikitext import wikitext_to_paragraphs

    (wiki,) = [p for flag, g in prepared.inputs if flag == "--wikipedia" for p in glob.glob(g)]
    _, pages, _ = qc.dump_pages(Path(wiki))
    parts = [" ".join(wikitext_to_paragraphs(qc.ET.fromstring(p).findtext("revision/text"))) for p in pages]
    parts += [Path(p).read_text() for flag, g in prepared.inputs if flag != "--wikipedia" for p in glob.glob(g)]
    return "\n".join(parts)


def test_task_texts_leave_every_input_by_paragraph_tweet_and_article(prepared):
    (books,) = [g for flag, g in prepared.inputs if flag == "--books"]
    novel = (Path(books).parent.parent / "books" / "novel.txt").read_text()
    assert HELD_OUT not in novel and "The teacher came in late." not in novel  # the whole paragraph
    assert novel.count("\n\n") + 1 == 40 - 1 - prepared.sizes["novel"]["set_aside"]
    assert HELD_OUT not in written_text(prepared)
    assert {g: s["task_text_dropped"] for g, s in prepared.sizes.items()} == \
        {"encyclopedia": 1, "novel": 1, "plays": 0, "tweets": 1}
    tweets = [json.loads(line)["text"] for line in Path(prepared.inputs[-1][1]).read_text().splitlines()]
    assert "tweet number 8 says the weather is fine today" in "\n\n".join(tweets)
    assert all(flag in ("--wikipedia", "--books", "--text") for flag, _ in prepared.inputs)
    assert "inputs-" in books  # the copies' folder is named by their sha256


def test_set_aside_is_one_percent_at_least_ten_deterministic_and_in_no_input(prepared, tmp_path):
    ids = [f"d{n:05d}" for n in range(2500)]
    assert len(qc.set_aside(ids)) == 25 and qc.set_aside(ids) == qc.set_aside(ids[::-1])
    assert len(qc.set_aside(ids[:300])) == 10 and qc.set_aside(ids[:7]) == set(ids[:7])
    assert qc.set_aside(ids[:300]) != qc.set_aside(ids[:300], seed=1)

    sizes = prepared.sizes
    assert {g: s["set_aside"] for g, s in sizes.items()} == {"encyclopedia": 10, "novel": 10, "plays": 10, "tweets": 10}
    assert sizes["encyclopedia"]["kept"] == 1  # 12 articles: 1 with task text, 10 aside
    text = written_text(prepared)
    for genre in sizes:
        rows = [json.loads(line) for line in (prepared.heldout / f"{genre}.jsonl").read_text().splitlines()]
        assert len(rows) == 10 and [r["id"] for r in rows] == sorted(r["id"] for r in rows)
        for row in rows:
            assert " ".join(row["sentences"]) not in text
    again = qc.prepare("k1", tmp_path / "again", tmp_path / "samples",
                       [Example("t:1", HELD_OUT, None, "neutral")], log=lambda m: None)
    for genre in sizes:
        assert (again.heldout / f"{genre}.jsonl").read_bytes() == (prepared.heldout / f"{genre}.jsonl").read_bytes()


def test_genres_of_documents_pieces_and_epochs_seen_on_a_tiny_corpus(tmp_path, prepared):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bert_core.vocab.tokenization import load_tokenizer

    assert qc.genre_of("wiki:3", prepared.genres) == "encyclopedia"
    assert qc.genre_of("text:tweets-0", prepared.genres) == "tweets"
    assert qc.genre_of("book:novel", prepared.genres) == "novel" and qc.genre_of("book:a-play", prepared.genres) == "plays"

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", ".", "a", "dog"]))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = {"book:novel": ["the cat sat.", "the dog sat."], "book:a-play": ["a dog."], "wiki:1": ["the the the cat."]}
    pq.write_table(pa.table({"doc_id": list(docs), "sentences": list(docs.values())}),
                   corpus / "docs-00000-of-00001.parquet")
    instances = tmp_path / "instances"
    instances.mkdir()
    (instances / "_MANIFEST.json").write_text(json.dumps({
        "stage": "instances", "schema_version": 1, "shards": [], "config": {"seed": 12345, "eval_fraction": 0.0, "min_eval_documents": 0},
        "counts": {"documents_read": 3}, "stats": {"seq64": {"counts": {"instances": 4, "maskable_tokens": 26}}}}))
    pieces = qc.genre_pieces(corpus, vocab, instances, prepared.genres)
    # 16 pieces in the corpus (the dot is one), 26 in the instances: each genre its share
    assert pieces == {"encyclopedia": {"corpus_pieces": 5, "instance_pieces": 8},
                      "novel": {"corpus_pieces": 8, "instance_pieces": 13},
                      "plays": {"corpus_pieces": 3, "instance_pieces": 5}}
    assert qc.epochs_seen(pieces, instances, 10) == {g: 2.5 for g in pieces}

    tokenizer = load_tokenizer(str(vocab))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"id": "x#1", "sentences": ["the cat sat.", "the dog sat.", "a dog."]}) + "\n"
                       + json.dumps({"id": "x#2", "sentences": ["a cat."]}) + "\n")
    cls, sep = tokenizer.cls_id, tokenizer.sep_id
    the, cat, sat, dot, a, dog = (tokenizer.encode(w)[0] for w in ("the", "cat", "sat", ".", "a", "dog"))
    assert qc.heldout_sequences(heldout, tokenizer, length=10) == [
        [cls, the, cat, sat, dot, the, dog, sat, dot, sep], [cls, a, dog, dot, sep], [cls, a, cat, dot, sep]]
    assert len(qc.heldout_sequences(heldout, tokenizer, count=2, length=64)) == 2
