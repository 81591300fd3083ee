"""bert_core/corpus/books.py: Gutenberg boilerplate, unwrapping, Markdown plays, files that are not books."""

from __future__ import annotations

import pytest

from bert_core.corpus.books import (
    BookError,
    book_paragraphs,
    book_stem,
    play_paragraphs,
    strip_gutenberg,
    unwrap,
)

GUTENBERG = """The Project Gutenberg EBook of Tiny Tales
Title: Tiny Tales
*** START OF THIS PROJECT GUTENBERG EBOOK TINY TALES ***
Produced by Somebody

CHAPTER I

It was a dark and stormy night; the rain fell in
torrents, except at occasional intervals.

Then the wind rose and the lamps flickered along
the street.
*** END OF THIS PROJECT GUTENBERG EBOOK TINY TALES ***
Licence text that must go.
"""


def test_gutenberg_header_footer_and_unwrap() -> None:
    title, paragraphs = book_paragraphs("/x/tiny.txt", GUTENBERG.encode())
    assert title == "Tiny Tales"
    assert paragraphs == [
        "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals.",
        "Then the wind rose and the lamps flickered along the street.",
    ]
    assert "Licence" not in strip_gutenberg(GUTENBERG) and "Produced" not in strip_gutenberg(GUTENBERG)


def test_unwrap_without_blank_lines_uses_short_lines() -> None:
    text = ("This is a long wrapped line of a book that goes on and\n"
            "on until it reaches the wrap width of the text file ok\n"
            "and ends here.\n"
            "A new paragraph starts on the next line and it is long\n"
            "too.\n")
    assert unwrap(text) == [
        "This is a long wrapped line of a book that goes on and on until it reaches the wrap width "
        "of the text file ok and ends here.",
        "A new paragraph starts on the next line and it is long too.",
    ]


def test_markdown_play_becomes_speeches() -> None:
    md = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO and\nFRANCISCO_\n\n"
          "**BERNARDO**  \nWho's there?\n\n**FRANCISCO**  \n_\\[Aside]_  \nNay, answer me: stand,  \n"
          "and unfold yourself.\\--\n\n_Exeunt_\n")
    title, paragraphs = play_paragraphs(md)
    assert title == "Hamlet"
    assert paragraphs == ["Who's there?", "Nay, answer me: stand, and unfold yourself.--"]


def test_real_play_and_book(samples_dir) -> None:
    title, paragraphs = book_paragraphs("hamlet.md", (samples_dir / "plays" / "hamlet.md").read_bytes())
    text = " ".join(paragraphs)
    assert title == "Hamlet" and len(paragraphs) > 1000
    assert not any(c in text for c in "_*#\\") and "HAMLET" not in text.split(" ")[:3]
    title, paragraphs = book_paragraphs("botchan.txt", (samples_dir / "books" / "botchan.txt").read_bytes())
    text = " ".join(paragraphs)
    assert title == "Botchan (Master Darling)"
    assert "Gutenberg" not in text and "\n" not in text
    assert text.count("Kiyo") > 50


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "empty_file"),
    (b"  \n\n", "empty_file"),
    (bytes(range(256)) * 40, "binary_file"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 100, "binary_file"),
    ("Caf\u00e9 au lait.\n".encode("latin-1") * 3, "invalid_utf8"),
    (b"word " * 30_000, "line_too_long"),
])
def test_files_that_are_not_books(data: bytes, reason: str) -> None:
    with pytest.raises(BookError) as err:
        book_paragraphs("/books/x.txt", data)
    assert err.value.reason == reason and "/books/x.txt" in err.value.detail


def test_utf16_and_crlf_books_are_read() -> None:
    text = "One line of text.\r\nMore text.\r\n"
    _, paragraphs = book_paragraphs("t.txt", text.encode("utf-16"))
    assert paragraphs == ["One line of text. More text."]
    assert book_stem("gs://b/x/botchan.txt.gz") == "botchan"
