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


CHOICE = "We can take a card on the day, or email you a payment link. Which would you prefer?"


@pytest.mark.parametrize("answer,wish", [("Payment link.", "Payment link"), ("Bank transfer, please.", "Bank transfer"),
                                         ("Mornings. I'm out after lunch.", "Mornings")])
def test_a_short_answer_to_a_question_about_what_the_user_wants_is_a_preference(answer, wish):
    assert ("preference", wish) in {(s.type, s.text) for s in MARKER.mark(answer, prompt=CHOICE)}


@pytest.mark.parametrize("answer,prompt", [("Payment link.", None), ("Payment link.", "The engineer arrives at nine."),
                                           ("Yes please.", CHOICE), ("Two years.", "How many years would you like?")])
def test_without_a_question_about_a_wish_or_with_a_yes_or_a_count_a_short_answer_is_not_one(answer, prompt):
    assert not any(s.type == "preference" for s in MARKER.mark(answer, prompt=prompt))


def test_a_short_answer_that_is_only_a_time_is_the_time():
    assert [(s.type, s.text) for s in MARKER.mark("2pm.", prompt="Which suits you, 10am or 2pm?")] == [("date", "2pm")]


def test_mark_dialogue_passes_each_turn_the_reply_before_it():
    turns, replies = ["I'd like to pay the balance.", "Payment link."], [None, CHOICE]
    assert [s.text for s in MARKER.mark_dialogue(turns, replies=replies)[1]] == ["Payment link"]
    assert MARKER.mark_dialogue(turns)[1] == []


def test_a_name_the_agent_gave_first_is_not_the_users_fact():
    turns, replies = ["When is the visit?", "Can Kieran bring the part?"], [None, "Kieran will come on Monday."]
    assert MARKER.mark_dialogue(turns, replies=replies)[1] == []
    assert [s.text for s in MARKER.mark_dialogue(turns)[1]] == ["Kieran"]


@pytest.mark.parametrize("text,wish", [("Weekday daytimes only, evenings are work.", "Weekday daytimes only"),
                                       ("Any day except a Friday though.", "Any day except a Friday though"),
                                       ("Midnight it is for the doors.", "Midnight it is for the doors"),
                                       ("Bill it to me, not her.", "Bill it to me, not her"),
                                       ("Induction hob please, definitely not gas.", "Induction hob")])
def test_wishes_without_prefer_or_please_at_the_end(text, wish):
    assert ("preference", wish) in marked(text)


@pytest.mark.parametrize("text", ["Please do not place me with a family that keeps cats.",
                                  "Nothing with nuts, one of the investors has an allergy.",
                                  "Absolutely no wood anywhere near the cooking."])
def test_more_ways_to_say_a_taboo(text):
    assert of_type(text, "taboo")


@pytest.mark.parametrize("text", ["Don't worry, I'll wait.", "The charge should never have been made.",
                                  "Is there any number you mustn't use?", "Book it, please."])
def test_not_taboos_or_preferences(text):
    assert not any(kind in ("taboo", "preference") for kind, _ in marked(text))


def test_a_form_of_address_is_a_preference_not_a_name():
    assert marked("Oh, and please call me Mo.") == {("preference", "please call me Mo")}
    assert ("preference", "I expect to be addressed as Mrs Corrigan") in marked(
        "I expect to be addressed as Mrs Corrigan, not by my first name.")


def test_day_abbreviations_and_family_words_are_not_names():
    assert of_type("Mon, Tues and Thurs ideally, and Mum can do Fridays.", "identity") == []


def test_flats_and_lower_case_addresses():
    assert of_type("flat 2, 41 mercer st, brackley nn13 6hd", "address") == ["flat 2, 41 mercer st, brackley nn13 6hd"]
    assert of_type("Correction: it's Flat 14, not Flat 4.", "address") == ["Flat 14"]
    assert of_type("Gate PIN 5174 is too close to my card PIN.", "address") == []


def test_training_the_clause_model_saves_it_only_where_told(tmp_path):
    """`palace train --what persistence` measures the clause model against the rules; without --out it leaves
    the agent's models folder alone (a model there would replace the rules every agent runs)."""
    from classifiers.annotations import train_persistence
    from classifiers.persistence import DEFAULT_MODEL, PreferenceModel
    from classifiers.train import ROOT

    dev, lines = ROOT / "data" / "dev", []
    there = DEFAULT_MODEL.exists()
    report = train_persistence([str(dev)], [str(dev / "dev-01.jsonl")], None, lines.append)
    assert DEFAULT_MODEL.exists() == there and "not saved" in lines[0]
    assert set(report) == {"model", "rules"} and report["rules"]["identity"]["gold"] > 0
    out = tmp_path / "clauses.json"
    train_persistence([str(dev)], [str(dev / "dev-01.jsonl")], str(out), lines.append)
    assert PreferenceModel.load(out).predict(["please never phone me"])[0] in ("preference", "taboo", "none")
