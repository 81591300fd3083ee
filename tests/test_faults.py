"""The fault battery: bad inputs, damaged stage outputs and wrong settings, each met with one
line that names the file or field and the fix (never a traceback), and records that are
rejected, not lost (kept + rejected = read)."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
import shutil
import string
from pathlib import Path

import pytest
from typer.testing import CliRunner

from beam_jobs.clean_corpus import clean
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.dumps import plan_reads
from flows.cli import app

PROSE = ("The river runs through the old town. It was first mapped in 1820 by a surveyor, who "
         "walked its banks for three years. Today it feeds two lakes and a canal. ")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_line(result, code: int, *needles: str) -> None:
    """The command failed with ``code`` and said so in one line holding every needle."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def book_text(title: str, chapters: int = 12) -> str:
    return f"{title}\n\n" + "\n\n".join(f"Chapter {i}. {PROSE}" for i in range(chapters))


def counts_add_up(manifest: dict, source: str) -> dict:
    c = manifest["counts"][source]
    assert c["kept"] + c["rejected"] == c["read"]
    return c


# --------------------------------------------------------------------------- corpus inputs


def test_corrupt_gzip_book_is_one_reject_and_the_other_books_are_kept(tmp_path) -> None:
    books = tmp_path / "books"
    books.mkdir()
    (books / "good.txt").write_text(book_text("A good book"))
    packed = gzip.compress(book_text("Another book").encode())
    (books / "broken.txt.gz").write_bytes(packed[:20] + b"\x00garbage\xff" * 50 + packed[-8:])
    nul = book_text("With NULs", chapters=60)  # the NUL lies past the head that marks binary files
    (books / "nul.txt").write_text(nul[:9000] + nul[9000:].replace("old town", "old\x00 town", 1))
    out = tmp_path / "corpus"
    clean(CorpusConfig(books=[str(books / "*")], dedup_near=False), str(out), workers=1)
    manifest = storage.read_manifest(str(out))
    c = counts_add_up(manifest, "books")
    assert (c["read"], c["kept"], c["rejected"]) == (3, 2, 1)
    assert c["rejected_by_reason"] == {D.UNREADABLE_FILE: 1}
    rejects = [json.loads(line) for f in out.glob("rejects-*.jsonl") for line in f.read_text().splitlines()]
    assert "broken.txt.gz" in rejects[0]["detail"]
    sentences = [s for uri in storage.shard_uris(str(out)) for d in D.read_documents(uri) for s in d["sentences"]]
    assert sentences and not any("\x00" in s for s in sentences)


def test_utf16_bz2_dump_larger_than_a_split_is_read_not_thrown_away(tmp_path) -> None:
    rng = random.Random(0)  # distinct words: the dump must stay large once compressed

    def prose() -> str:
        return " ".join(" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                                 for _ in range(12)).capitalize() + "." for _ in range(20))

    pages = "".join(
        f"  <page>\n    <title>River {i}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{prose()}</text></revision>\n  </page>\n"
        for i in range(1, 400))
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           + pages + "</mediawiki>\n")
    dump = tmp_path / "utf16.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode("utf-16"), 1))  # level 1: many 100 kB blocks
    assert dump.stat().st_size > 256 << 10
    assert [item.kind for item in plan_reads(str(dump))] == ["whole"]
    out = tmp_path / "corpus"
    clean(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"]) == (399, 399)


def test_single_line_page_is_rejected_not_split_into_many_sentences(tmp_path) -> None:
    giant = "Word. " * 30_000  # one 180k-character paragraph of one-word "sentences"
    pages = "".join(
        f"  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{text}</text></revision>\n  </page>\n"
        for i, (title, text) in enumerate([("Giant", giant), ("River", PROSE * 3)], 1))
    dump = tmp_path / "dump.xml"
    dump.write_text('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n'
                    + pages + "</mediawiki>\n")
    out = tmp_path / "corpus"
    clean(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"], c["rejected_by_reason"]) == (2, 1, {D.LINE_TOO_LONG: 1})


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("args, needles", [
    (["--set", "pretrain.phases.7.max_steps=1"], ["pretrain.phases", "2 item(s)"]),
    (["--set", "pretrain.phases.x.lr=1"], ["pretrain.phases is a list", "pretrain.phases.0"]),
    (["--set", "workers.foo=1"], ["workers is a single value", "'foo'"]),
    (["--set", "corpus.wikipedia=*.bz2"], ["corpus.wikipedia", "quote it"]),
    (["--set", "nosuch=1"], ["nosuch", "Extra inputs"]),
])
def test_bad_set_is_one_line_naming_the_key(args, needles) -> None:
    assert_one_line(invoke("config", "show", *args), 2, *needles)


def test_bad_config_files_are_one_line_naming_the_file(tmp_path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("pretrain: [1,\n")
    assert_one_line(invoke("config", "show", "--config", str(broken)), 2, "broken.yaml", "not valid YAML", "line")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert_one_line(invoke("config", "show", "--config", str(listed)), 2, "list.yaml", "mapping of sections")


def test_bad_literal_option_is_one_line(tmp_path) -> None:
    result = invoke("corpus", "--books", str(tmp_path / "*.txt"), "--text-format", "foo", "--output", str(tmp_path / "o"))
    assert_one_line(result, 2, "text_format", "'none' or 'google'")


@pytest.mark.parametrize("command", ["corpus", "vocab", "instances"])
def test_misspelled_option_of_a_beam_stage_is_refused(command, tmp_path) -> None:
    result = invoke(command, "--corpus-x", "a", "--output", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "No such option" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- stage boundaries


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    (root / "book.txt").write_text(book_text("A book"))
    clean(CorpusConfig(books=[str(root / "book.txt")]), str(root / "corpus"), workers=1)
    return root / "corpus"


def test_truncated_corpus_shard_is_named_at_the_next_stage_and_by_verify(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = invoke("vocab", "--corpus", str(corpus), "--output", str(tmp_path / "vocab"))
    assert_one_line(result, 1, shard.name, "corpus stage wrote", "re-run")
    checked = invoke("verify", str(corpus))
    assert checked.exit_code == 1 and shard.name in checked.output
    assert invoke("verify", str(small_corpus)).exit_code == 0


def test_bit_flipped_shard_fails_its_checksum(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(storage.ManifestError, match="sha256"):
        storage.check_shards(str(corpus))


def test_manifest_cut_in_half_is_one_line(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    manifest = corpus / storage.MANIFEST
    manifest.write_text(manifest.read_text()[:200])
    assert_one_line(invoke("stats", str(corpus)), 1, "_MANIFEST.json", "not valid JSON", "re-run")


# --------------------------------------------------------------------------- outputs


def test_unwritable_output_is_one_line_and_leaves_no_temporary_files(small_corpus, tmp_path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(book_text("A book"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    result = invoke("corpus", "--books", str(book), "--output", str(a_file / "corpus"))
    assert_one_line(result, 1, "cannot write to", "a-file", "--output")
    result = invoke("vocab", "--corpus", str(small_corpus), "--output", str(a_file / "vocab"))
    assert_one_line(result, 1, "cannot write to", "a-file")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not os.access(read_only, os.W_OK):  # root may write anywhere: then only the cases above
            result = invoke("corpus", "--books", str(book), "--output", str(read_only / "corpus"))
            assert_one_line(result, 1, "cannot write to", "read-only")
    finally:
        read_only.chmod(0o755)


def test_truncated_model_weights_name_the_file(samples_dir, tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(samples_dir / "models" / "minilm", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    result = invoke("features", "--checkpoint", str(model), "--input",
                    str(samples_dir / "tasks" / "conll" / "ground_truth.txt"), "--output", str(tmp_path / "f.parquet"))
    assert_one_line(result, 1, "model.safetensors", "damaged", "again")
