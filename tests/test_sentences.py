"""bert_core/corpus/sentences.py: abbreviations, initials, decimals, quotes, ellipses."""

from __future__ import annotations

import pytest

from bert_core.corpus.sentences import split_paragraphs, split_sentences

CASES = [
    ("Dr. Smith arrived at 3.30 p.m. on Monday. \"Hello!\" he said. It was 2.5 km.",
     ["Dr. Smith arrived at 3.30 p.m. on Monday.", "\"Hello!\" he said.", "It was 2.5 km."]),
    ("He lived in the U.S. for years. Then he left.", ["He lived in the U.S. for years.", "Then he left."]),
    ("See Fig. 3 and No. 5, e.g. the second. It is clear.",
     ["See Fig. 3 and No. 5, e.g. the second.", "It is clear."]),
    ("He said no. The end.", ["He said no.", "The end."]),
    ("J. R. R. Tolkien wrote it. \"Really?\" Yes.", ["J. R. R. Tolkien wrote it.", "\"Really?\"", "Yes."]),
    ("Apples, pears, etc. Many fruit. Wait... What?", ["Apples, pears, etc.", "Many fruit.", "Wait...", "What?"]),
    ("He left at 5 p.m. The next day he came.", ["He left at 5 p.m.", "The next day he came."]),
    ("She said, \u201cI am done.\u201d Then she left (quietly.) Later, i.e. soon, more.",
     ["She said, \u201cI am done.\u201d", "Then she left (quietly.)", "Later, i.e. soon, more."]),
    ("Pi is 3.14159 and e is 2.718.", ["Pi is 3.14159 and e is 2.718."]),
    ("Mr. and Mrs. Jones met Prof. Lee vs. Gen. Grant in St. Louis.",
     ["Mr. and Mrs. Jones met Prof. Lee vs. Gen. Grant in St. Louis."]),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_text_is_kept_whole_and_paragraphs_end_sentences() -> None:
    paragraphs = ["One sentence without a stop", "Two. Three!"]
    out = split_paragraphs(paragraphs)
    assert out == ["One sentence without a stop", "Two.", "Three!"]
    assert "".join(out).replace(" ", "") == "".join(paragraphs).replace(" ", "")
    assert split_sentences("   ") == []


def test_real_book_sentences_look_like_sentences(samples_dir) -> None:
    from bert_core.corpus.books import book_paragraphs

    _, paragraphs = book_paragraphs("botchan.txt", (samples_dir / "books" / "botchan.txt").read_bytes())
    sentences = split_paragraphs(paragraphs)
    assert len(sentences) > 2500
    assert not [s for s in sentences if s.endswith((" Mr.", " Dr.", " Mrs."))]
    # most sentences start with a capital or an opening quote
    starts = sum(s[0].isupper() or s[0] in "\"'(" for s in sentences)
    assert starts / len(sentences) > 0.95


def test_the_period_only_search_finds_what_the_general_one_does(samples_dir) -> None:
    from bert_core.corpus.sentences import _BOUNDARY, _PERIOD_BOUNDARY

    lines = [line for path in sorted((samples_dir / "books").glob("*.txt"))
             for line in path.read_text("utf-8").splitlines()]
    lines += ["a.b. C", "x ... Y", "end.", ". Start", "e.g.  Z", "U.S.A.) The", 'him." She', "a..  b. C"]
    periods = [line for line in lines if not any(mark in line for mark in "!?\u2026")]
    assert len(periods) > 1000
    for line in periods:
        assert [m.span() for m in _PERIOD_BOUNDARY.finditer(line)] == [m.span() for m in _BOUNDARY.finditer(line)]
