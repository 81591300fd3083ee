"""bert_core/corpus/wikitext.py: markup handling rule by rule, and the real enwiki excerpt end to end."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from bert_core.corpus.wikitext import (
    MARKUP,
    CleanStats,
    _clean_paragraph,
    _paragraph_lines,
    has_markup,
    is_redirect,
    prescan,
    wikitext_to_paragraphs,
)
from flows.tools.samples import wikipedia_xml

NS = "{http://www.mediawiki.org/xml/export-0.10/}"


def test_links_keep_their_text_and_nonprose_links_go() -> None:
    text = ("'''Anarchism''' is a [[political philosophy]] of [[self-governance|self-governed]] "
            "[[bus]]es.[[File:A.jpg|thumb|A [[caption]] link]] [[Category:Anarchism]] [[de:Anarchismus]] "
            "See [[wikt:anarchy|anarchy]] and [[Paris, Texas|]].")
    assert wikitext_to_paragraphs(text) == [
        "Anarchism is a political philosophy of self-governed buses. See anarchy and Paris."]


def test_templates_refs_tables_comments_math_are_cut_with_nesting() -> None:
    text = ("Intro{{Infobox|name={{nested|x}}|y=[[z]]}} text<ref name=a>{{cite|t}} [[w]]</ref> goes "
            "on<ref name=b/>.<!-- hidden [[link]] --> Area is <math>\\pi r^2</math> here.\n"
            "{| class=wikitable\n|-\n| cell || {{t}}\n|}\nAfter the table.")
    assert wikitext_to_paragraphs(text) == ["Intro text goes on. Area is here.", "After the table."]


def test_text_after_an_image_at_a_line_start_is_kept() -> None:
    # cutting the image leaves a leading space; only a space in the raw text means "preformatted"
    text = "[[File:Squat.jpg|thumb|The [[squat]] roof]] A surge of interest came.\n code sample"
    assert wikitext_to_paragraphs(text) == ["A surge of interest came."]


def test_headings_lists_and_paragraph_boundaries() -> None:
    text = ("First line\nsame paragraph.\n\n== History ==\nSecond paragraph.\n* a list item\n"
            "# numbered\n; term\n: An indented definition.\n:<math>x^2</math>\n----\n code block\nThird.")
    assert wikitext_to_paragraphs(text) == [
        "First line same paragraph.", "Second paragraph.", "An indented definition.", "Third."]


def test_inline_markup_entities_and_external_links() -> None:
    text = ("''Italic'' and '''bold''' with&nbsp;space, H<sub>2</sub>O, "
            "[http://example.org the site] and [http://bare.org] __NOTOC__ end.")
    assert wikitext_to_paragraphs(text) == ["Italic and bold with space, H2O, the site and end."]


def test_unclosed_markup_does_not_swallow_the_page() -> None:
    text = "Broken {{template\nstill broken\n\nNext paragraph survives.<ref>never closed\n\nLast one."
    assert wikitext_to_paragraphs(text) == ["Broken", "Next paragraph survives.", "Last one."]


def test_template_only_page_has_no_text_and_redirects_are_seen() -> None:
    assert wikitext_to_paragraphs("{{Infobox|a=1}}\n{{Navbox|b=[[c]]}}\n[[Category:X]]") == []
    assert is_redirect("#REDIRECT [[Computer accessibility]]") and not is_redirect("Text")


def test_residue_goes_through_mwparserfromhell() -> None:
    stats = CleanStats()
    # a ''' inside a link label survives the fast pass's simple rules only as '' residue
    out = wikitext_to_paragraphs("A {{{{{1}}}}} param and text [[a|b''c'']] here.", stats)
    assert not any(has_markup(p) for p in out)
    assert prescan("x{{a}}y") == "xy"


def test_markup_the_slow_path_leaves_is_dropped_and_counted() -> None:
    # "==" inside a line is no heading: the fast pass keeps it, and so does mwparserfromhell
    stats = CleanStats()
    out = wikitext_to_paragraphs("Intro [[a|b]] here.\n\nIn the code a == b tests equality. The test is cheap.",
                                 stats)
    assert out == ["Intro b here.", "The test is cheap."]
    assert (stats.slow_paragraphs, stats.dropped_markup_sentences) == (1, 1)
    stats = CleanStats()
    assert wikitext_to_paragraphs("Only x == y here.", stats) == []
    assert stats.dropped_markup_sentences == 1


@pytest.fixture(scope="module")
def articles(samples_dir) -> list[tuple[str, str]]:
    root = ET.fromstring(wikipedia_xml(samples_dir))
    pages = []
    for page in root.iter(NS + "page"):
        text = page.find(f"{NS}revision/{NS}text").text or ""
        if page.find(NS + "ns").text == "0" and not is_redirect(text):
            pages.append((page.find(NS + "title").text, text))
    return pages


def test_real_excerpt_has_no_markup_residue(articles) -> None:
    assert len(articles) == 106
    stats = CleanStats()
    cleaned = {title: wikitext_to_paragraphs(text, stats) for title, text in articles}
    residue = [(t, m) for t, ps in cleaned.items() for p in ps for m in MARKUP if m in p]
    assert residue == []
    with_text = [t for t, ps in cleaned.items() if ps]
    assert len(with_text) >= 105  # only 'List of anthropologists' is all list
    anarchism = " ".join(cleaned["Anarchism"])
    assert anarchism.startswith("Anarchism is a political philosophy that advocates self-governed societies")
    assert "<ref" not in anarchism and "Category" not in anarchism and "thumb|" not in anarchism


def test_prose_after_a_template_closed_on_a_line_starting_with_a_space() -> None:
    # multi-line citations end on a line " }}</ref> ...": the space is inside the template's
    # call, so the prose after it is no preformatted code; a real code line still goes
    text = ("War.<ref>{{Cite book\n |last=Beevor\n |year=2006\n }}</ref> The CNT was affiliated "
            "with the IWA.\n code line\nNext.")
    assert wikitext_to_paragraphs(text) == ["War. The CNT was affiliated with the IWA.", "Next."]
    assert wikitext_to_paragraphs("A fact.{{sfn|Smith\n  }} More prose.") == ["A fact. More prose."]


def _every_paragraph_cleaned(wikitext: str, stats: CleanStats) -> list[str]:
    """wikitext_to_paragraphs without its screen: every paragraph through the cleaning."""
    cleaned = (_clean_paragraph(raw, stats) for raw in _paragraph_lines(prescan(wikitext)))
    return [text for text in cleaned if text]


TRICKY = ["[[a|b]] c", "x  y", "x , y", "a (  ) b", "a ( ; ) b", "''it''", "== H ==", "a & b",
          "&amp; x", "__TOC__ y", "see http://x.org/a b", "{{t}} x", "a | b", "a } b", "a ] b",
          "x\u00a0y", "x\ty", "tail #", "# head", "a ==b", "a:/b", "'' ", "a <b> c", "ok. Fine!"]


def test_the_paragraph_screen_sends_every_paragraph_the_cleaning_changes(articles) -> None:
    # the real excerpt, and paragraphs built of every trigger alone and in pairs, joined or apart
    pages = [text for _, text in articles]
    pages += ["\n\n".join(TRICKY)] + [f"Some text {a}{b} more.\n\nPlain line.\n\n{b} end" for a in TRICKY
                                      for b in TRICKY]
    for page in pages:
        fast, exact = CleanStats(), CleanStats()
        assert wikitext_to_paragraphs(page, fast) == _every_paragraph_cleaned(page, exact)
        assert fast.dropped_markup_sentences == exact.dropped_markup_sentences
