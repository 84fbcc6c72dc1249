"""The persistence marker's rules (issue 11): which spans of a user turn must survive. Made-up sentences, the
real marker with the cue rules (no clause model)."""

from __future__ import annotations

import pytest

from classifiers.persistence import PersistenceMarker, Span

MARKER = PersistenceMarker(None)


def marked(text: str) -> set[tuple[str, str]]:
    return {(span.type, span.text) for span in MARKER.mark(text)}


def of_type(text: str, kind: str) -> list[str]:
    return [span.text for span in MARKER.mark(text) if span.type == kind]


def test_stated_references_are_identity():
    spans = {(s.type, s.attribute, s.text) for s in MARKER.mark("Hello, it's about booking reference QT-58107-B.")}
    assert ("identity", "booking reference", "QT-58107-B") in spans
    assert ("identity", "4821") in marked("Take it from the card ending 4821.")


def test_a_sentence_that_opens_with_a_full_name_marks_it():
    assert ("identity", "Priya Raman") in marked("Priya Raman, 22 Elm Grove, Norwich NR2 3AB.")


def test_places_makes_and_the_agent_are_not_identity_but_an_owned_product_is():
    assert of_type("We're driving to Penzance in a Vauxhall next month.", "identity") == []
    assert of_type("That's everything, thanks Morwenna.", "identity") == []
    assert of_type("I also bought the Orbita kettle from you.", "identity") == ["Orbita"]


@pytest.mark.parametrize("text", ["Please never call me at work.", "Do not ring me before nine.",
                                  "No marketing emails at all, thank you.", "She's allergic to sesame."])
def test_a_request_not_to_is_a_taboo(text):
    assert of_type(text, "taboo")


@pytest.mark.parametrize("text", ["I can never remember my PIN.", "My husband never checks his email.",
                                  "I can't find the receipt anywhere.", "We won't be home until late."])
def test_a_description_is_not_a_taboo(text):
    assert not any(kind in ("taboo", "preference") for kind, _ in marked(text))


def test_a_question_about_what_was_said_marks_nothing():
    assert MARKER.mark("What's your phone number?") == []
    assert MARKER.mark("Which email did I tell you never to use?") == []
    assert MARKER.mark("If you need to call me about it, what number do you have?") == []


def test_a_time_inside_a_taboo_is_part_of_it_not_a_date():
    spans = MARKER.mark("Never ring before 9am, please.")
    assert [s.type for s in spans] == ["taboo"] and "9am" in spans[0].text


def test_dates_need_a_day_of_the_month():
    assert of_type("I was in all day on Tuesday.", "date") == []
    assert of_type("Can the engineer come on Tuesday 14 May?", "date") == ["Tuesday 14 May"]
    assert of_type("The payment goes out on the first of June.", "date") == ["the first of June"]


def test_in_a_correction_only_the_right_value_is_marked():
    assert of_type("Sorry, it's 07700 900123, not 07700 900132.", "contact") == ["07700 900123"]


@pytest.mark.parametrize("text,wish", [("Texts, not calls.", "Texts, not calls"),
                                       ("Paper invoices, please.", "Paper invoices"),
                                       ("Email is best for me.", "Email is best for me")])
def test_short_and_contrasted_wishes_are_preferences(text, wish):
    assert ("preference", wish) in marked(text)


def test_a_request_that_only_hands_over_a_value_is_the_value():
    assert marked("Please use jo.bell@example.org.") == {("contact", "jo.bell@example.org")}


def test_a_restated_value_is_not_marked_again_but_a_wish_is():
    turns = ["My account number is 44817263 and please never phone me.",
             "Is account 44817263 still open? Please never phone me.",
             "We stayed near Kendrick Abbey.", "Kendrick Abbey, my sister's house, is the address for parcels."]
    spans: list[list[Span]] = MARKER.mark_dialogue(turns)
    assert ("identity", "44817263") in {(s.type, s.text) for s in spans[0]}
    assert [s.type for s in spans[1]] == ["taboo"]
    assert not any(s.type == "identity" for s in spans[3])  # said before, even where it was not marked
