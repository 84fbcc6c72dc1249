"""What must persist (issue 11): the persistence marker, the entity graph's facts and corrections, rule
coreference, and the notes (profile and running summary) that live in the permanent tier as KV. Real
components: the rules and the scikit-learn clause model, networkx, the embedded SmolLM2 and MiniLM."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agent import Agent, AgentConfig
from agent.agent import NOTES_TURN
from agent.model import load_model
from classifiers.persistence import PersistenceMarker, PreferenceModel
from memory.graph import EntityGraph
from memory.profile import ProfileConfig, render
from memory.recall import MemoryConfig
from memory.summaries import RunningSummary
from tests.helpers import ask, teacher_force


def rules_graph(*turns: tuple[int, str] | tuple[int, str, str]) -> EntityGraph:
    """A graph with the cue rules, after these (turn, user text[, reply]) turns."""
    graph = EntityGraph(PersistenceMarker(None))
    for turn, user, *reply in turns:
        graph.observe(turn, user)
        for text in reply:
            graph.mention(turn, text)
    return graph


def test_a_stated_order_number_and_contact_details_are_marked_persistent():
    text = "Hi, my name is Freya Moreau, order number KL-20931. Please never phone me; email freya.m@example.org."
    spans = {(s.type, s.attribute, s.text) for s in PersistenceMarker(None).mark(text)}
    assert ("identity", "order reference", "KL-20931") in spans
    assert ("identity", "name", "Freya Moreau") in spans
    assert ("contact", "email", "freya.m@example.org") in spans
    assert any(kind == "taboo" and "never phone me" in value for kind, _, value in spans)
    assert not PersistenceMarker(None).mark("What are your opening hours on a bank holiday?")


def test_over_a_dialogue_a_value_is_marked_where_it_is_first_stated_and_wishes_wherever_said():
    turns = ["I'm Freya Moreau, order KL-20931.", "Has KL-20931 shipped yet? Please never phone me.",
             "It's in the name of Freya, yes. Please never phone me, as I said.", "Can it go to 37 Larch Close, Bristol BS3 4QT?"]
    marked = PersistenceMarker(None).mark_dialogue(turns)
    values = [[s.text for s in spans if s.type not in ("preference", "taboo")] for spans in marked]
    assert "KL-20931" in values[0] and "Freya Moreau" in values[0]
    assert "KL-20931" not in values[1] and not any("Freya" in v for v in values[2])  # named again: no new fact
    assert any("Larch Close" in v for v in values[3])
    assert [any(s.type == "taboo" for s in spans) for spans in marked] == [False, True, True, False]
    assert [s.text for s in marked[1] if s.type != "taboo"] == []


def test_a_corrected_address_supersedes_the_old_one_which_stays_queryable():
    graph = rules_graph()
    graph.observe(0, "I'm Dana Whitfield and we live at 37 Larch Close, Bristol BS3 4QT.")
    graph.observe(4, "Sorry, wrong address: it's 70 Poplar Lane, Bristol BS3 4QT, not 37 Larch Close.")
    current = {(f.attribute, f.value) for f in graph.current_facts()}
    assert ("address", "70 Poplar Lane, Bristol BS3 4QT") in current
    assert not any("Larch" in value for _, value in current)
    old = [f for f in graph.superseded() if "Larch" in f.value]
    assert old and old[0].valid_from_turn == 0 and old[0].invalid_from_turn == 4
    assert old[0].superseded_by == "70 Poplar Lane, Bristol BS3 4QT"
    edge = next(d for _, _, d in graph.graph.out_edges("user", data=True)
                if d["kind"] == "fact" and d["valid_from_turn"] == 0 and d["attribute"] == "address")
    assert edge["invalid_from_turn"] == 4  # the edge is kept, its validity closed

    profile = render(graph, None, lambda text: len(text.split()), cap=60)
    assert "Address: 70 Poplar Lane, Bristol BS3 4QT (corrected)" in profile and "Larch" not in profile
    detailed = render(graph, None, lambda text: len(text.split()), cap=60, superseded=True)
    assert "Address: 70 Poplar Lane, Bristol BS3 4QT (corrected, not 37 Larch Close, Bristol BS3 4QT)" in detailed


def test_a_partial_correction_patches_the_value_it_denies():
    graph = rules_graph()
    graph.observe(0, "We're at 14 Larkspur Close, Otley, LS21 2QE now.")
    graph.observe(1, "Oh, sorry, it's 2QF, not 2QE.")
    assert "14 Larkspur Close, Otley, LS21 2QF" in {f.value for f in graph.current_facts()}
    assert "14 Larkspur Close, Otley, LS21 2QE" in {f.value for f in graph.superseded()}


def test_a_piece_repeated_with_its_neighbour_or_written_whole_patches_only_that_piece():
    """"BR4 7TW, not BR4 7TN" patches the postcode, not the whole address; "RW-5X28-QT, not 5X82" is the
    whole code written around the denied piece. What the cache may then drop is just the changed pieces."""
    graph = rules_graph((0, "The new one is 6 Saltmarsh Close, Brindlow, BR4 7TN."),
                        (1, "My cycle scheme certificate has code RW-5X82-QT, with a limit of £2,500."),
                        (4, "I gave you the wrong postcode: it's BR4 7TW, not BR4 7TN."),
                        (6, "I misread the certificate code. It's RW-5X28-QT, not 5X82. Sorry."))
    assert [(f.value, f.superseded_by) for f in graph.superseded()] == [
        ("6 Saltmarsh Close, Brindlow, BR4 7TN", "6 Saltmarsh Close, Brindlow, BR4 7TW"), ("RW-5X82-QT", "RW-5X28-QT")]
    assert graph.stale() == ["7TN", "RW-5X82-QT"]


def test_stale_pieces_are_the_replaced_words_not_what_a_partial_correction_leaves_out():
    graph = rules_graph((0, "We live at 14 Elm Grove, Frome BA11 2RT and my mobile is 07700 900482."),
                        (3, "Sorry, it's 41 Elm Grove, not 14."), (5, "New mobile: 07700 900428, not 07700 900482."))
    assert {f.superseded_by for f in graph.superseded()} >= {"41 Elm Grove", "07700 900428"}
    assert graph.stale() == ["900482"]  # "14" is too short to find safely; "Frome BA11 2RT" was not replaced


def test_corrections_patch_pieces_and_other_peoples_addresses_supersede_nothing():
    graph = rules_graph((0, "The flat is Flat 4, 12 Quay Street, Hull HU1 2AA."),
                        (3, "Correction: it's Flat 14, not Flat 4. My mistake."),
                        (5, "Sorry, the postcode is HU1 2AB, not 2AA."),
                        (8, "My brother lives at 3 Mill Lane, York YO1 7AA, please post his copy there."))
    current = {f.value for f in graph.current_facts() if f.attribute == "address"}
    assert "Flat 14, 12 Quay Street, Hull HU1 2AB" in current  # both pieces patched in, once each
    assert "3 Mill Lane, York YO1 7AA" in current  # a second address, not a switch: nothing superseded by it
    assert [f.superseded_by for f in graph.superseded()] == ["Flat 14, 12 Quay Street, Hull HU1 2AA",
                                                              "Flat 14, 12 Quay Street, Hull HU1 2AB"]


def test_a_date_moved_away_from_the_day_a_turn_names_is_superseded_and_a_mere_mention_supersedes_nothing():
    """A move names the old day ("Thursday's no good", "not the 14th") and the new date: the earlier date with
    that weekday or day of the month is invalidated, kept, and points at the new one. A turn that names a day
    without asking to move ("stay till the 22nd ... on the 21st") changes no date."""
    graph = rules_graph((0, "Could I book the room for Thursday 17 April, 10 till 12?"),
                        (2, "My flight out is on 14 April and the move is on Saturday 21 March."),
                        (5, "Actually, Thursday's no good. Could we have Saturday 19 April, 10 till 12, instead?"),
                        (7, "Boss just messaged. I now fly out Tuesday 7 April, not the 14th."),
                        (9, "The landlord says I can stay till the 22nd, so the flat goes straight to the house on the 21st."))
    assert {(f.value, f.superseded_by, f.invalid_from_turn) for f in graph.superseded()} == {
        ("Thursday 17 April", "Saturday 19 April", 5), ("14 April", "Tuesday 7 April", 7)}
    current = {f.value for f in graph.current_facts() if f.type == "date"}
    assert {"Saturday 19 April", "Tuesday 7 April", "Saturday 21 March"} <= current


def test_a_reply_that_moves_a_booking_supersedes_the_date_it_booked_and_an_offer_or_a_range_end_does_not():
    """The assistant books and moves: "Moved: your first lesson is now Thursday 12 June" replaces the date
    whose sentence shares "first lesson" with it, and the graph keeps the old one superseded. Offering
    another slot replaces nothing; "now starts on ... and still ends on ..." leaves the end it says again."""
    graph = rules_graph(
        (0, "Can I book driving lessons?", "Done: your first lesson is Tuesday 10 June, 5pm to 7pm, with Priya."),
        (1, "And the homestay?", "Booked: your homestay starts on Saturday 6 September and ends on Saturday 29 November."),
        (2, "Something came up on Tuesday.", "Priya also has Friday 13 June free, or Thursday 12 June."),
        (3, "Thursday please.", "Moved: your first lesson is now Thursday 12 June, 5pm to 7pm, with Priya."),
        (4, "My flight was changed, I now land on Sunday 7 September.",
         "Your homestay now starts on Sunday 7 September and still ends on Saturday 29 November."))
    assert {(f.value, f.superseded_by) for f in graph.superseded()} == {
        ("Tuesday 10 June", "Thursday 12 June"), ("Saturday 6 September", "Sunday 7 September")}
    current = {f.value for f in graph.current_facts()}
    assert {"Thursday 12 June", "Sunday 7 September"} <= current and "Friday 13 June" not in current
    loaded = EntityGraph.from_state(json.loads(json.dumps(graph.state())), PersistenceMarker(None))  # as a session saves it
    loaded.observe(5, "Sorry, can the lesson move again?")
    loaded.mention(5, "Moved: your first lesson is now Monday 16 June, 5pm to 7pm.")
    assert ("Thursday 12 June", "Monday 16 June") in {(f.value, f.superseded_by) for f in loaded.superseded()}


def test_a_measure_denied_or_an_amount_replaced_in_so_many_words_is_superseded_and_other_amounts_are_not():
    """"The caravan isn't 7.2 metres ... it's 8.1 metres" and "36kg ..., not 34" deny a measure said before;
    "raised from £6,000 to £9,000" and "£250 instead of £500" pair amounts. An amount said near a cue
    ("a £99 fee ... if the car isn't as described") replaces no earlier price: a dialogue has too many."""
    graph = rules_graph((0, "Caravan details: 7.2 metres long and 2.6 metres high. He weighs 34kg."),
                        (1, "Cover of £6,000 please, and an overdraft of £500.", "Added: £6,000 goods cover."),
                        (2, "OK, £2,050 for the car.", "Agreed: £2,050 for the Focus."),
                        (3, "The caravan isn't 7.2 metres. With the A-frame it's 8.1 metres. He was 36kg last week, not 34."),
                        (4, "Make it £9,000. And the overdraft: make it £250.",
                         "Updated: goods cover raised from £6,000 to £9,000. Your overdraft is now £250 instead of £500."),
                        (5, "What does holding it cost?", "A £99 reservation fee, refundable if the car isn't as described."))
    assert {(f.value, f.superseded_by) for f in graph.superseded()} == {
        ("7.2 metres", "8.1 metres"), ("34kg", "36kg"), ("£6,000", "£9,000"), ("£500", "£250")}


def test_a_reply_replacing_one_value_with_another_or_cancelling_a_day_supersedes_it():
    """"Replacing the £83 with £340" and "£9,120, replacing the £8,460" pair amounts; "moved ... to Monday 16
    June, and cancelled the Wednesday slot" names the old date's day. A graph saved before the ledger existed
    loads, and takes later corrections from then on."""
    graph = rules_graph(
        (0, "How much is the fragile packing?", "Fragile packing is £83, and the builder quoted £8,460."),
        (1, "Book my eye test please.", "Booked: your eye test is on Wednesday 11 June at 4:15pm."),
        (2, "Can you pack everything?", "Of course. Replacing the £83 with £340, the total is £1,933."),
        (3, "He has revised his quote.", "Updated: the quote is now £9,120, replacing the £8,460."),
        (4, "I'm on shift that Wednesday now.",
         "I've moved your eye test to Monday 16 June at 4:15pm, and cancelled the Wednesday slot."))
    assert {(f.value, f.superseded_by) for f in graph.superseded()} == {
        ("£83", "£340"), ("£8,460", "£9,120"), ("Wednesday 11 June", "Monday 16 June")}
    state = json.loads(json.dumps(graph.state()))
    del state["ledger"]  # a session saved by an earlier version
    loaded = EntityGraph.from_state(state, PersistenceMarker(None))
    loaded.mention(5, "Your overdraft limit is £500.")
    loaded.mention(6, "Done: your overdraft limit is now £250 instead of £500.")
    assert ("£500", "£250") in {(f.value, f.superseded_by) for f in loaded.superseded()}


def test_a_reply_the_model_decoded_moves_no_value_and_one_on_record_does(tiny_dir):
    """`palace chat`'s replies are the small model's own and may invent a move: the agent records their
    values but supersedes nothing; the same reply given as the record (scripted, as `palace
    eval` feeds it) supersedes it."""
    agent = Agent(load_model(tiny_dir, device="cpu"), AgentConfig(model=tiny_dir, budget_tokens=400, graph=True))
    teacher_force(agent, "Book my eye test please.", "Booked: your eye test is on Wednesday 11 June at 4:15pm.")
    moved = "I've moved your eye test to Monday 16 June at 4:15pm, and cancelled the Wednesday slot."
    turn = ask(agent, "Is there anything sooner?")
    turn.reply = moved  # as `stream` leaves a decoded reply before `remember`
    agent.note_reply(turn, None)
    assert not agent.graph.superseded() and not agent.graph.stale()
    agent.note_reply(ask(agent, "Is there anything sooner?"), moved)
    assert [(f.value, f.superseded_by) for f in agent.graph.superseded()] == [("Wednesday 11 June", "Monday 16 June")]


def test_the_newest_corrected_values_the_cap_leaves_out_are_listed_beyond_it():
    """Dates rank last in the notes, so a small cap drops a moved date; `corrections` lists the newest such
    values anyway, each once, and only corrected ones."""
    graph = rules_graph((0, "I'm Dana Whitfield, 37 Larch Close, Bristol BS3 4QT, email dana.w@example.com."),
                        (1, "Could I book the room for Thursday 17 April, 10 till 12?"),
                        (2, "My flight out is on 14 April and the move is on Saturday 21 March."),
                        (5, "Actually, Thursday's no good. Could we have Saturday 19 April, 10 till 12, instead?"),
                        (7, "Boss just messaged. I now fly out Tuesday 7 April, not the 14th."))
    words = lambda text: len(text.split())  # noqa: E731
    capped = render(graph, None, words, cap=10)
    assert "Date:" not in capped
    one, two = (render(graph, None, words, cap=10, corrections=n) for n in (1, 2))
    assert one == capped + "\nDate: Tuesday 7 April (corrected)"
    assert two == one + "\nDate: Saturday 19 April (corrected)"
    assert render(graph, None, words, cap=10, corrections=5) == two  # "Saturday 21 March" was never corrected
    roomy = render(graph, None, words, cap=200, corrections=2)
    assert roomy == render(graph, None, words, cap=200) and roomy.count("Tuesday 7 April") == 1


def test_a_value_denied_beside_its_replacement_is_recorded_superseded_even_if_never_a_fact():
    """"124, not 110": a count no cue marked is still a value the user says is wrong; "it's 2985, not 2958"
    invalidates the code recorded before. The notes then say which one is current."""
    graph = rules_graph((0, "The key safe code is 2958 and there are 110 day guests."),
                        (3, "And ugh, his side of the family is bigger. Day guests is now 124, not 110."),
                        (4, "Correction on the key safe: it's 2985, not 2958."),
                        (6, "Correction on the run: 18 m, not 14.5."))
    assert {(f.value, f.superseded_by) for f in graph.superseded()} >= {("110", "124"), ("2958", "2985"), ("14.5", "18 m")}
    assert {"124", "2985", "18 m"} <= {f.value for f in graph.current_facts()}
    assert "2958" in graph.stale()


def test_a_code_one_slip_from_a_fact_or_switched_to_replaces_it_and_other_numbers_do_not():
    """"Olu that's wrong!! It's 4781" after 4718 (two digits swapped), "87,400, fat fingers" after 97,400 (one
    changed), "New code 9140" after the key safe's 2207; an order number unlike any fact, in a correcting turn,
    replaces nothing, and a code switched to replaces no order number of its shape."""
    graph = rules_graph((0, "The alarm code is 4718 and the car's mileage is £97,400 on the form."),
                        (1, "The key safe code is 2207, by the back door."),
                        (2, "Olu that's wrong!! It's 4781. He always swaps the last two digits."),
                        (4, "Sorry, typo: the mileage is £87,400."),
                        (6, "Sorry, one more thing, my order number is 5521."),
                        (8, "Landlord reset the key safe. New code 9140."))
    assert {(f.value, f.superseded_by) for f in graph.superseded()} == {
        ("4718", "4781"), ("£97,400", "£87,400"), ("2207", "9140")}
    assert {"4781", "£87,400", "9140"} <= {f.value for f in graph.current_facts()}


def test_palace_refs_scores_corrections_at_the_superseded_probes(tmp_path):
    """`palace refs` replays the graph to each probe: the corrected value invalidated, the new one current, and
    an expected value never left invalidated."""
    import json

    from classifiers.annotations import load_dialogues, score_corrections

    probe = {"kind": "recall", "choices": ["a", "b"], "answer": 0, "evidence": [1], "tags": ["superseded"]}
    turns = [{"user": "Book the engineer for Thursday 12 June, please.", "assistant": "Booked: Thursday 12 June."},
             {"user": "Thursday won't work after all. Can we move it to Friday 13 June?", "assistant": "Moved."},
             {"user": "When is the engineer coming?", "assistant": "Friday 13 June.",
              "probe": {**probe, "expect": ["Friday 13 June"], "forbid": ["Thursday 12 June"]}},
             {"user": "And the first date I asked for?", "assistant": "Thursday 12 June.",
              "probe": {**probe, "expect": ["Thursday 12 June"], "tags": []}}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "d", "turns": turns}) + "\n")
    report = score_corrections(load_dialogues([str(tmp_path)]))
    assert report["superseded_probes"] == 1 and report["old_value_invalidated"] == 1.0
    assert report["new_value_current"] == 1.0 and report["probes"] == 2
    assert report["expected_value_invalidated"] == 0.5  # the old date, asked for as such, is no current fact


def test_it_and_there_resolve_to_the_parcel_and_the_address():
    graph = rules_graph((0, "My parcel from Hallam Books never arrived.", "I'm sorry. Which address should the parcel go to?"),
                        (1, "My sister's flat, 9 Mill Street, Leeds LS2 7EW.", "Thanks, noted."))
    resolved = {r.span: (r.entity, r.antecedent, r.type) for r in graph.observe(2, "Can you send it there?")[1]}
    assert resolved["it"][0] == "parcel" and resolved["it"][1] == 0
    assert resolved["there"] == ("9 Mill Street, Leeds LS2 7EW", 1, "pronoun")


def test_a_relation_resolves_to_the_person_introduced_with_it():
    graph = rules_graph()
    graph.observe(0, "The booking is for me and my daughter Ellie.")
    resolved = graph.observe(3, "Can my daughter sit by the window? She gets travel sick.")[1]
    assert [(r.span, r.entity, r.antecedent) for r in resolved][:2] == [("my daughter", "Ellie", 0), ("She", "Ellie", 0)]


def resolved_in(graph: EntityGraph, turn: int, text: str) -> dict[str, tuple[str, int]]:
    return {r.span: (r.entity, r.antecedent) for r in graph.observe(turn, text)[1]}


def test_the_other_address_is_the_older_of_two_addresses():
    graph = rules_graph((0, "Please post the forms to 12 Wren Street, York YO1 7HH.", "Noted."),
                        (1, "Actually, the refund letter should go to 4 Alder Court, York YO24 1AB.", "Noted too."))
    assert resolved_in(graph, 2, "And the other address, is that one still on file?")["the other address"] == (
        "12 Wren Street, York YO1 7HH", 0)


def test_it_after_a_named_product_is_the_product_not_the_person_or_the_order_number():
    graph = rules_graph((0, "Hi, it's Tamsin, order KX-55120.", "Thanks Tamsin. I see you bought a Brewmaster Duo grinder."))
    assert resolved_in(graph, 1, "It makes a horrible noise.")["It"] == ("Brewmaster Duo", 0)


def test_she_after_my_daughter_and_a_name_is_the_daughter_and_the_antecedent_is_where_she_was_named():
    graph = rules_graph((0, "I'm booking swimming lessons for my daughter Priya and my son Arlo."))
    assert resolved_in(graph, 1, "She is seven and a bit nervous.")["She"] == ("Priya", 0)
    assert resolved_in(graph, 2, "Can she start next week?")["she"] == ("Priya", 0)  # "She" at turn 1 named no one
    assert resolved_in(graph, 3, "He is ten.")["He"] == ("Arlo", 0)


def test_a_relation_named_in_a_later_sentence_resolves_to_the_name():
    graph = rules_graph((0, "My husband wants to come to the viewing too. His name is Desmond Achebe."),
                        (1, "My mother-in-law is coming as well. Gwendolyn Marsh, she's 80.", "Both added."))
    resolved = resolved_in(graph, 2, "Can my husband and my mother-in-law park on site?")
    assert resolved["my husband"] == ("Desmond Achebe", 0)
    assert resolved["my mother-in-law"] == ("Gwendolyn Marsh", 1)


def test_a_noun_said_in_apposition_to_a_name_means_that_person_later():
    graph = rules_graph((0, "Also, my best man, Gareth Lewis, needs his trousers taking up.", "Of course."),
                        (1, "A trainee solicitor, Mr Tomasz Wierzbicki, joins on Monday.", "Noted."))
    assert resolved_in(graph, 2, "Can the trainee have a laptop?")["the trainee"] == ("Mr Tomasz Wierzbicki", 1)
    resolved = resolved_in(graph, 3, "Can the best man come in on Friday? Will he need to book?")
    assert resolved["the best man"] == ("Gareth Lewis", 0) and resolved["he"] == ("Gareth Lewis", 0)
    # a name that goes on with a verb, or owns the noun, was not said in apposition to it
    graph = rules_graph((0, "For a gravel scheme, Tomasz often uses Euphorbia."),
                        (1, "We've got a broken desk chair - Dev", "We can take it."),
                        (2, "The chair is Dev's, for the record.", "Noted."))
    assert not any(e.same_as for e in graph.entities.values())


def test_a_bare_noun_opening_a_terse_sentence_refers_to_the_entity_named_before():
    graph = rules_graph((0, "Quote for roller banners please, 850 x 2000 mm.", "The roller banners are £48 each."),
                        (1, "Also need a certificate for the insurer.", "I'll add the certificate."))
    resolved = resolved_in(graph, 2, "Banners: make it 3. Certificate by Friday?")
    assert resolved["Banners"] == ("roller banners", 0) and resolved["Certificate"] == ("certificate", 1)
    assert "Thanks" not in resolved_in(graph, 3, "Thanks. Pigeons next.")  # nothing earlier goes by these


def test_the_claim_is_the_code_it_was_opened_as_and_a_pronoun_that_is_a_thing():
    graph = rules_graph((0, "My lamp arrived smashed.", "Sorry! I've opened claim QX-4410 for the lamp, Ms Oduya."),
                        (1, "Thanks.", "You're welcome."))
    resolved = resolved_in(graph, 2, "How long does the claim take? Will that be quick? So that I know.")
    assert resolved["the claim"] == ("QX-4410", 0)
    assert resolved["that"][0] in ("QX-4410", "lamp")  # a thing, not Ms Oduya; "so that I" is no reference
    assert len(resolved) == 2


def test_the_warranty_is_the_code_given_as_its_number_after_a_comma():
    """"Calder Street, warranty number WTY-55203": the nouns before a code reach back past "number" (a greedy
    match once took "warranty number" as the nouns and stopped at "number"), so "the warranty" is the code."""
    graph = rules_graph((0, "The boiler's broken again.", "I've found a Brightwater warranty for a Thermara Combi 30 at "
                         "19 Calder Street, warranty number WTY-55203. It runs until 30 September 2026."),
                        (1, "OK.", "Anything else?"))
    assert resolved_in(graph, 2, "Does the warranty cover the repair?")["the warranty"] == ("WTY-55203", 0)


def test_dad_is_the_person_introduced_as_my_father_and_a_relation_is_never_a_date():
    graph = rules_graph((0, "I'm writing on behalf of my father, Desmond Mercer.", "Thank you. I've found Desmond's record."),
                        (1, "Scrap Tuesdays. He's got physio on Mondays, my wife just reminded me.", "Noted."))
    assert graph.entities["mondays"].kind == "date"  # "Mondays, my wife" reads like "Ellie, my daughter"
    assert resolved_in(graph, 2, "Can Dad bring his own wheelchair?")["Dad"] == ("Desmond", 0)  # as last written
    assert resolved_in(graph, 3, "And can my wife come along?")["my wife"][0] != "Mondays"


def test_a_phrase_no_entity_goes_by_is_the_thing_an_earlier_turn_said_without_a_determiner():
    graph = rules_graph((0, "I paid by cheque on Monday.", "Thanks, noted."),
                        (1, "Also my email changed.", "Updated."))
    assert resolved_in(graph, 2, "Has the cheque cleared yet?")["the cheque"] == ("cheque", 0)
    assert "the parrot" not in resolved_in(graph, 3, "Is the parrot included?")  # nothing said it: no guess


def test_the_man_is_the_person_last_named_and_the_graph_round_trips():
    graph = rules_graph((0, "When is the visit?", "Your engineer will be Rafael Ortiz, on Tuesday 4 March."))
    assert resolved_in(graph, 1, "Will the engineer call first?")["the engineer"] == ("Rafael Ortiz", 0)
    loaded = EntityGraph.from_state(graph.state(), PersistenceMarker(None))
    assert resolved_in(loaded, 2, "Does the man need parking?")["the man"] == ("Rafael Ortiz", 0)


def test_the_clause_model_round_trips_through_json(tmp_path):
    clauses = ["please never phone me", "never call me at work", "I prefer email", "email is best for me",
               "what if they can't fix it", "I never got the parcel", "by WhatsApp please", "letters in Greek please"]
    labels = ["taboo", "taboo", "preference", "preference", "none", "none", "preference", "preference"]
    model = PreferenceModel.fit(clauses, labels)
    model.save(tmp_path / "p.json")
    loaded = PreferenceModel.load(tmp_path / "p.json")
    assert loaded.predict(clauses) == model.predict(clauses)
    assert sum(a == b for a, b in zip(model.predict(clauses), labels)) >= 7
    (tmp_path / "bad.json").write_text('{"format_version": 99}')
    with pytest.raises(ValueError, match="not a persistence model"):
        PreferenceModel.load(tmp_path / "bad.json")


def test_a_keyframe_closes_every_n_turns_with_the_blocks_central_turn():
    summary = RunningSummary(every=3)
    vectors = [np.array([1.0, 0.0]), np.array([0.8, 0.6]), np.array([0.0, 1.0])]
    texts = ["Hello! My boiler is leaking from the bottom valve.", "It started on Monday night.", "Anyway."]
    frames = [summary.add(t, text, v) for t, (text, v) in enumerate(zip(texts, vectors))]
    assert frames[:2] == [None, None] and frames[2].first_turn == 0 and frames[2].last_turn == 2
    assert frames[2].text == "It started on Monday night."  # closest to the block's mean
    assert summary.search(np.array([0.7, 0.7]), 0.9)[0][0] is frames[2]


SCRIPT = [("Hi, I'm Dana Whitfield, order BX-40912. My boiler stopped working.", "Sorry to hear that, Dana."),
          ("Our address is 37 Larch Close, Bristol BS3 4QT.", "Thanks, noted."),
          ("Please never phone me at work.", "Understood, no calls at work."),
          ("Sorry, wrong address: it's 70 Poplar Lane, Bristol BS3 4QT, not 37 Larch Close.", "Updated."),
          ("The engineer can come on Tuesday.", "Booked for Tuesday."),
          ("Can you send the invoice there as well?", "Yes, it will go there.")]


@pytest.mark.parametrize("placement", ["newest", "front"])
def test_the_notes_kv_is_replaced_not_appended_and_the_budget_holds(embedded, placement):
    """Wherever the notes sit: one block, replaced as they change, within their cap and the budget; at the
    front it is framed as a system message between the system prompt and the first user header."""
    budget = 300
    agent = Agent(embedded, AgentConfig(policy="hybrid", budget_tokens=budget, memory=MemoryConfig(), graph=True,
                                        profile=ProfileConfig(share=0.3, placement=placement)))
    header = len(agent.format.closing_note_header("")[2])
    seen = []
    for user, reply in SCRIPT:
        teacher_force(agent, user, reply)
        notes = agent.store.meta.turn == NOTES_TURN
        ids = agent.store.meta.token[notes].tolist()
        assert agent.store.length <= budget
        assert int(notes.sum()) <= ProfileConfig(share=0.3).cap(budget) + 12  # the text's cap plus its framing
        assert bool(notes.any()) and agent.format.decode(ids).strip().endswith(agent.notes.strip())
        assert bool(torch.all(torch.diff(torch.nonzero(notes).flatten()) == 1))  # one block: replaced, not appended
        if placement == "front":
            turns = agent.store.meta.turn.tolist()
            system = turns.count(-1)
            assert turns[:system + int(notes.sum())] == [-1] * (system - header) + [NOTES_TURN] * int(notes.sum()) + [-1] * header
            assert agent.store.meta.position.tolist() == list(range(agent.store.length))
        seen.append(agent.notes)
    assert "Address: 70 Poplar Lane, Bristol BS3 4QT (corrected)" in agent.notes and "Larch" not in agent.notes
    assert len(set(seen)) > 1
    stats = agent.stats()
    assert stats["notes_tokens"] == int((agent.store.meta.turn == NOTES_TURN).sum())
    assert any(r["span"] == "there" and "Poplar" in r["entity"] for r in stats["graph"]["resolutions"])


def test_a_corrected_value_wins_over_the_old_one_with_the_notes(embedded):
    """With the notes, the probe's current address outscores the superseded one."""
    agent = Agent(embedded, AgentConfig(policy="hybrid", budget_tokens=300, memory=MemoryConfig(), graph=True,
                                        profile=ProfileConfig(share=0.25)))
    for user, reply in SCRIPT[:5]:
        teacher_force(agent, user, reply)
    ask(agent, "Which address do you have for me now?")
    new, old = agent.score(["Your address is 70 Poplar Lane, Bristol BS3 4QT.", "Your address is 37 Larch Close, Bristol BS3 4QT."])
    assert new > old


def test_a_superseded_value_leaves_the_cache_stays_archived_and_is_never_recalled(embedded):
    """After the correction, no token of "37 Larch Close" is live (the correcting turn's own "not 37 Larch
    Close" included); they are archived with their turns, and recalling the old address's turn leaves them
    out (without the filter they would come back). Without `forget_stale` they stay in the cache."""
    def run(forget: bool) -> Agent:
        agent = Agent(embedded, AgentConfig(policy="hybrid", budget_tokens=1000, memory=MemoryConfig(), graph=True,
                                            forget_stale=forget))
        for user, reply in SCRIPT[:4]:
            teacher_force(agent, user, reply)
        return agent

    kept, agent = run(False), run(True)
    assert kept._occurrences("Larch Close").numel() >= 6  # stated, corrected, and no eviction at this budget
    assert agent.graph.stale() == ["37 Larch Close"]
    assert agent._occurrences("Larch").numel() == 0 and agent._occurrences("Poplar Lane").numel() > 0
    assert agent.store.length == kept.store.length - kept._occurrences("37 Larch Close").numel()
    archived = [agent.memory.archive.get(r.id) for r in agent.memory.archive.segments_for(
        agent.memory.config.user_id, agent.memory.config.session_id)]
    assert {s.turn for s in archived} == {1, 3} and all("Larch" in agent.format.decode(s.tokens) for s in archived)
    turn = agent.observe("What was the address I gave you at first?")
    agent.memory.recall(turn.index, turn.embedding, [], None, {1: "address"}, forget=agent._stale)
    assert 1 in [r.turn for r in agent.memory.last] and agent._occurrences("Larch").numel() == 0
    agent.memory.recall(turn.index, turn.embedding, [], None, {1: "address"})  # without the filter: back it comes
    assert agent._occurrences("37 Larch Close").numel() > 0 and agent.store.length <= 1000


def test_he_is_a_given_name_not_a_capitalised_word_no_list_knows():
    """The hand-written given-names list: "Desmond" opening a sentence is someone, "Ray" is Raymond, and
    neither a label ("Correction:") nor a name with "he" after it in the same sentence ("over Christmas, he")
    becomes a person."""
    graph = rules_graph((0, "Desmond rang about the booking.", "Thanks, I've noted it."),
                        (1, "Correction: the booking is for Saturday.", "Updated."))
    assert "correction" not in graph.entities
    assert resolved_in(graph, 2, "Can he bring his walker?")["he"][0] == "Desmond"
    graph = rules_graph((0, "It's for Raymond Alcott. We're away over Christmas, he stays with us.", "Noted."),
                        (1, "Ray can't manage stairs.", "Understood."))
    assert graph.entities["christmas"].kind != "person"
    assert "ray" not in graph.entities and graph.entities["raymond alcott"].name == "Ray"


def test_i_am_is_never_a_name_introduced_with_a_relation():
    graph = rules_graph((0, "Between the dog and my mother, I'm not sure who runs this house.", "Ha, noted."))
    assert not any("i" in entity.key.split() for entity in graph.entities.values())


def test_he_prefers_the_man_known_to_be_male_and_they_a_plural_thing_not_a_code():
    graph = rules_graph((0, "I'm calling for my grandad, Albert Finch. He has his cataract operation on Friday.",
                         "Thanks. I've found Albert's referral for Friday."),
                        (1, "Will the nurse ring him beforehand?", "Yes, the nurse calls the day before."))
    assert resolved_in(graph, 2, "Should he stop eating the night before?")["he"] == ("Albert", 0)  # not the nurse
    graph = rules_graph((0, "My order BX-2231 had two lamps in it.", "Thanks, I can see BX-2231."))
    assert resolved_in(graph, 1, "Are they boxed separately?")["they"][0] == "lamps"


def test_a_parent_named_with_is_called_and_a_thing_a_name_owns_resolve():
    graph = rules_graph((0, "We need a quote for the funeral flowers. Mum's called Irene, she chose them.",
                         "Thanks. Irene's wreath of white roses is £85."),
                        (1, "Lovely. And a wreath for Auntie May too.", "Added."))
    resolved = resolved_in(graph, 2, "Can Mum see Irene's wreath before Friday?")
    assert resolved["Mum"] == ("Irene", 0)
    assert resolved["Irene's wreath"][0] == "wreath"
