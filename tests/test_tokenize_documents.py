"""The instance job's batch tokenizer (``Tokenizer.encode_documents_bytes``) gives each document
the bytes of the one-document path (``Tokenizer.encode_document_bytes``), on real text of every
kind the job meets, uncased and cased."""

from __future__ import annotations

import bz2
import html

import pytest

from bert_core.vocab.tokenization import Tokenizer

WIKI = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"
EDGES = [
    [], [""], ["   "], [" lead  double  trail ", "..."], ["Hello, world!"],
    ["ΟΔΟΣ ΑΣ, ΟΔΟΣ'Α A.Σ", "a \u0301b e\u0301 İstanbul ß ﬁ 中文字"],  # final sigma, accents, CJK
    ["tab\there", "x\x00y z"], ["\x01\x02"],  # not printable: sentence by sentence
    ["Ἀχιλλεύς"], ["x" * 250 + "é", "A" * 201 + " " + "Ab" * 100],  # over max_input_chars_per_word
    ["[MASK] [CLS] text [SEP]", "Don't e-mail U.S.A. 3.14 $5 #hash @at `q` {b} ~t|p\\"],
]


@pytest.fixture(scope="module")
def documents(samples_dir) -> list[list[str]]:
    """The book and news lines and the non-ASCII Wikipedia lines, cut into documents, and the
    edge cases."""
    lines = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").split("\n")
    lines += (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").split("\n")
    with bz2.open(samples_dir / WIKI, "rt", encoding="utf-8") as f:
        lines += [line for line in html.unescape(f.read()).split("\n") if not line.isascii()]
    return [lines[i:i + 23] for i in range(0, len(lines), 23)] + EDGES


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_documents_at_once_are_each_document_alone(samples_dir, documents, lowercase) -> None:
    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    alone = Tokenizer.from_vocab_file(vocab, lowercase=lowercase)
    want = [alone.encode_document_bytes(d) for d in documents]
    batched = Tokenizer.from_vocab_file(vocab, lowercase=lowercase)
    for _ in range(2):  # cold caches, then warm
        got = [b for i in range(0, len(documents), 97)
               for b in batched.encode_documents_bytes(documents[i:i + 97])]
        assert got == want
    assert batched.encode_documents_bytes([]) == []
    assert batched.encode_documents_bytes(EDGES[:3]) == [b"", alone.encode_document_bytes([""]),
                                                         alone.encode_document_bytes(["   "])]


def test_tokenize_documents_in_batches_spills_each_document_once(samples_dir, documents, tmp_path) -> None:
    """The job's TokenizeDocuments, tokenizing a few documents at a time and spilling often,
    spills every document with a token once, with the one-document path's bytes, and rejects
    the others."""
    import pyarrow as pa
    from apache_beam.pvalue import TaggedOutput
    from apache_beam.utils.windowed_value import WindowedValue

    from beam_jobs.create_instances import TokenizeDocuments

    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    docs = [(f"doc-{i:05d}", sentences) for i, sentences in enumerate(documents)]
    docs.append(("nulls", [None, "Kept sentence.", None]))
    fn = TokenizeDocuments(vocab, True, seed=7, threshold=0.0, pools={"train": 3}, output=str(tmp_path))
    fn.TOKENIZE_CHARS, fn.SPILL_BYTES = 3000, 20_000
    fn.setup()
    fn.start_bundle()
    outputs = [out for doc in docs for out in fn.process(doc)]
    assert outputs  # spilled while processing, not only at the end of the bundle
    outputs += list(fn.finish_bundle())
    spilled, rejected = {}, 0
    for out in outputs:
        tag, value = (out.tag, out.value) if isinstance(out, TaggedOutput) else (None, out)
        value = value.value if isinstance(value, WindowedValue) else value  # finish_bundle's
        if tag == "rejects":
            rejected += value[1]
            continue
        (split, _), (uri, count) = value
        with pa.memory_map(uri) as f:
            table = pa.ipc.open_file(f).read_all()
        assert split == "train" and table.num_rows == count
        for doc_id, ids in zip(*table.select(["doc_id", "ids"]).to_pydict().values(), strict=True):
            assert doc_id not in spilled
            spilled[doc_id] = ids
    alone = Tokenizer.from_vocab_file(vocab)
    want = {d: alone.encode_document_bytes([s for s in ss if s is not None]) for d, ss in docs}
    kept = {d: b for d, b in want.items() if len(b) // 4 > len([s for s in dict(docs)[d] if s is not None])}
    assert spilled == kept
    assert rejected == len(docs) - len(kept) > 0
