"""bert_core/vocab/tokenization.py against transformers' pure-Python BERT tokenizer on real text, with
the real bert-base-uncased vocab of the sample MiniLM model."""

from __future__ import annotations

import bz2
import html
import json

import pytest

from bert_core import storage
from bert_core.vocab.tokenization import (
    Tokenizer,
    VocabError,
    load_tokenizer,
    parse_vocab,
)
from bert_core.vocab.training import train_wordpiece
from bert_core.vocab.wordcount import basic_tokenize, count_words

WIKI = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"


def reference(vocab_file, lowercase: bool, max_chars: int = 200):
    # transformers 5 keeps the pure-Python tokenizer as BertTokenizerLegacy (BertTokenizer is
    # now the tokenizers-backed one); it lowercases with str.lower() exactly like Google's.
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    ref = BertTokenizerLegacy(str(vocab_file), do_lower_case=lowercase)
    ref.wordpiece_tokenizer.max_input_chars_per_word = max_chars
    return ref


def ref_ids(ref, lines: list[str]) -> list[list[int]]:
    return [ref.convert_tokens_to_ids(ref.tokenize(line)) for line in lines]


@pytest.fixture(scope="module")
def vocab_file(samples_dir):
    return samples_dir / "models" / "minilm" / "vocab.txt"


@pytest.fixture(scope="module")
def book_and_news_lines(samples_dir) -> list[str]:
    """Every line of the Gutenberg book and of the news corpus (300 articles)."""
    lines = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").split("\n")
    lines += (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").split("\n")
    return lines


@pytest.fixture(scope="module")
def wiki_lines(samples_dir) -> list[str]:
    """The enwiki excerpt crudely stripped (XML entities decoded), lines with non-ASCII text:
    accents, Greek (incl. final sigma), CJK, symbols. All-ASCII lines are covered by the book."""
    with bz2.open(samples_dir / WIKI, "rt", encoding="utf-8") as f:
        text = html.unescape(f.read())
    return [line for line in text.split("\n") if not line.isascii()]


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_ids_equal_transformers_on_every_book_and_news_line(vocab_file, book_and_news_lines, lowercase) -> None:
    ours = Tokenizer.from_vocab_file(str(vocab_file), lowercase=lowercase)
    ref = reference(vocab_file, lowercase)
    got, want = ours.encode_batch(book_and_news_lines), ref_ids(ref, book_and_news_lines)
    diff = [line for line, a, b in zip(book_and_news_lines, got, want, strict=True) if a != b]
    assert len(book_and_news_lines) > 4500
    assert not diff, f"{len(diff)} lines differ, first: {diff[0]!r}"


@pytest.mark.slow
def test_ids_equal_transformers_on_non_ascii_wikipedia_lines(vocab_file, wiki_lines) -> None:
    """Uncased is where normalization matters (accents, final sigma); 3,975 real lines."""
    ours = Tokenizer.from_vocab_file(str(vocab_file), lowercase=True)
    ref = reference(vocab_file, lowercase=True)
    got, want = ours.encode_batch(wiki_lines), ref_ids(ref, wiki_lines)
    diff = [line[:200] for line, a, b in zip(wiki_lines, got, want, strict=True) if a != b]
    assert len(wiki_lines) > 3000
    assert any("Σ" in line for line in wiki_lines)  # the final-sigma case is really in there
    assert not diff, f"{len(diff)} lines differ, first: {diff[0]!r}"


def test_greek_final_sigma_follows_str_lower(vocab_file) -> None:
    ours = Tokenizer.from_vocab_file(str(vocab_file))
    ref = reference(vocab_file, lowercase=True)
    for text in ["ΟΔΟΣ", "ΟΔΟΣ, ΣΑ", "Σ.", "ΑΣΑ", "ΟΔΟΣ'Α", "A.Σ", "ΑΣ1", "Ἀχιλλεύς ΑΧΙΛΛΕΥΣ"]:
        assert ours.tokenize(text) == ref.tokenize(text), text
    assert ours.tokenize("ΟΔΟΣ")[-1].endswith("ς") and "ς" not in "".join(ours.tokenize("ΟΔΟΣΑ"))
    assert basic_tokenize("ΟΔΟΣ") == ["οδος"] == ["ΟΔΟΣ".lower()]


def test_google_200_char_word_rule_is_a_setting(vocab_file) -> None:
    ours = Tokenizer.from_vocab_file(str(vocab_file))
    assert ours.max_input_chars_per_word == 200
    assert ours.tokenize("a" * 201) == ["[UNK]"]
    assert ours.tokenize("a" * 200)[0] == "aaa" and "[UNK]" not in ours.tokenize("a" * 200)
    word = "ab" * 75  # 150 chars: a word under Google's limit, over transformers'
    assert ours.encode(word) == ref_ids(reference(vocab_file, True, max_chars=200), [word])[0]
    short = Tokenizer.from_vocab_file(str(vocab_file), max_input_chars_per_word=100)
    assert short.tokenize(word) == ["[UNK]"] == reference(vocab_file, True, max_chars=100).tokenize(word)


def test_special_ids_words_and_offsets(vocab_file) -> None:
    tok = Tokenizer.from_vocab_file(str(vocab_file))
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.vocab_size) == (0, 100, 101, 102, 103, 30522)
    assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(["[CLS]", "hello", "##s", "zzzqqq"])) == [
        "[CLS]", "hello", "##s", "[UNK]"]
    assert tok.is_subword("##s") and not tok.is_subword("s")
    # a literal special token in raw text is just text (Google's behaviour): no injected [MASK]
    assert tok.mask_id not in tok.encode("the [MASK] token")
    words = ["Héllo,", "wörld", "  ", "naïve社会", "unaffable"]
    assert tok.encode_words(words) == [tok.encode(w) for w in words]
    assert tok.encode_words(words)[2] == []
    text = "Héllo, THE wörld!  Ἀχιλλεύς unaffable 社会"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    for token, (start, end) in zip(tok.convert_ids_to_tokens(ids), offsets, strict=True):
        # the span, normalized the same way, is the token (## pieces: its continuation)
        assert basic_tokenize(text[start:end])[0].startswith(token.removeprefix("##")[:1]), (token, text[start:end])
    spans = [text[s:e] for s, e in offsets]
    assert spans[:6] == ["Héllo", ",", "THE", "wörld", "!", "Ἀ"]


def test_from_pretrained_dir_reads_casing(samples_dir, tmp_path) -> None:
    tok = Tokenizer.from_pretrained_dir(str(samples_dir / "models" / "minilm"))
    assert tok.lowercase and tok.strip_accents
    (tmp_path / "vocab.txt").write_bytes((samples_dir / "models" / "minilm" / "vocab.txt").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    cased = Tokenizer.from_pretrained_dir(str(tmp_path))
    assert not cased.lowercase and not cased.strip_accents
    assert cased.tokenize("Hello")[0] != "hello"


def test_bad_vocab_files_name_file_and_line(tmp_path) -> None:
    with pytest.raises(VocabError, match=r"v\.txt line 3: duplicate token 'a' \(first on line 2\)"):
        parse_vocab("[UNK]\na\na\n", source="v.txt")
    with pytest.raises(VocabError, match="line 2: empty token"):
        parse_vocab("[UNK]\n\nb\n", source="v.txt")
    with pytest.raises(VocabError, match=r"no \[UNK\]"):
        parse_vocab("a\nb\n", source="v.txt")
    with pytest.raises(VocabError, match="does not exist"):
        Tokenizer.from_vocab_file(str(tmp_path / "missing.txt"))
    with pytest.raises(storage.UnfinishedWriteError):
        load_tokenizer(str(tmp_path))


def test_trained_vocab_loads_in_transformers_fast_tokenizer(book_and_news_lines, tmp_path) -> None:
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    counts = sorted(count_words(book_and_news_lines[:1500]).items(), key=lambda wc: (-wc[1], wc[0]))
    vocab = train_wordpiece(lambda: counts, vocab_size=1200, num_unused=10)
    ours = Tokenizer(vocab)
    ours.save(str(tmp_path / "both"))
    lines = [line for line in book_and_news_lines[1500:2500] if line.strip()]

    # vocab.txt alone (transformers 5 builds its fast tokenizer from it; `vocab_file=` is ignored there)
    (tmp_path / "vocab_only").mkdir()
    (tmp_path / "vocab_only" / "vocab.txt").write_bytes((tmp_path / "both" / "vocab.txt").read_bytes())
    fast = BertTokenizerFast.from_pretrained(str(tmp_path / "vocab_only"), do_lower_case=True)
    assert len(fast) == ours.vocab_size == 1200
    assert fast.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) == [0, 11, 12, 13, 14]
    assert [fast(line, add_special_tokens=False)["input_ids"] for line in lines] == ours.encode_batch(lines)

    # our tokenizer.json: same ids, [CLS] A [SEP] with special tokens
    from_json = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "both" / "tokenizer.json"))
    assert from_json(lines[0])["input_ids"] == [ours.cls_id, *ours.encode(lines[0]), ours.sep_id]
    assert [from_json(line, add_special_tokens=False)["input_ids"] for line in lines] == ours.encode_batch(lines)


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_ascii_word_cache_path_matches_transformers_on_edge_cases(vocab_file, lowercase) -> None:
    """ASCII text takes the word-cache path: control characters, every punctuation char,
    over-long words, [UNK] words and special-token strings must come out as transformers says,
    the first time (cache miss) and the second (hit)."""
    ours = Tokenizer.from_vocab_file(str(vocab_file), lowercase=lowercase)
    ref = reference(vocab_file, lowercase)
    punct = "".join(chr(c) for c in [*range(33, 48), *range(58, 65), *range(91, 97), *range(123, 127)])
    lines = [
        "a\x0bb c\x0cd e\x1cf g\x1fh i\x7fj k\x00l",  # deleted controls join words
        "tab\tnew\nline\rcarriage  double  space",
        f"x{punct}y {punct} Don't e-mail U.S.A. 3.14 $5 #hash @at",
        "A" * 201 + " " + "Ab" * 100 + " tail",  # over 200 chars: [UNK]; exactly 200: pieces
        "Zzxqjv qqqqq UNAFFABLE unaffable", "", "   ", "\x01\x02",
    ]
    want = ref_ids(ref, lines)
    assert all(line.isascii() for line in lines)
    assert ours.encode_batch(lines) == want == ours.encode_batch(lines)
    assert [ours.encode(line) for line in lines] == want
    mixed = [lines[2], "Ἀχιλλεύς café", lines[0], "ΟΔΟΣ"]  # ASCII and not, order kept
    assert ours.encode_batch(mixed) == ref_ids(ref, mixed)
    # special-token strings are plain text (transformers would match them as added tokens)
    text = "[MASK] [CLS] text [SEP]"
    assert ours.encode(text) == ours._backend.encode(text, add_special_tokens=False).ids
    assert ours.mask_id not in ours.encode(text)


def test_encode_document_is_encode_batch_end_to_end(vocab_file, book_and_news_lines) -> None:
    """The job's per-document call (one joined pass over printable ASCII documents) gives the
    same ids and sentence lengths as encode_batch, sentence by sentence."""
    tok = Tokenizer.from_vocab_file(str(vocab_file))
    docs = [book_and_news_lines[i:i + 50] for i in range(0, len(book_and_news_lines), 50)]
    docs += [["Plain one.", "Ἀχιλλεύς café", "", "two"], ["tab\there", "x\x00y z"], [], ["   "]]
    for sentences in docs:
        ids, lengths = tok.encode_document(sentences)
        want = tok.encode_batch(sentences)
        assert ids.tolist() == [i for w in want for i in w]
        assert lengths.tolist() == [len(w) for w in want]
    assert tok.encode_document(["Hello, world!"])[0].tolist() == [7592, 1010, 2088, 999]


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_encode_document_on_non_ascii_text_is_encode_batch(vocab_file, wiki_lines, lowercase) -> None:
    """Printable non-ASCII documents go chunk by chunk (a non-ASCII chunk through the full
    pipeline alone): the same ids as whole sentences through it, cache misses and hits alike."""
    tok = Tokenizer.from_vocab_file(str(vocab_file), lowercase=lowercase)
    printable = [line for line in wiki_lines if line.isprintable()]
    docs = [printable[i:i + 7] for i in range(0, len(printable), 7)]
    docs += [["ΟΔΟΣ ΑΣ, ΟΔΟΣ'Α A.Σ", "a \u0301b e\u0301 İstanbul ß ﬁ 中文字", "“Quoted” don’t — dash", "x" * 250 + "é"]]
    assert len(printable) > 3000
    for _ in range(2):
        for sentences in docs:
            ids, lengths = tok.encode_document(sentences)
            want = tok.encode_batch(sentences)
            assert ids.tolist() == [i for w in want for i in w]
            assert lengths.tolist() == [len(w) for w in want]
