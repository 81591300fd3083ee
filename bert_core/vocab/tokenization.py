"""BERT's WordPiece tokenizer, fast: HF ``tokenizers`` (Rust) configured with Google's rules.

    from bert_core.vocab.tokenization import Tokenizer, load_tokenizer
    tok = Tokenizer.from_vocab_file("vocab.txt", lowercase=True)
    tok.encode("Hello, world!")          # [7592, 1010, 2088, 999]  (no [CLS]/[SEP])
    tok = load_tokenizer("bertpipe-data/vocab/<version>")   # a vocab stage, model folder or vocab.txt

The ids equal google-research/bert's ``FullTokenizer`` and transformers' BERT tokenizer with the
same vocab and casing (the deliberate differences are listed below the imports).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

from bert_core import storage
from bert_core.config import VocabConfig
from bert_core.failures import Refusal

# The pipeline is google-research/bert's ``FullTokenizer``: clean text (drop NUL, U+FFFD and
# control characters, whitespace -> space), put spaces around CJK ideographs, lowercase and strip
# accents when uncased, split on whitespace and punctuation, then greedy longest-match-first
# WordPiece with ``##`` continuation pieces. Here it is ``NFC + BertNormalizer`` ->
# ``BertPreTokenizer`` -> ``WordPiece`` from ``tokenizers``, and the ids equal
# ``transformers``' pure-Python BERT tokenizer (``BertTokenizerLegacy`` in transformers 5) with
# the same vocab and casing, uncased and cased, on every one of the 233k lines of the sample corpus
# (``benchmarks/speed/bench_tokenization.py``: no line differs; the tests check the book, the news and
# the non-ASCII Wikipedia lines), with these known, deliberate
# differences:
#
# - **Greek final sigma** (handled). Google and transformers lowercase with Python's
#   ``str.lower()``, which applies Unicode's Final_Sigma rule (``"ΟΔΟΣ".lower() == "οδος"``, with
#   ``ς``); the ``tokenizers`` normalizer lowercases one character at a time (``"οδοσ"``, with
#   ``σ``), rare but present in real text. A ``Replace`` normalizer with the Final_Sigma condition as
#   a regex (:data:`FINAL_SIGMA`) runs first, so the ids agree there too; it departs from Python's
#   rule only after 4+ case-ignorable characters between letter and sigma (``"AΣ"``).
# - **``max_input_chars_per_word``** defaults to Google's 200 (transformers uses 100): a longer
#   word becomes one ``[UNK]``. It is a setting (``vocab.max_input_chars_per_word``).
# - **Special-token strings in the text** (a literal ``"[MASK]"`` in a Wikipedia sentence) are
#   split like any text, as Google's tokenizer does; transformers would match them as added tokens.
#   Raw corpus text must never inject control tokens. The exported ``tokenizer.json``
#   (:meth:`Tokenizer.to_hf_json`) does register them, for transformers users.
# - **NFC first.** transformers NFC-normalizes before splitting (Google does not); we do too, so a
#   decomposed ``e + U+0301`` and a precomposed ``é`` give the same ids in cased models.
#
# **Speed: a cache for ASCII text.** ``encode``/``encode_batch``/``encode_document`` send ASCII
# lines (nearly all of English text) past the full ``tokenizers`` pipeline: on ASCII, BERT's
# normalization is only "delete control characters, lowercase when uncased", and whitespace is
# space, tab, CR and LF, so ``translate``, ``lower`` and ``split`` (C-speed string methods) give
# the whitespace-delimited chunks, and each chunk's ids come from a dict. A miss splits the chunk
# at punctuation (every ASCII char in 33-47, 58-64, 91-96, 123-126 is a word of its own) and looks
# each word up in a second dict, whose misses run the ``tokenizers`` WordPiece model on the word
# (so ``##`` pieces, ``[UNK]`` and ``max_input_chars_per_word`` are the model's). Chunks and words
# follow Zipf's law, so nearly every lookup hits; the word dict starts with every whole-word
# entry of the vocab, and chunk values are packed int bytes, so a document is one
# ``b"".join`` (:meth:`Tokenizer.encode_document_bytes`). Other lines take the full pipeline,
# except in :meth:`Tokenizer.encode_document_bytes`: a document of printable text goes chunk by
# chunk there too, a non-ASCII chunk through the full pipeline once (printable text has no other
# whitespace than the space, and no normalization step looks across one). The parity tests run
# every path (every book/news line is ASCII; the Wikipedia lines are not).
#
# **Many documents at once** (:meth:`Tokenizer.encode_documents_bytes`, the instance job's call):
# the same chunks and caches, with pyarrow's string kernels doing the cutting and the gathering
# instead of one Python ``str`` per chunk. The printable documents of a batch are cut at spaces
# and their distinct chunks found (``dictionary_encode``); only the distinct chunks reach Python:
# an ASCII one is lowercased (uncased) and cut around each punctuation character (RE2, the
# punctuation of :data:`_ASCII_WORDS`) into the word cache's words, any other is looked up in the
# printable chunk cache. Each distinct chunk's ids are then gathered for every occurrence by
# ``take`` on a list array.
#
# Offsets (:meth:`Tokenizer.encode_with_offsets`) are character offsets into the original text,
# through all of the normalization above (for SQuAD answer spans).

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
SUBWORD_PREFIX = "##"
GOOGLE_MAX_INPUT_CHARS_PER_WORD = 200
# A capital sigma after a cased letter and not followed by (case-ignorables then) a cased letter:
# Unicode's Final_Sigma condition, which str.lower() applies and tokenizers' lowercase does not.
# (Oniguruma lookbehinds must have bounded length, so up to 3 case-ignorables such as "'" or "."
# may sit between the letter and the sigma; Python allows any number.)
FINAL_SIGMA = (
    r"(?<=\p{Cased}|\p{Cased}\p{Case_Ignorable}|\p{Cased}\p{Case_Ignorable}{2}"
    r"|\p{Cased}\p{Case_Ignorable}{3})Σ(?!\p{Case_Ignorable}*\p{Cased})"
)


# The word-cache fast path (see Tokenizer.encode_batch). On ASCII text BERT's basic tokenizer is:
# delete control characters (NUL, 1-8, 11, 12, 14-31, DEL; Google's _is_control), \t \n \r and
# space are whitespace, every ASCII char in 33-47, 58-64, 91-96, 123-126 is punctuation (its own
# word), lowercase when uncased; NFC, accent stripping and CJK spacing change nothing.
_ASCII_CONTROL = str.maketrans("", "", "".join(
    chr(c) for c in (*range(0, 9), 11, 12, *range(14, 32), 127)))
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
_ASCII_WORDS = re.compile(rf"[^ \t\n\r{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]", re.ASCII)
# The same cut in pyarrow's RE2 (encode_documents_bytes): spaces around each punctuation char.
_SPACED_PUNCT = (rf"([{_ASCII_PUNCT}])", r" \1 ")
SENTENCE_END = -1  # marks the end of a sentence in encode_document_bytes (never a vocab id)
WORD_CACHE_SIZE = 1 << 19  # words remembered (Zipf: the first ones seen are the frequent ones)
CHUNK_CACHE_SIZE = 1 << 17  # chunks remembered: a chunk costs more than a word, and misses fall back on words


class _WordPieceCache(dict):
    """word -> its WordPiece ids as the bytes of a C int array; a miss runs the ``tokenizers``
    WordPiece model on the word (the same model the full pipeline ends in, so unknown words,
    ``##`` pieces and ``max_input_chars_per_word`` behave the same). Stops growing at
    WORD_CACHE_SIZE."""

    def __init__(self, model: Any, limit: int = WORD_CACHE_SIZE) -> None:
        super().__init__()
        self._tokenize, self._limit = model.tokenize, limit

    def __missing__(self, word: str) -> bytes:
        packed = array("i", [t.id for t in self._tokenize(word)]).tobytes()
        if len(self) < self._limit:
            self[word] = packed
        return packed


class _ChunkCache(dict):
    """Whitespace-delimited ASCII chunk (``"world!"``, ``"U.S.A."``, already lowercased when
    uncased) -> its ids as the bytes of a C int array: ``str.split`` is several times cheaper
    than the punctuation regex, chunks are nearly as Zipfian as words, and ``b"".join`` over the
    values of a whole document is one memcpy per chunk (no Python int per token). A miss splits
    the chunk into words and looks each up in the word cache."""

    def __init__(self, words: _WordPieceCache, limit: int = CHUNK_CACHE_SIZE) -> None:
        super().__init__()
        self._word_ids, self._limit = words.__getitem__, limit

    def __missing__(self, chunk: str) -> bytes:
        if chunk.isalnum():  # one word (ASCII letters and digits): no punctuation to split at
            packed = self._word_ids(chunk)
        else:
            packed = b"".join(map(self._word_ids, _ASCII_WORDS.findall(chunk)))
        if len(self) < self._limit:
            self[chunk] = packed
        return packed


class _PrintableChunkCache(dict):
    """Space-delimited chunk of printable text, as written (not lowercased) -> its ids as the
    bytes of a C int array. An ASCII chunk goes to the ASCII chunk cache (lowercased when
    uncased); any other runs the full ``tokenizers`` pipeline on the chunk alone, which gives the
    ids it has inside its sentence: in printable text the only whitespace is the space, and no
    step of BERT's normalization (NFC, accents, case, CJK spacing, the Final_Sigma rule) looks
    across a space. Stops growing at CHUNK_CACHE_SIZE."""

    def __init__(self, ascii_chunks: _ChunkCache, backend: Any, lowercase: bool,
                 limit: int = CHUNK_CACHE_SIZE) -> None:
        super().__init__()
        self._ascii_ids, self._encode, self._lowercase = ascii_chunks.__getitem__, backend.encode, lowercase
        self._limit = limit

    def __missing__(self, chunk: str) -> bytes:
        if chunk.isascii():
            packed = self._ascii_ids(chunk.lower() if self._lowercase else chunk)
        else:
            packed = array("i", self._encode(chunk, add_special_tokens=False).ids).tobytes()
        if len(self) < self._limit:
            self[chunk] = packed
        return packed


def _packed_ids(strings: Any, ids_of: dict[str, bytes]) -> tuple[Any, Any]:
    """Each string of a pyarrow string array looked up in ``ids_of`` (a cache of packed ids):
    how many ids each has (numpy int64) and all of them end to end (a pyarrow int32 array)."""
    import numpy as np
    import pyarrow as pa

    packed = list(map(ids_of.__getitem__, strings.to_pylist()))
    lengths = np.fromiter(map(len, packed), np.int64, len(packed)) // 4
    values = pa.Array.from_buffers(pa.int32(), int(lengths.sum()), [None, pa.py_buffer(b"".join(packed))])
    return lengths, values


def _take_ids(lengths: Any, values: Any, indices: Any) -> tuple[Any, Any]:
    """Row ``i`` holding ``lengths[i]`` of ``values`` (end to end), the rows at ``indices``: their
    lengths and their values end to end."""
    import numpy as np
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    return lengths[indices], rows.take(pa.array(indices)).flatten()


def _marked_text(sentences: Sequence[str]) -> str:
    """A document's sentences as one text, each followed by the NUL chunk that marks its end."""
    return " \x00 ".join(sentences) + " \x00"


class VocabError(ValueError, Refusal):
    """A vocab that cannot be made or used. The message names the file, the line and the fix."""


def parse_vocab(text: str, source: str = "vocab.txt") -> dict[str, int]:
    """``vocab.txt`` text -> {token: id}, id = line number (Google's ``load_vocab``).

    Refuses duplicate and empty tokens and a missing ``[UNK]``: each would silently shift or
    lose ids.
    """
    vocab: dict[str, int] = {}
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline after the last token
    for index, line in enumerate(lines):
        token = line.strip()
        if not token:
            raise VocabError(
                f"{source} line {index + 1}: empty token; a vocab has one non-empty token per line"
            )
        if token in vocab:
            raise VocabError(
                f"{source} line {index + 1}: duplicate token {token!r} (first on line "
                f"{vocab[token] + 1}); remove one so ids stay one per line"
            )
        vocab[token] = index
    if UNK not in vocab:
        raise VocabError(f"{source}: no {UNK} token; WordPiece needs it for unknown words")
    return vocab


def vocab_problems(vocab: dict[str, int]) -> list[str]:
    """What keeps a vocab from being a BERT pre-training vocab (empty list = usable)."""
    problems = [f"missing {t}" for t in SPECIAL_TOKENS if t not in vocab]
    if vocab.get(PAD, 0) != 0:
        problems.append(f"{PAD} has id {vocab[PAD]}, expected 0 (padding and the loss mask assume it)")
    if not any(t.startswith(SUBWORD_PREFIX) for t in vocab):
        problems.append("no '##' continuation pieces: not a WordPiece vocab")
    return problems


def bert_normalizer(lowercase: bool, strip_accents: bool | None = None) -> Any:
    """BERT's text normalization as a ``tokenizers`` normalizer (NFC, final sigma, clean text,
    CJK spacing, lowercase, strip accents; ``strip_accents=None`` follows ``lowercase``)."""
    from tokenizers import Regex, normalizers

    strip = lowercase if strip_accents is None else strip_accents
    steps = [normalizers.NFC()]
    if lowercase:
        # Python's str.lower() (Google, transformers) turns a word-final capital sigma into
        # "ς"; BertNormalizer lowercases char by char ("σ"). Mark final sigmas first.
        steps.append(normalizers.Replace(Regex(FINAL_SIGMA), "ς"))
    steps.append(normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip, lowercase=lowercase,
    ))
    return normalizers.Sequence(steps)


def bert_pre_tokenizer() -> Any:
    """BERT's split on whitespace and punctuation, as a ``tokenizers`` pre-tokenizer."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.BertPreTokenizer()


class Tokenizer:
    """BERT WordPiece tokenizer over a ``{token: id}`` vocab (see the module docstring).

    ASCII text takes a cached path past the full ``tokenizers`` pipeline, with the same ids; its
    speed is measured by ``benchmarks/speed/bench_tokenization.py`` (docs/benchmarks.md).
    """

    def __init__(
        self,
        vocab: dict[str, int],
        lowercase: bool = True,
        strip_accents: bool | None = None,
        max_input_chars_per_word: int = GOOGLE_MAX_INPUT_CHARS_PER_WORD,
    ) -> None:
        if UNK not in vocab:
            raise VocabError(f"the vocab has no {UNK} token; WordPiece needs it for unknown words")
        self.vocab = dict(vocab)
        self.lowercase = lowercase
        # None follows lowercase, as in BERT: uncased models strip accents, cased ones keep them.
        self.strip_accents = lowercase if strip_accents is None else strip_accents
        self.max_input_chars_per_word = max_input_chars_per_word
        self._ids_to_tokens = {i: t for t, i in self.vocab.items()}
        self.vocab_size = max(self.vocab.values()) + 1
        self.pad_id = self.vocab.get(PAD, 0)
        self.unk_id = self.vocab[UNK]
        self.cls_id = self.vocab.get(CLS, -1)
        self.sep_id = self.vocab.get(SEP, -1)
        self.mask_id = self.vocab.get(MASK, -1)
        self._backend = self._build_backend(special_tokens=False)
        words = _WordPieceCache(self._backend.model)
        # A vocab entry that is a whole ASCII word is its own WordPiece: no model call for it.
        limit = self.max_input_chars_per_word
        for token, token_id in self.vocab.items():
            if token.isascii() and token.isalnum() and len(token) <= limit and (
                    not self.lowercase or token == token.lower()):
                words[token] = array("i", [token_id]).tobytes()
        self._words = words
        self._chunks = _ChunkCache(words)
        self._printable_chunks = _PrintableChunkCache(self._chunks, self._backend, self.lowercase)
        for cache in (words, self._chunks, self._printable_chunks):  # see encode_document; never real text
            cache["\x00"] = array("i", [SENTENCE_END]).tobytes()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_vocab_file(
        cls,
        path_or_uri: str,
        lowercase: bool = True,
        strip_accents: bool | None = None,
        max_input_chars_per_word: int = GOOGLE_MAX_INPUT_CHARS_PER_WORD,
    ) -> Tokenizer:
        """A tokenizer over ``vocab.txt`` (local path or any fsspec URI)."""
        uri = str(path_or_uri)
        if not storage.exists(uri):
            raise VocabError(f"vocab file {uri} does not exist; pass the vocab.txt of a model or vocab stage")
        return cls(parse_vocab(storage.read_text(uri), source=uri), lowercase, strip_accents,
                   max_input_chars_per_word)

    @classmethod
    def from_pretrained_dir(cls, directory: str) -> Tokenizer:
        """A tokenizer for a model folder: ``vocab.txt`` plus casing from whatever is there.

        Casing comes from our ``_MANIFEST.json`` (vocab stage), else transformers'
        ``tokenizer_config.json`` (``do_lower_case``/``strip_accents``), else the normalizer in
        ``tokenizer.json``, else uncased (BERT's default).
        """
        settings = _casing_from_dir(directory)
        return cls.from_vocab_file(storage.join(directory, "vocab.txt"), **settings)

    def _build_backend(self, special_tokens: bool) -> Any:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, processors

        backend = HFTokenizer(
            models.WordPiece(
                vocab=self.vocab,
                unk_token=UNK,
                max_input_chars_per_word=self.max_input_chars_per_word,
                continuing_subword_prefix=SUBWORD_PREFIX,
            )
        )
        backend.normalizer = bert_normalizer(self.lowercase, self.strip_accents)
        backend.pre_tokenizer = bert_pre_tokenizer()
        backend.decoder = decoders.WordPiece(prefix=SUBWORD_PREFIX)
        if special_tokens:
            backend.add_special_tokens([t for t in SPECIAL_TOKENS if t in self.vocab])
            if CLS in self.vocab and SEP in self.vocab:
                backend.post_processor = processors.TemplateProcessing(
                    single=f"{CLS} $A {SEP}",
                    pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
                    special_tokens=[(CLS, self.cls_id), (SEP, self.sep_id)],
                )
        return backend

    # ------------------------------------------------------------------ tokenizing

    def tokenize(self, text: str) -> list[str]:
        return self._backend.encode(text, add_special_tokens=False).tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without ``[CLS]``/``[SEP]``."""
        if text.isascii():
            return self._encode_ascii(text)
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text. ASCII texts take the word-cache path (:meth:`_encode_ascii`,
        same ids as ``tokenizers``); the others go to ``tokenizers`` in one batch."""
        out: list[list[int]] = []
        others: list[int] = []
        encode_ascii = self._encode_ascii
        for text in texts:
            if text.isascii():
                out.append(encode_ascii(text))
            else:
                others.append(len(out))
                out.append([])
        if others:
            encoded = self._backend.encode_batch([texts[i] for i in others], add_special_tokens=False)
            for i, e in zip(others, encoded, strict=True):
                out[i] = e.ids
        return out

    def _encode_ascii(self, text: str) -> list[int]:
        """BERT's basic tokenizer on ASCII text: delete control characters, lowercase (uncased),
        split on whitespace (all C-speed string methods), then each chunk's ids from the chunk
        cache (punctuation split and WordPiece on a miss). The full ``tokenizers`` pipeline
        spends most of its time normalizing and splitting, which ASCII does not need."""
        if not text.isprintable():  # False for any control char, \t \n \r too: rare
            text = text.translate(_ASCII_CONTROL)
        if self.lowercase:
            text = text.lower()
        ids = array("i")
        ids.frombytes(b"".join(map(self._chunks.__getitem__, text.split())))
        return ids.tolist()

    def encode_document(self, sentences: Sequence[str]) -> tuple[Any, Any]:
        """A document's ids end to end and each sentence's length (0 for a sentence without
        tokens), as numpy int32 arrays."""
        import numpy as np

        ids = np.frombuffer(self.encode_document_bytes(sentences), dtype=np.intc)
        ends = np.flatnonzero(ids == SENTENCE_END)
        return (ids[ids != SENTENCE_END].astype(np.int32),
                (np.diff(ends, prepend=-1) - 1).astype(np.int32))

    def encode_document_bytes(self, sentences: Sequence[str]) -> bytes:
        """A document as the bytes of a C int array: each sentence's ids followed by
        SENTENCE_END (-1). What the instance job carries (one bytes value per document; the
        marks are stripped for a whole pool at once, see ``DocumentPool.from_marked``).

        A document of printable sentences (the common case) is one join, one ``split`` and one
        ``b"".join`` over a chunk cache, with a NUL chunk (which printable text cannot contain)
        marking each sentence's end: the ASCII chunk cache after one ``lower`` when the document
        is ASCII, else the printable chunk cache (:class:`_PrintableChunkCache`, whose misses on
        non-ASCII chunks run the full pipeline on the chunk). Anything else goes sentence by
        sentence. Many documents at once: :meth:`encode_documents_bytes`.
        """
        if not all(map(str.isprintable, sentences)):
            return self._sentences_bytes(sentences)
        if not sentences:
            return b""
        text = _marked_text(sentences)
        if not text.isascii():
            return b"".join(map(self._printable_chunks.__getitem__, text.split()))
        if self.lowercase:
            text = text.lower()
        return b"".join(map(self._chunks.__getitem__, text.split()))

    def encode_documents_bytes(self, documents: Sequence[Sequence[str]]) -> list[bytes]:
        """:meth:`encode_document_bytes` of each document (the same bytes), many at once: the
        printable documents through :meth:`_printable_texts_bytes`, the others sentence by
        sentence."""
        out: list[bytes] = [b""] * len(documents)
        rows, texts = [], []
        for i, sentences in enumerate(documents):
            if not all(map(str.isprintable, sentences)):
                out[i] = self._sentences_bytes(sentences)
            elif sentences:
                rows.append(i)
                texts.append(_marked_text(sentences))
        for i, packed in zip(rows, self._printable_texts_bytes(texts), strict=True):
            out[i] = packed
        return out

    def _printable_texts_bytes(self, texts: list[str]) -> list[bytes]:
        """Printable texts -> each one's ids as the bytes of a C int array, chunk by chunk
        (chunks between spaces) like :class:`_PrintableChunkCache`, each distinct chunk of the
        batch once: an ASCII chunk lowercased (uncased) and cut into words at punctuation, the
        words' ids from the word cache; any other chunk's from the printable chunk cache."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        if not texts:
            return []
        # an empty chunk (a run of spaces; beside a punctuation char once it is spaced) has no ids,
        # as str.split() would leave it out
        chunks = pc.ascii_split_whitespace(pa.array(texts, pa.large_string()))
        encoded = pc.dictionary_encode(chunks.flatten())
        distinct = encoded.dictionary
        is_ascii = pc.string_is_ascii(distinct).to_numpy(zero_copy_only=False)
        ascii_chunks = distinct.filter(is_ascii)
        if self.lowercase:
            ascii_chunks = pc.ascii_lower(ascii_chunks)
        words = pc.ascii_split_whitespace(pc.replace_substring_regex(ascii_chunks, *_SPACED_PUNCT))
        word_of = pc.dictionary_encode(words.flatten())
        word_lengths, word_ids = _take_ids(*_packed_ids(word_of.dictionary, self._words),
                                           word_of.indices.to_numpy())
        word_ends = np.concatenate([[0], np.cumsum(word_lengths)])  # ids before each word
        ascii_lengths = np.diff(word_ends[words.offsets.to_numpy()])
        other_lengths, other_ids = _packed_ids(distinct.filter(~is_ascii), self._printable_chunks)
        # the distinct chunks, ASCII ones first: where each one's ids are
        order = np.concatenate([np.flatnonzero(is_ascii), np.flatnonzero(~is_ascii)])
        place = np.empty(len(order), np.int64)
        place[order] = np.arange(len(order))
        lengths, ids = _take_ids(np.concatenate([ascii_lengths, other_lengths]),
                                 pa.concat_arrays([word_ids, other_ids]), place[encoded.indices.to_numpy()])
        before = np.zeros(len(lengths) + 1, np.int64)  # ids before each chunk (and after the last)
        np.cumsum(lengths, out=before[1:])
        bounds = (4 * before[chunks.offsets.to_numpy()]).tolist()  # each text's bytes
        data = np.asarray(ids).tobytes()
        return [data[a:b] for a, b in pairwise(bounds)]

    def _sentences_bytes(self, sentences: Sequence[str]) -> bytes:
        """A document sentence by sentence (:meth:`encode_batch`), each followed by SENTENCE_END."""
        out = array("i")
        for ids in self.encode_batch(sentences):
            out.extend(ids)
            out.append(SENTENCE_END)
        return out.tobytes()

    def encode_words(self, words: Sequence[str]) -> list[list[int]]:
        """Word pieces of each pre-split word (NER labels, word alignment); ``[]`` for a word
        that is all whitespace or control characters."""
        pieces: list[list[int]] = [[] for _ in words]
        if not words:
            return pieces
        encoding = self._backend.encode(list(words), is_pretokenized=True, add_special_tokens=False)
        for token_id, word in zip(encoding.ids, encoding.word_ids, strict=True):
            pieces[word].append(token_id)
        return pieces

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per token, ``(start, end)`` character offsets into the original ``text``."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        return [self.vocab.get(t, self.unk_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._ids_to_tokens.get(int(i), UNK) for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Readable text (``##`` pieces joined); for reports and debugging; it does not give back the original text."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    @staticmethod
    def is_subword(token: str) -> bool:
        return token.startswith(SUBWORD_PREFIX)

    # ------------------------------------------------------------------ saving

    def vocab_text(self) -> str:
        """``vocab.txt`` contents: one token per line, id = line number."""
        return "".join(self._ids_to_tokens[i] + "\n" for i in range(self.vocab_size))

    def to_hf_json(self) -> str:
        """``tokenizer.json`` for transformers/tokenizers users: same pipeline, with the special
        tokens registered and ``[CLS] A [SEP] B [SEP]`` post-processing."""
        return self._build_backend(special_tokens=True).to_str(pretty=True)

    def save(self, directory: str) -> None:
        """Write ``vocab.txt`` and ``tokenizer.json`` into ``directory``."""
        storage.write_text(storage.join(directory, "vocab.txt"), self.vocab_text())
        storage.write_text(storage.join(directory, "tokenizer.json"), self.to_hf_json())

    def settings(self) -> dict[str, Any]:
        """Casing and limits, as recorded in the vocab stage's manifest."""
        return {
            "lowercase": self.lowercase,
            "strip_accents": self.strip_accents,
            "max_input_chars_per_word": self.max_input_chars_per_word,
        }

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, lowercase={self.lowercase}, "
                f"strip_accents={self.strip_accents})")


def _casing_from_dir(directory: str) -> dict[str, Any]:
    manifest_uri = storage.join(directory, storage.MANIFEST)
    if storage.exists(manifest_uri):
        config = json.loads(storage.read_text(manifest_uri)).get("config", {})
        if "lowercase" in config:
            return {k: config[k] for k in ("lowercase", "strip_accents", "max_input_chars_per_word")
                    if config.get(k) is not None}
    config_uri = storage.join(directory, "tokenizer_config.json")
    if storage.exists(config_uri):
        config = json.loads(storage.read_text(config_uri))
        if "do_lower_case" in config:
            return {"lowercase": bool(config["do_lower_case"]), "strip_accents": config.get("strip_accents")}
    json_uri = storage.join(directory, "tokenizer.json")
    if storage.exists(json_uri):
        normalizer = json.loads(storage.read_text(json_uri)).get("normalizer") or {}
        for step in normalizer.get("normalizers", [normalizer]):
            if step.get("type") == "BertNormalizer":
                return {"lowercase": bool(step.get("lowercase", True)),
                        "strip_accents": step.get("strip_accents")}
    return {"lowercase": True}


def load_tokenizer(uri: str, lowercase: bool | None = None) -> Tokenizer:
    """The tokenizer of a vocab stage folder, a model folder or a ``vocab.txt`` (any fsspec URI).

    A ``vocab.txt`` takes its casing from ``lowercase`` (uncased when None). A folder takes it
    from what it holds (see ``Tokenizer.from_pretrained_dir``); a folder that is neither a model
    (``config.json`` / ``tokenizer_config.json``) nor a finished vocab stage is refused as an
    unfinished write.
    """
    uri = str(uri)
    if uri.endswith(".txt"):
        return Tokenizer.from_vocab_file(uri, lowercase=True if lowercase is None else lowercase)
    is_model = any(storage.exists(storage.join(uri, name)) for name in ("config.json", "tokenizer_config.json"))
    if not is_model:
        storage.read_manifest(uri)  # refuses an unfinished write
    return Tokenizer.from_pretrained_dir(uri)


def check_vocab_file(uri: str, cfg: VocabConfig) -> Tokenizer:
    """The tokenizer of an existing vocab, or :class:`VocabError` saying what is wrong with it."""
    if not storage.exists(uri):
        raise VocabError(f"--vocab-file {uri} does not exist; give the vocab.txt of a BERT model")
    vocab = parse_vocab(storage.read_text(uri), source=uri)
    problems = vocab_problems(vocab)
    # A wrong casing setting silently ruins a model: uncased text on a cased vocab never uses the
    # capitalised tokens, cased text on an uncased vocab turns every capital into [UNK].
    letters = [t for t in vocab if any(c.isalpha() for c in t) and not t.startswith("[")]
    upper = sum(1 for t in letters if any(c.isupper() for c in t))
    if not cfg.lowercase and letters and upper / len(letters) < 0.001:
        problems.append(f"only {upper} of {len(letters)} tokens have uppercase letters (an uncased "
                        "vocab) but vocab.lowercase is false; set vocab.lowercase=true")
    if cfg.lowercase and letters and upper / len(letters) > 0.05:
        problems.append(f"{upper} of {len(letters)} tokens have uppercase letters (a cased vocab) but "
                        "vocab.lowercase is true; set vocab.lowercase=false")
    if problems:
        raise VocabError(f"--vocab-file {uri} is not a usable BERT vocab: " + "; ".join(problems))
    return Tokenizer(vocab, cfg.lowercase, cfg.do_strip_accents, cfg.max_input_chars_per_word)
