"""The chapter-length counter: what counts as prose, where a sentence ends, and the budget a chapter's
core is held to (tests/test_course.py applies it to every chapter)."""
import pytest

from minitorch_dist.course import readability as R

pytestmark = pytest.mark.ch00


def test_code_math_tables_figures_and_headings_are_not_prose():
    text = ("# Title words here\n\nOne two three.\n\n```python\nx = costmodel.f(1, 2)\n```\n\n"
            "$$a + b = c$$\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![a figure](figures/ch00_x.svg)\n\n"
            "<details>hidden four</details>\n")
    assert R.sentences(text) == ["One two three.", "hidden four"]


def test_a_sentence_ends_at_a_stop_before_a_capital_and_not_after_an_abbreviation():
    text = "Narayanan et al. 2021 split it. Then 8 ranks, e.g. Two more? Yes! And a < b, b > a here."
    assert R.sentences(text) == ["Narayanan et al. 2021 split it.", "Then 8 ranks, e.g. Two more?", "Yes!",
                                 "And a < b, b > a here."]


def test_list_items_and_paragraphs_end_sentences_and_a_link_keeps_its_text():
    text = "- first item\n- second [linked words](x.md) item\n\nA paragraph\nwrapped on two lines\n"
    assert R.sentences(text) == ["first item", "second linked words item", "A paragraph wrapped on two lines"]


def test_the_core_stops_at_the_worked_problems():
    r = R.reading("Intro here.\n\n## Worked problems\n\nNot counted at all.\n")
    assert (r.words, r.sentences) == (2, 1)


@pytest.mark.parametrize("words, sentences, problems", [
    (R.CORE_WORDS, R.CORE_WORDS // R.SENTENCE_WORDS + 1, 0),
    (R.CORE_WORDS + 1, R.CORE_WORDS, 1),
    (100, 100 // (R.SENTENCE_WORDS + 1), 1),
])
def test_the_budget(words, sentences, problems):
    assert len(R.Reading(words, sentences).problems("x.md")) == problems


def test_every_chapter_is_within_the_budget(capsys):
    assert R.main([]) == 0, capsys.readouterr().err
