"""Generate the scripted customer-service dialogues in data/dialogues.jsonl.

    python data/generate.py --seed 7 --out data/dialogues.jsonl

Each dialogue has exactly 50 turns: identifying facts, preferences and an assistant-given
case number and credit early on, topic digressions and returns, one corrected fact, and
8-10 probes (mostly after turn 20, evidence >= 10 turns back). Every probe's value appears
only in its evidence turns, and an untagged probe's distractor values appear nowhere in
the dialogue, so choosing the right answer needs the evidence. `check()` asserts this for
every dialogue; a dialogue that fails is redrawn. Distractors are chosen to have the same
token count as the answer under the SmolLM2 tokenizer, because choices are scored by
total log-probability. The user turns that state a fact carry `persist` spans and the second
item's "That one" a `refs` entry (the optional annotations of docs/dialogue-format.md; see PERSIST).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from agent.eval.dialogue import load_dialogues  # noqa: E402

N_TURNS = 50
AGENTS = ["Nova", "Max", "Iris", "Leo", "Juno", "Remy", "Ada", "Milo", "Kai", "Zoe", "Otto", "Bea"]
SYSTEM_PROMPTS = [
    "You are {agent}, the support assistant of {company}.",
    "You are {agent}, a friendly customer service agent for {company}. Keep answers short and helpful.",
    "You work in customer support at {company}. Your name is {agent}. Be polite, accurate and brief.",
    "{company} support chat. You are {agent}; help customers with {scope}, and remember what they tell you.",
]
GUIDELINES = [
    "Customers often raise several issues in one chat, so keep track of every detail they share.",
    "Never invent account details; confirm anything you are unsure about.",
    "Respect any contact preferences or personal needs the customer mentions.",
    "Keep replies to one or two friendly sentences.",
    "Repeat reference numbers exactly as the customer or the system gave them.",
    "Be warm but professional, and apologise when something has gone wrong.",
    "If a problem needs follow-up, log a case and give the customer its number.",
    "Offer a goodwill credit when the customer has clearly been inconvenienced.",
]
FIRST = ["Dana", "Priya", "Marcus", "Elena", "Tomasz", "Aisha", "Kenji", "Lucia", "Oren", "Freya", "Mateo",
         "Ingrid", "Rohan", "Selma", "Dmitri", "Yara", "Callum", "Noor", "Bram", "Ines", "Tobias", "Leila",
         "Anders", "Mireille", "Kwame", "Sofia", "Hamish", "Zainab", "Emil", "Greta", "Viktor", "Hana"]
LAST = ["Whitfield", "Okafor", "Lindqvist", "Moreau", "Castellano", "Brandt", "Nakamura", "Haddad",
        "Fitzgerald", "Novak", "Abernathy", "Sorensen", "Delacroix", "Petrov", "Quintero", "Ashworth",
        "Kowalczyk", "Mbeki", "Galloway", "Varga", "Eriksen", "Marchetti", "Oyelaran", "Thornbury", "Yilmaz"]
EMAIL_A = ["blue", "quiet", "sunny", "amber", "lucky", "rapid", "misty", "cosmic", "golden", "velvet", "brisk"]
EMAIL_B = ["finch", "otter", "comet", "falcon", "pebble", "lantern", "badger", "walrus", "meadow", "kettle"]
EMAIL_HOST = ["mailbox.com", "inbox.org", "fastmail.io", "webpost.net", "zmail.com"]
STREETS = ["Birch", "Elm", "Juniper", "Chestnut", "Magnolia", "Sparrow", "Alder", "Hawthorn", "Bramble",
           "Poplar", "Thistle", "Larch", "Primrose"]
STREET_KINDS = ["Lane", "Road", "Street", "Avenue", "Close", "Drive", "Court"]
MONTHS = ["January", "February", "March", "April", "June", "July", "August", "September", "October",
          "November", "December"]
CHANNELS = ["WhatsApp", "Telegram", "text message", "Viber", "WeChat", "iMessage"]
LANGUAGES = ["Spanish", "Portuguese", "Polish", "Dutch", "Greek", "Turkish", "Italian", "German", "French",
             "Swedish", "Romanian", "Hungarian"]
ALLERGENS = ["peanuts", "shellfish", "sesame", "walnuts", "gluten", "dairy", "almonds", "mustard", "celery", "soy",
             "kiwi"]


def code(rng: random.Random, pattern: str) -> str:
    """L = capital letter, d = digit, anything else literal."""
    return "".join(rng.choice(string.ascii_uppercase.replace("O", "").replace("I", "")) if c == "L"
                   else str(rng.randint(0, 9)) if c == "d" else c for c in pattern)


# Value generators: rng -> one random value of that type.
VALUES = {
    "name": lambda r: f"{r.choice(FIRST)} {r.choice(LAST)}",
    "email": lambda r: f"{r.choice(EMAIL_A)}{r.choice(EMAIL_B)}{r.randint(10, 99)}@{r.choice(EMAIL_HOST)}",
    "phone": lambda r: f"{r.randint(201, 989)}-{r.randint(201, 989)}-{r.randint(1000, 9999)}",
    "address": lambda r: f"{r.randint(10, 98)} {r.choice(STREETS)} {r.choice(STREET_KINDS)}",
    "date": lambda r: f"{r.choice(MONTHS)} {r.randint(10, 28)}",
    "case": lambda r: code(r, "CS-ddddd"),
    "credit": lambda r: f"${r.randint(15, 95)}.{r.randint(1, 9)}0",
    "channel": lambda r: r.choice(CHANNELS),
    "language": lambda r: r.choice(LANGUAGES),
    "allergen": lambda r: r.choice(ALLERGENS),
}

# Probe questions (user) and choice frames (assistant); {v} is the value.
PROBES = {
    "name": (["Sorry, can you confirm which name you have for me?",
              "Just checking, which name did I give you at the start?"],
             "The name I have for you is {v}."),
    "ref": (["I've lost my note, what was my {ref_label} again?",
             "Can you read my {ref_label} back to me, please?"],
            "Your {ref_label} on file is {v}."),
    "email": (["Which email address will the written confirmation go to?",
               "Remind me, which email address did I give you earlier?"],
              "The email address on file is {v}."),
    "phone": (["What mobile number did I give you earlier on?",
               "Which mobile number do you have saved for me?"],
              "The mobile number you gave me is {v}."),
    "address": (["Where exactly will you send the paperwork now?",
                 "Which address are you sending the paperwork to?"],
                "The paperwork will go to {v}."),
    "date": (["Remind me, when is the {date_label} again?",
              "Sorry, which day did we settle on for the {date_label}?"],
             "The {date_label} is on {v}."),
    "channel": (["How exactly will you keep me updated about all this?",
                 "How are you going to contact me about this later?"],
                "We will only contact you by {v}."),
    "language": (["Which language will the written letters be in?",
                  "What language will you use for my letters?"],
                 "Your letters will be written in {v}."),
    "allergen": (["{allergy_q}"], "We will keep {v} well away from you."),
    "case": (["Going back to {phrase_a} for a moment, what was the case number?",
              "Back to {phrase_a} then. Which case number did you give me?"],
             "The case number I gave you is {v}."),
    "credit": (["Coming back to {phrase_b}, how much was that credit again?",
                "Returning to {phrase_b} for a second: what was the credit amount?"],
               "The credit on your account was {v}."),
    "coref": (["Wait, which one was it that {defect}?",
               "Remind me, which one did I say {defect}?"],
              "The one you meant was {v}."),
    "summary": (["Before I go, can you sum up the problems I raised today?",
                 "Could you quickly recap the problems I came in with today?"],
                "Today you raised {v}."),
}
KIND = {"name": "recall", "ref": "recall", "email": "recall", "phone": "recall", "address": "recall",
        "date": "recall", "channel": "preference", "language": "preference", "allergen": "preference",
        "case": "topic-return", "credit": "topic-return", "coref": "coreference", "summary": "summary"}

# Fact statements: (user, assistant). {v} value, {old} superseded value.
FACTS = {
    "name": [("Hi, my name is {v} and I need some help, please.",
              "Hello, and welcome to {company} support. What can I do for you?"),
             ("Hello, this is {v}. I hope you can help me today.",
              "Hi there, thanks for contacting {company}. How can I help?")],
    "ref": [("My {ref_label} is {v}, if that helps.", "Thanks, I've pulled up {ref_label} {v}."),
            ("I'm getting in touch about {ref_label} {v}.", "Thanks, I can see {ref_label} {v} here.")],
    "issue_a": [("The main problem is {v}, and it's really frustrating.",
                 "I'm sorry to hear that. Let's get it sorted out together."),
                ("I'm writing because of {v}. It has been a real hassle.",
                 "That sounds annoying, I'm sorry. Let's work through it.")],
    "issue_b": [("Separately, there's another problem as well: {v}.",
                 "Thanks for flagging that too. Let's look at it now."),
                ("There's a second thing I need help with: {v}.",
                 "Of course, I'm happy to take a look at that as well.")],
    "case": [("Can you log all this officially so it doesn't get lost?",
              "Of course. I've logged it under case {v}."),
             ("Is there a reference for this so I can follow up?",
              "Yes, I've opened case {v} for this.")],
    "credit": [("Is there anything you can do to make up for this?",
                "Yes, I've added a goodwill credit of {v} to your account."),
               ("Honestly, I think I deserve something for the trouble.",
                "I agree. I've applied a credit of {v} to your account.")],
    "email": [("For written updates, my email address is {v}.", "Thanks, I've saved {v} as your email."),
              ("Please use {v} for anything in writing.", "Got it, written updates will go to {v}.")],
    "phone": [("My mobile number is {v}, in case you need it.", "Thanks, I've noted {v} as your mobile."),
              ("You can reach my mobile on {v} if anything changes.", "Noted, your mobile number is {v}.")],
    "address": [("Please send any paperwork to {v}.", "Noted, paperwork will go to {v}."),
                ("My postal address for the paperwork is {v}.", "Thanks, I've saved {v} for paperwork.")],
    "address_fix": [("Sorry, I moved recently. The address is {v} now, not {old}.",
                     "Thanks for telling me. I've updated it to {v}."),
                    ("Correction: paperwork should go to {v}, not {old}. My mistake.",
                     "No problem, I've changed the address to {v}.")],
    "date": [("Could we set the {date_label} for {v}?", "Sure, the {date_label} is booked for {v}."),
             ("Would {v} work for the {date_label}?", "Yes, {v} works. I've booked the {date_label}.")],
    "date_fix": [("Something came up. Can we move the {date_label} to {v} instead of {old}?",
                  "No problem, I've moved the {date_label} to {v}."),
                 ("Sorry, {old} doesn't work after all. Could we do {v}?",
                  "Of course, the {date_label} is now on {v}.")],
    "channel": [("Please never call me, I only want updates by {v}.",
                 "Understood, no phone calls. We will only use {v}."),
                ("One request: no calls at all, please. Just {v}.",
                 "Noted. I've set your contact preference to {v} only.")],
    "language": [("Could all written letters be in {v}, please? It's my first language.",
                  "Of course, I've set your letters to {v}."),
                 ("I read {v} much better, so please write to me in {v}.",
                  "Certainly, your letters will be in {v} from now on.")],
    "allergen": [("One more important thing: I'm seriously allergic to {v}.",
                  "Thank you for telling me. I've added that allergy to your profile."),
                 ("Please note I have a severe allergy to {v}.",
                  "Thanks, that allergy is now flagged on your profile.")],
    "confusable_ref": [("I also have an older {ref_label}, {v}, but that one is all sorted.",
                        "Okay, I'll leave that one alone and stay with this case.")],
    "confusable_item": [("For the record, {v} has been absolutely fine.",
                         "Good to hear. I'll leave that one as it is.")],
}

# `persist` annotations (docs/dialogue-format.md, "Annotations") for the facts that FACTS and the item
# intro plant in user text. Per fact kind, a list of groups; each group is one span, given as alternative
# patterns (one per FACTS template), and exactly the first pattern found in the user text is emitted.
# Rules: a value (name, reference number, email, mobile, address, date) is annotated as the bare value
# exactly as drawn, with nothing around it, and an item as its name without the leading "the" ("Solara
# keyboard", "flight to Basel", "card ending in 1934", "room 241"); a correction annotates only the new
# value (the old one was annotated where it was first stated). A preference is the value plus the one
# word that ties it to the request ("by WhatsApp", "Just WhatsApp", "in Greek"); a prohibition is a
# `taboo`, as in data/heldout/: the no-calls phrase ("never call me", "no calls at all") and the allergy
# with the word that states it ("allergic to sesame", "allergy to sesame"). The issues, the defect and
# the assistant-given case number and credit are not annotated (not a persist type / not user text).
PERSIST: dict[str, list[list[tuple[str, str]]]] = {
    "name": [[("identity", "{v}")]],
    "ref": [[("identity", "{v}")]],
    "email": [[("contact", "{v}")]],
    "phone": [[("contact", "{v}")]],
    "address": [[("address", "{v}")]],
    "address_fix": [[("address", "{v}")]],
    "date": [[("date", "{v}")]],
    "date_fix": [[("date", "{v}")]],
    "channel": [[("preference", "by {v}"), ("preference", "Just {v}")],
                [("taboo", "never call me"), ("taboo", "no calls at all")]],
    "language": [[("preference", "in {v}")]],
    "allergen": [[("taboo", "allergic to {v}"), ("taboo", "allergy to {v}")]],
    "item": [[("identity", "{item}")]],  # the second item (domain["item_intro"])
    "confusable_ref": [[("identity", "{v}")]],  # the older reference number
    "confusable_item": [[("identity", "{item}")]],  # the other item
}


def persist_spans(key: str, user: str, v: str) -> list[dict]:
    """The `persist` spans of a fact turn (PERSIST); no randomness, so the text of a seed is unchanged."""
    spans, fmt = [], dict(v=v, item=v.removeprefix("the "))
    for group in PERSIST.get(key, []):
        found = [(kind, pat.format(**fmt)) for kind, pat in group if pat.format(**fmt) in user]
        if not found:  # a template and its span rule disagree: a bug, not a reason to redraw
            raise RuntimeError(f"no persist span for {key} {v!r} in {user!r}")
        spans.append({"span": found[0][1], "type": found[0][0]})
    return spans


RETURNS = [("Okay, back to {phrase} for a moment.", "Sure, let's pick {phrase} back up. What else do you need?"),
           ("Anyway, where were we with {phrase}?", "We were in the middle of {phrase}. Happy to continue."),
           ("Let's go back to {phrase}, if that's okay.", "Of course. What would you like to know about it?")]

# Topic-neutral chatter, used when a topic's own fillers run out.
MISC = [("Sorry, give me a second, my dog is barking at the door.", "No problem at all, take your time."),
        ("Okay, I'm back. Thanks for waiting.", "No worries. Shall we carry on where we were?"),
        ("This chat is much quicker than waiting on hold.", "I'm glad it's working well for you."),
        ("Let me grab a pen so I can write things down.", "Sure, I'll wait until you're ready."),
        ("Sorry if I'm asking a lot of questions today.", "Not at all, that's exactly what I'm here for."),
        ("My internet is a bit slow, so bear with me.", "Of course, there's no rush on my side."),
        ("Thanks, that makes sense so far.", "Great. Let me know if anything is unclear."),
        ("Hang on, my kettle just boiled. One moment.", "Take your time, I'm still here when you need me.")]

GENERIC_TOPICS = {
    "small-talk": ("our chat", [
        ("Sorry, totally unrelated, but how is your day going so far?",
         "Quite busy, but chats like this make it nicer. Thanks for asking!"),
        ("Do you work from home or from an office?", "Mostly from home these days, which I really enjoy."),
        ("It's pouring with rain here, honestly.", "Sorry to hear that. Perfect weather for a cup of tea, though."),
        ("Do you get a lot of people asking the same things?", "Some questions come up often, but every chat is different."),
        ("I've been stuck inside all week with a cold.", "Oh no, I hope you feel better soon."),
        ("Are you a real person or a bot, by the way?", "I'm the virtual assistant, but I can pass you to a colleague anytime."),
        ("My kids are on school holidays, so it's chaos here.", "That sounds lively! I'll try to keep this quick for you."),
        ("Any plans for the weekend yourself?", "Nothing big, probably a long walk and a good book."),
        ("I just started learning to bake bread.", "That's a lovely hobby. Homemade bread is hard to beat."),
        ("Sorry, I got distracted by the football on TV.", "No problem at all. Is your team winning?"),
    ]),
    "account-security": ("the account security", [
        ("Unrelated, but how do I change my account password?",
         "Go to settings, then security, and choose change password."),
        ("Should I turn on two-step verification?", "Yes, we strongly recommend it. It takes about a minute to set up."),
        ("I got a strange message asking for my login details.", "Please ignore it. We never ask for passwords by message."),
        ("Can I see which devices are logged into my account?", "Yes, the security page lists every active session."),
        ("How often should I update my password?", "Whenever you suspect a problem, and always use a unique one."),
        ("Can someone else manage my account for me?", "Yes, you can add a trusted person with limited access."),
        ("What happens if I forget my password again?", "You can reset it with a link we send to you."),
        ("Is my payment information stored safely?", "Yes, card details are encrypted and never shown in full."),
        ("Can I log out of all devices at once?", "Yes, there's a sign out everywhere button on the security page."),
        ("Do you ever share my data with partners?", "Only what's needed to deliver the service, as our privacy policy explains."),
    ]),
    "payment": ("the payment question", [
        ("Quick question about paying. Which payment methods do you accept?",
         "We accept debit and credit cards, bank transfer and most digital wallets."),
        ("Can I split a payment into instalments?", "Yes, for larger amounts you can pay in three instalments."),
        ("Where do I find my invoices?", "All invoices are under billing in your account, ready to download."),
        ("Do you charge a fee for paying by card?", "No, card payments are free of charge."),
        ("Can I change the card I pay with?", "Yes, you can update it any time under billing."),
        ("Why does my invoice show two lines for one thing?", "Usually that's the item and its tax shown separately."),
        ("Can I get a paper invoice as well?", "Yes, just tick the paper invoice box in your billing settings."),
        ("Is it possible to pay on a different day each month?", "Yes, you can choose any payment day from the first to the twentieth."),
        ("When does the payment actually leave my account?", "Usually within two working days of the invoice date."),
        ("Do you offer any discount for paying yearly?", "Yes, yearly payment usually saves around ten percent."),
    ]),
    "app-help": ("the app question", [
        ("Different topic: your app keeps logging me out. Is that normal?",
         "It shouldn't. Updating to the latest version usually fixes that."),
        ("Can I turn off the app notifications?", "Yes, under settings you can switch off each notification type."),
        ("Is there a dark mode in the app?", "Yes, it follows your device setting automatically."),
        ("The app is really slow on my old tablet.", "Clearing the app cache often helps on older devices."),
        ("Can I use the website instead of the app?", "Absolutely, the website has all the same features."),
        ("Where do I find the chat button in the app?", "It's at the bottom of the help page, in the corner."),
        ("Can I make the text in the app bigger?", "Yes, the app uses your device's text size setting."),
        ("Does the app work offline at all?", "Some pages do, but most actions need a connection."),
        ("Why does the app ask for my location?", "Only to suggest nearby options. You can safely say no."),
        ("I can't find my history in the app.", "It's under your profile, then activity, sorted by date."),
    ]),
    "feedback": ("the feedback", [
        ("By the way, can I leave some feedback about your service?",
         "Of course, we really value feedback. What would you like to share?"),
        ("Your website could really be easier to use.", "Thanks, I'll pass that on to our web team."),
        ("The person I spoke to last time was great.", "That's lovely to hear. I'll make sure they know."),
        ("Will anyone actually read my feedback?", "Yes, a team reviews every comment each week."),
        ("Can I fill in a survey after this chat?", "Yes, a short survey will appear when we finish."),
        ("I'd like to make a formal complaint, not about you though.", "Understood. I can explain the complaints process if you like."),
        ("How long do complaints usually take to resolve?", "Most are resolved within ten working days."),
        ("Your hold music is honestly terrible.", "Ha, you're not the first to say that. I'll pass it on."),
        ("I've been a customer for years, you know.", "Thank you for sticking with us all this time."),
        ("Do you reward loyal customers at all?", "Yes, long-standing customers get occasional offers by email."),
    ]),
    "policy": ("the policy question", [
        ("Before I forget, what are your opening hours?",
         "Chat is open every day from eight in the morning until ten at night."),
        ("Can I ask for a copy of the data you hold on me?", "Yes, you can request it and we reply within a month."),
        ("Where can I read your terms and conditions?", "They're linked at the bottom of every page on our website."),
        ("Do you keep a record of these chats?", "Yes, chats are stored for training and quality purposes."),
        ("Can I ask you to delete my old records?", "Yes, except what we must keep by law."),
        ("Are your prices going up this year?", "We have no price changes planned at the moment."),
        ("Is there a cooling-off period for new contracts?", "Yes, you have fourteen days to change your mind."),
        ("Do you have a phone line for people who can't use chat?", "Yes, and an accessible text relay service too."),
        ("Are bank holidays treated any differently by you?", "Only our hours change. Everything else works as usual."),
        ("What's your policy on accessibility needs?", "Tell us what you need and we'll adapt how we communicate."),
    ]),
}

DOMAINS = [
    dict(name="electronics", companies=["Acme Electronics", "Voltmart", "Circuit House"],
         scope="orders, repairs and deliveries", ref_label="order number", ref_pattern="LL-dddd",
         date_label="delivery date", item_pattern="the {brand} {thing}",
         brands=["Korvo", "Orbis", "Quillon", "Solara"],
         things=["tablet", "speaker", "keyboard", "monitor", "headphones"],
         item_intro="I also bought {v} from you in the spring.",
         defects=["keeps switching itself off", "makes a buzzing noise", "gets really hot"],
         allergy_q=None,
         a=("repair", "the repair", ["a cracked screen", "a faulty battery", "a dead pixel", "a broken hinge",
                                     "a failed update"], [
             ("Do I need to send it in, or can someone fix it locally?",
              "Either works, but our repair centre is usually faster."),
             ("How long does a repair usually take?", "Most repairs take five to seven working days once it arrives."),
             ("Is this covered by the warranty?", "Yes, manufacturing faults are covered for two years."),
             ("Should I back up my files first?", "Yes, please back everything up, since repairs can need a reset."),
             ("Do I need to include the original box?", "No box needed, just pack it safely with some padding."),
             ("Will I get a loan device in the meantime?", "We don't offer loan devices, sorry, but warranty repairs go first."),
             ("Can I track the repair online?", "Yes, the repair page updates whenever a technician works on it."),
             ("What if they can't fix it?", "Then we replace it with the same model or the closest equivalent."),
             ("I already tried restarting it a few times.", "Thanks, that rules out a simple glitch, so a repair makes sense."),
             ("Should I remove the screen protector before sending it?", "Yes please, technicians need to inspect the bare screen."),
         ]),
         b=("delivery", "the delivery", ["a missing parcel", "a late delivery", "a missing charger", "a dented box",
                                         "a wrong colour"], [
             ("Which courier do you usually use?", "Mostly a national courier; large items go with a freight partner."),
             ("Can I pick things up from a store instead?", "Yes, click and collect is free at all our stores."),
             ("Do you deliver on weekends at all?", "Saturday delivery costs a little extra, but there's nothing on Sundays."),
             ("What happens if I'm not home?", "The courier leaves a card and tries again the next working day."),
             ("Is express shipping really worth the money?", "It usually arrives a day or two sooner, so it depends on urgency."),
             ("Does someone need to sign for it?", "Only for expensive orders; otherwise it's left somewhere safe."),
             ("Can I change the delivery slot online?", "Yes, the tracking page lets you pick a new slot."),
             ("Will all the packaging be recyclable?", "Yes, our boxes and paper padding are fully recyclable."),
             ("How will I know it's out for delivery?", "You'll get a notice that morning with a two-hour window."),
         ])),
    dict(name="airline", companies=["SkyLark Air", "Northwind Airways", "Bluecrest Airlines"],
         scope="bookings, baggage and flight changes", ref_label="booking reference", ref_pattern="LLdLdL",
         date_label="new flight date", item_pattern="the flight to {brand}",
         brands=["Oslo", "Lyon", "Bologna", "Vienna", "Prague", "Dublin", "Munich", "Zurich", "Helsinki", "Lisbon",
                 "Athens", "Geneva", "Basel", "Naples", "Venice"],
         things=[""], item_intro="I also have {v} booked for later this year.",
         defects=["was moved three hours earlier", "lost my seat selection", "has no meal listed"],
         allergy_q="Is there anything the cabin crew should know for my meals?",
         a=("booking-change", "the booking change", ["a cancelled connection", "a misspelled ticket", "a missed flight",
                                                     "a seat downgrade", "a double booking"], [
             ("Is there a fee for changing the flight?", "On your fare type, changes are free; you only pay any fare difference."),
             ("Will I keep my original seat?", "We try to, but seats on the new flight depend on availability."),
             ("Can I still check in online after the change?", "Yes, online check-in opens twenty-four hours before departure."),
             ("Does my hand luggage allowance stay the same?", "Yes, your allowance moves with the booking."),
             ("What if the new flight is delayed too?", "Then you're protected by the same delay rules as before."),
             ("Can I get a refund instead of changing?", "For this kind of disruption, yes, a full refund is possible."),
             ("Will my travel insurance still cover me?", "Usually yes, but it's worth telling your insurer about the change."),
             ("Do I need to print a new boarding pass?", "No, the mobile boarding pass updates automatically."),
             ("Is there a lounge I can use while waiting?", "Lounge access depends on your ticket, but vouchers are sometimes offered."),
         ]),
         b=("baggage", "the baggage claim", ["a lost suitcase", "a broken stroller", "a damaged guitar case",
                                             "an overweight bag fee", "a delayed bag"], [
             ("How long do you usually need to trace a bag?", "Most bags are found within three days."),
             ("Do I need to fill in a report form?", "Yes, I can start the form here, it only takes a few minutes."),
             ("Can I claim for things I had to buy meanwhile?", "Yes, keep receipts for essentials like toiletries and clothes."),
             ("Will you deliver it to me when it's found?", "Yes, found bags are couriered to you free of charge."),
             ("Is there a limit on what you'll pay out?", "There is a legal limit, but most claims fall well under it."),
             ("Do you need photos of the damage?", "Photos really help, so please upload them with the form."),
             ("Should I keep the luggage tag?", "Yes, the tag number is the fastest way to trace it."),
             ("Can I track the search online?", "Yes, the baggage page shows each update as it happens."),
             ("What counts as an essential purchase?", "Basic clothing, toiletries and chargers are the usual examples."),
         ])),
    dict(name="bank", companies=["Harbour Bank", "Crestline Savings", "Meridian Bank"],
         scope="cards, payments and savings", ref_label="account number", ref_pattern="dddd-dddd",
         date_label="branch appointment", item_pattern="the card ending in {brand}",
         brands=[str(n) for n in range(1203, 9876, 731)], things=[""],
         item_intro="I also have {v} with you.",
         defects=["was declined twice at the supermarket", "shows a payment I never made",
                  "stopped working for online shopping"],
         allergy_q=None,
         a=("card-dispute", "the disputed payment", ["an unknown charge", "a duplicate payment", "a blocked card",
                                                    "a failed transfer", "a wrong exchange rate"], [
             ("How long does a dispute normally take?", "Most disputes are settled within fifteen working days."),
             ("Will I get the money back while you investigate?", "Usually yes, we add a temporary credit within a few days."),
             ("Should I cancel my card to be safe?", "If you don't recognise the merchant, freezing the card is sensible."),
             ("Can I freeze the card from the app?", "Yes, there's a freeze switch on the card screen."),
             ("Do I need to contact the shop first?", "It helps, but it's not required before opening a dispute."),
             ("What evidence do you need from me?", "Receipts or messages with the merchant are the most useful."),
             ("Will this affect my credit score?", "No, a dispute doesn't affect your credit score."),
             ("What if the shop says I agreed to it?", "Then we review both sides before making a decision."),
             ("Could something like this happen to me again?", "Turning on payment alerts helps you spot anything odd quickly."),
         ]),
         b=("savings", "the savings account", ["a missing interest payment", "a closed savings pot",
                                               "a frozen savings account", "a wrong tax form",
                                               "a missed standing order"], [
             ("What interest rate am I getting at the moment?", "Your savings account pays a variable rate, shown in the app."),
             ("How often is the interest actually paid?", "Interest is calculated daily and paid monthly."),
             ("Can I withdraw money whenever I like?", "Yes, this account allows unlimited withdrawals."),
             ("Is my money protected if something goes wrong?", "Yes, deposits are covered by the national guarantee scheme."),
             ("Can I open a second savings pot?", "Yes, you can have up to five pots in the app."),
             ("Do I pay tax on the interest?", "That depends on your personal allowance, so check your situation."),
             ("Can I set up a regular transfer into savings?", "Yes, a standing order is easy to set up in the app."),
             ("Is there a better rate if I lock money away?", "Yes, fixed-term accounts usually pay a bit more."),
             ("Can I name my savings pots?", "Yes, you can name them anything you like."),
         ])),
    dict(name="telecom", companies=["Lumen Mobile", "Strata Telecom", "Beacon Broadband"],
         scope="broadband, mobile plans and equipment", ref_label="customer ID", ref_pattern="LLLdddd",
         date_label="engineer visit", item_pattern="the {brand} {thing}",
         brands=["Korvo", "Orbis", "Quillon", "Solara"],
         things=["router", "modem", "booster", "hotspot"], item_intro="I also rent {v} from you.",
         defects=["drops the connection every evening", "keeps rebooting at night", "has a blinking red light"],
         allergy_q=None,
         a=("internet-outage", "the internet problem", ["a slow connection", "a dead landline", "a dropped line",
                                                        "a nightly outage", "a broken socket"], [
             ("I've already unplugged everything and plugged it back in.", "Thanks, that's the first step I would have suggested."),
             ("Is there an outage in my area?", "I can't see a reported outage near you at the moment."),
             ("Should I try a different cable?", "Yes, a spare cable is worth trying if you have one."),
             ("Could the wifi channel be the problem?", "It could, especially in busy buildings. The router can pick one automatically."),
             ("Is it better to connect with a cable?", "A cable is usually faster and more stable than wifi."),
             ("How do I run a speed test?", "Our website has a speed test; run it while connected by cable."),
             ("Will I be compensated for the downtime?", "If it lasts more than two days, yes, compensation is automatic."),
             ("Do I need to be home for the engineer?", "Yes, someone over eighteen needs to be there."),
             ("Can the engineer check the wiring inside too?", "Yes, they check everything from the wall socket onwards."),
         ]),
         b=("plan-change", "the plan change", ["a roaming charge", "a wrong plan price", "a missing data bonus",
                                               "a cancelled add-on", "an early exit fee"], [
             ("What plans do you have with more data?", "We have plans with fifty gigabytes and with unlimited data."),
             ("Can I change my plan mid-month?", "Yes, the new price is applied from the day you switch."),
             ("Is there a contract with the new plan?", "You can choose a monthly rolling plan or a year-long one."),
             ("Do unused minutes roll over to next month?", "On most plans, unused data rolls over for one month."),
             ("Does the plan include calls abroad?", "Calls abroad are an add-on, but roaming in Europe is included."),
             ("Can I add my partner to the same plan?", "Yes, family plans give a discount for each extra line."),
             ("Will my number stay the same?", "Yes, changing plans never changes your number."),
             ("Is there a student discount on any plan?", "Yes, students get ten percent off with a valid student card."),
             ("How do I check how much data I have left?", "It's shown on the home screen of our app."),
         ])),
    dict(name="furniture", companies=["Oakline Furniture", "Hearth & Home", "Nordby Interiors"],
         scope="orders, deliveries and assembly", ref_label="order number", ref_pattern="LLddddd",
         date_label="delivery date", item_pattern="the {brand} {thing}",
         brands=["oak", "walnut", "velvet", "linen", "leather", "marble", "pine"],
         things=["sofa", "bookcase", "armchair", "wardrobe", "dresser", "sideboard"],
         item_intro="I also ordered {v} at the same time.",
         defects=["arrived with a deep scratch", "is missing two screws", "wobbles on a flat floor"],
         allergy_q=None,
         a=("assembly", "the assembly problem", ["a missing screw pack", "a split panel", "a wrong instruction sheet",
                                                 "a bent rail", "a cracked leg"], [
             ("Do you offer an assembly service?", "Yes, our fitters can assemble most items for a fixed fee."),
             ("How long does assembly usually take?", "Most pieces take between one and three hours."),
             ("Can I download the instructions somewhere online?", "Yes, every product page has the instructions as a download."),
             ("Which tools will I need for it?", "Usually just a screwdriver and the small key in the box."),
             ("Can I get spare parts sent separately?", "Yes, spare parts are sent free within a week."),
             ("Is it safe to use it half assembled?", "Please don't; wait until every part is fixed in place."),
             ("Should it be fixed to the wall?", "Tall items should always be fixed to the wall for safety."),
             ("Can I return it if I've already assembled it?", "Yes, if it's faulty, even after assembly."),
             ("Do you take away the packaging?", "Our fitters take all packaging away when they finish."),
         ]),
         b=("delivery", "the delivery", ["a missed delivery slot", "a damaged doorframe", "a wrong fabric colour",
                                         "an unpaid assembly fee", "a late van"], [
             ("Will the drivers carry it upstairs?", "Yes, two-person delivery includes carrying it to any room."),
             ("How wide does my doorway need to be?", "Check the product page, which lists the packed dimensions."),
             ("Do you deliver on Saturdays as well?", "Yes, Saturday slots are available for a small extra fee."),
             ("Can the old sofa be taken away?", "Yes, we offer removal of old furniture for a fee."),
             ("How early will I know the time slot?", "You'll get a two-hour slot the evening before."),
             ("What if something gets damaged during delivery?", "Report it within forty-eight hours and we'll fix it."),
             ("Can I track the van on the day?", "Yes, a live tracking link is sent in the morning."),
             ("Can they leave it in the garage?", "Yes, just add a note to the order."),
             ("Do the drivers unwrap everything for me?", "Yes, they unpack and check the item with you."),
         ])),
    dict(name="insurance", companies=["Shieldwell Insurance", "Covebridge Mutual", "Anchor Assurance"],
         scope="policies, claims and renewals", ref_label="policy number", ref_pattern="PLL-dddd",
         date_label="assessor visit", item_pattern="the {brand} {thing}",
         brands=["grey", "blue", "red", "white", "black", "green", "yellow"],
         things=["Volvo", "Mazda", "Skoda", "Subaru", "Honda", "Renault"],
         item_intro="My policy also covers {v} my partner drives.",
         defects=["got a dent in a car park", "had a wing mirror knocked off", "got a chipped windscreen"],
         allergy_q=None,
         a=("claim", "the claim", ["a hail-damaged roof", "a burst pipe", "a stolen bicycle", "a flooded basement",
                                   "a fallen fence"], [
             ("How long does a claim usually take?", "Simple claims are settled in about two weeks."),
             ("Do I need to get quotes for the repair?", "Two quotes help, but our assessor can also arrange repairs."),
             ("Will my premium go up after this?", "It might at renewal, depending on the claim outcome."),
             ("Should I take photos of everything?", "Yes, photos and receipts make the claim much faster."),
             ("Can I start repairs before the assessor comes?", "Only urgent repairs to prevent more damage, and keep the receipts."),
             ("Is there an excess I have to pay?", "Yes, your policy excess is deducted from the payout."),
             ("Can I see the claim progress online?", "Yes, the claims page shows each step."),
             ("What if I disagree with the payout?", "You can ask for a review, and then go to the ombudsman."),
             ("Do you cover temporary accommodation if needed?", "Yes, if your home is unsafe to live in."),
         ]),
         b=("renewal", "the renewal", ["a premium increase", "a missing no-claims discount", "a wrong renewal date",
                                       "a duplicate direct debit", "a lapsed cover"], [
             ("Why do renewals usually cost more?", "Prices reflect claims costs and risk, but we check for loyalty discounts."),
             ("Can I pay monthly instead of yearly?", "Yes, monthly payments are available with a small charge."),
             ("Can I add cover for accidental damage?", "Yes, it's an optional extra at renewal."),
             ("Will you renew the policy automatically?", "Yes, unless you tell us not to before the renewal date."),
             ("Can I cancel if I find a cheaper quote?", "Yes, within fourteen days of renewal for a full refund."),
             ("Do you offer a multi-policy discount?", "Yes, holding two policies with us saves ten percent."),
             ("Can I change my excess at renewal?", "Yes, a higher excess lowers your premium."),
             ("What documents will you send me?", "A renewal schedule and a summary of your cover."),
             ("Is legal cover included in my policy?", "It's an optional add-on, not included by default."),
         ])),
    dict(name="grocery", companies=["FreshCart", "Basket & Co", "GreenGrocer Direct"],
         scope="grocery orders, substitutions and subscriptions", ref_label="order number", ref_pattern="GR-ddddd",
         date_label="next delivery", item_pattern="the {brand} {thing}",
         brands=["Sunfold", "Greenacre", "Millbrook", "Hollybank"],
         things=["oat milk", "sourdough", "granola", "coffee beans", "olive oil"],
         item_intro="I also ordered {v} this week.",
         defects=["arrived past its best-before date", "was leaking inside the bag", "came completely crushed"],
         allergy_q="Is there anything you must leave out of my deliveries?",
         a=("missing-items", "the missing items", ["a missing bag", "a substituted brand", "a melted ice cream tub",
                                                   "a wrong item", "a torn egg carton"], [
             ("Will you refund the missing things?", "Yes, missing items are refunded to your original payment method."),
             ("Do I need to send photos?", "Photos help for damaged items, but not for missing ones."),
             ("Can the driver bring them later today?", "Unfortunately not today, but we can add them to your next order."),
             ("Why do substitutions happen so often?", "Usually because stock runs out after we pick the order."),
             ("Can I refuse substitutions at the door?", "Yes, just hand them back to the driver."),
             ("Can I turn off substitutions completely?", "Yes, there's a setting for that in your account."),
             ("How long does a refund take to show?", "Usually three to five working days."),
             ("Are frozen items packed separately from the rest?", "Yes, they travel in insulated bags."),
             ("Do you check the bags before they leave?", "Yes, but mistakes still happen, sorry."),
         ]),
         b=("subscription", "the subscription", ["a double delivery charge", "an expired promo code",
                                                 "a paused membership", "a wrong weekly box",
                                                 "a cancelled repeat order"], [
             ("What does the delivery pass include?", "Free delivery on orders over a minimum spend, any day."),
             ("Can I pause the subscription while on holiday?", "Yes, you can pause it for up to four weeks."),
             ("Can I change my delivery day each week?", "Yes, as long as you change it two days ahead."),
             ("Is there a minimum order for each delivery?", "Yes, there's a small minimum for each delivery."),
             ("Can I cancel it any time I want?", "Yes, the pass is monthly and you can cancel any time."),
             ("Do members get any special offers?", "Yes, members see weekly offers on the home page."),
             ("How do I update my favourites list?", "Tap the heart on any product to add it."),
             ("Can I share my account with my flatmate?", "Each account is for one household, so yes."),
             ("Are the delivery bags reusable at all?", "Yes, and the driver takes old bags back for recycling."),
         ])),
    dict(name="hotel", companies=["Harborview Hotels", "The Linden Group", "Cobalt Stay"],
         scope="reservations, stays and billing", ref_label="reservation number", ref_pattern="RSV-ddddd",
         date_label="check-in date", item_pattern="room {brand}",
         brands=[str(n) for n in range(204, 820, 37)], things=[""],
         item_intro="We also booked {v} for my parents.",
         defects=["has a heater that won't turn off", "has no hot water in the mornings", "faces the noisy street"],
         allergy_q="Is there anything the kitchen needs to know for my stay?",
         a=("reservation", "the reservation", ["a wrong room type", "a missing breakfast package",
                                               "an overbooked night", "a lost deposit", "a wrong rate"], [
             ("What time is check-in and check-out?", "Check-in is from three, and check-out is by eleven."),
             ("Can I check in early if I arrive in the morning?", "If a room is ready, yes, otherwise we store your bags."),
             ("Is breakfast included in my rate?", "It depends on the rate, so I'll check for you."),
             ("Do you have parking on site?", "Yes, there's a car park, booked on arrival."),
             ("Is there a fee if I cancel?", "Free cancellation until forty-eight hours before arrival."),
             ("Can I pay at the hotel instead of now?", "Yes, flexible rates are paid at the hotel."),
             ("Do you have a gym or pool?", "We have a small gym, open from six until ten."),
             ("Can I add an extra night?", "Yes, subject to availability at the same rate."),
             ("Is a late check-out possible on the last day?", "Often yes, just ask reception the evening before."),
         ]),
         b=("room-problems", "the room problem", ["a broken air conditioner", "a noisy neighbour",
                                                  "a leaking shower", "a broken safe", "a stained carpet"], [
             ("Can someone come and fix it today?", "Yes, maintenance is on site until late evening."),
             ("Could we move to another room instead?", "If one is free, reception can move you right away."),
             ("Will I be compensated for this?", "Usually yes, for example a discount or a free breakfast."),
             ("Is there someone I can talk to at night?", "Yes, reception is staffed all night long."),
             ("Do all rooms have the same setup?", "Mostly, though corner rooms are a bit bigger."),
             ("Can I get a couple of extra pillows?", "Yes, housekeeping can bring them any time."),
             ("Is the wifi free in the rooms?", "Yes, the details are on the card by the bed."),
             ("How do I report a problem at night?", "Just call reception from the room phone."),
             ("Can housekeeping come later in the day?", "Yes, hang the sign on the door and they'll come back."),
         ])),
]


def ntok(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def pick(rng: random.Random, templates: list, **fmt) -> tuple[str, str]:
    user, assistant = rng.choice(templates)
    return user.format(**fmt), assistant.format(**fmt)


def make_dialogue(rng: random.Random, did: str, domain: dict, tok) -> dict:
    company = rng.choice(domain["companies"])
    system = " ".join([rng.choice(SYSTEM_PROMPTS).format(agent=rng.choice(AGENTS), company=company,
                                                         scope=domain["scope"])] + rng.sample(GUIDELINES, 3))
    values = dict(VALUES, ref=lambda r: code(r, domain["ref_pattern"]),
                  coref=lambda r: domain["item_pattern"].format(brand=r.choice(domain["brands"]),
                                                                thing=r.choice(domain["things"])))
    label_a, phrase_a, issues_a, fill_a = domain["a"]
    label_b, phrase_b, issues_b, fill_b = domain["b"]
    item_re = re.compile(re.escape(domain["item_pattern"]).replace(r"\{brand\}", "(.+?)").replace(r"\{thing\}", ".*"))
    fmt = dict(company=company, ref_label=domain["ref_label"], date_label=domain["date_label"],
               phrase_a=phrase_a, phrase_b=phrase_b, allergy_q=domain["allergy_q"])

    # Topic plan: A main issue, B second issue, C/D/E generic digressions, with returns.
    c, d, e = rng.sample(sorted(GENERIC_TOPICS), 3)
    x, y = rng.choice([(e, c), (c, d), (e, d)])
    plan = [("A", rng.randint(7, 8)), ("B", rng.randint(5, 6)), (c, 4), ("B", rng.randint(3, 4)),
            (d, rng.randint(4, 5)), ("A", rng.randint(5, 6)), (x, rng.randint(4, 5)), ("B", 4), (y, rng.randint(3, 4))]
    plan.append(("A", N_TURNS - sum(n for _, n in plan)))
    labels = {"A": label_a, "B": label_b}
    topic: list[str] = []
    for key, n in plan:
        topic += [key] * n
    seg_starts = [i for i in range(N_TURNS) if i == 0 or topic[i] != topic[i - 1]]
    a2, b3 = [i for i in seg_starts if topic[i] == "A"][1], [i for i in seg_starts if topic[i] == "B"][2]

    # Which probes: all kinds in every dialogue, one superseded fact, sometimes a confusable one.
    prefs = ["channel", "language"] + (["allergen"] if domain["allergy_q"] else [])
    superseded = rng.choice(["address", "date"])
    confusable = rng.choice([None, None, "ref", "coref"])
    n_prefs = rng.randint(1, 2)
    probes = ["case", "credit", "summary", "coref", superseded] + rng.sample(prefs, n_prefs)
    recall_pool = ["name", "ref", "email", "phone", {"address": "date", "date": "address"}[superseded]]
    recalls = rng.sample(recall_pool, rng.randint(max(1, 8 - len(probes)), 10 - len(probes)))
    if confusable == "ref" and "ref" not in recalls:
        recalls[0] = "ref"
    probes += recalls

    # Draw distinct values; the superseded fact has an old and a new value.
    used: set[str] = set()

    def draw(kind: str) -> str:
        while True:
            v = values[kind](rng)
            if v not in used and not any(v in u or u in v for u in used):
                used.add(v)
                return v

    val = {k: draw(k) for k in dict.fromkeys(["name", "ref", "case", "credit", "coref"] + probes[4:])}
    old = draw(superseded)
    issue_a, issue_b = rng.choice(issues_a), rng.choice(issues_b)
    other = draw("ref" if confusable == "ref" else "coref") if confusable else None

    # Turn contents: fixed early facts, then facts at random free turns, then probes.
    turns: list[dict | None] = [None] * N_TURNS
    evidence: dict[str, list[int]] = {}
    what: list[str] = [""] * N_TURNS  # what each turn is, for the fine topic labels (no rng use)
    notes: dict[int, dict] = {}  # turn -> its `persist` / `refs` annotations, added to the turn at the end

    def put(i: int, key: str, v: str, **extra) -> None:
        user, assistant = pick(rng, FACTS[key], v=v, **fmt, **extra)
        if topic[i] not in ("A", "B"):  # a fact dropped into a digression
            user = "Oh, and " + (user if re.match(r"I\b|I'", user) else user[0].lower() + user[1:])
        turns[i] = {"user": user, "assistant": assistant}
        what[i] = key
        if key in PERSIST:
            notes[i] = {"persist": persist_spans(key, user, v)}

    put(0, "name", val["name"]); evidence["name"] = [0]
    put(1, "ref", val["ref"]); evidence["ref"] = [1]
    put(2, "issue_a", issue_a)
    put(seg_starts[1], "issue_b", issue_b)
    evidence["summary"] = [2, seg_starts[1]]
    i = rng.randint(3, seg_starts[1] - 1); put(i, "case", val["case"]); evidence["case"] = [i]
    i = rng.randint(seg_starts[1] + 1, seg_starts[2] - 1); put(i, "credit", val["credit"]); evidence["credit"] = [i]

    def free(lo: int, hi: int, span: int = 1) -> list[int]:
        return [i for i in range(lo, hi + 1 - span + 1)
                if all(turns[j] is None and j not in seg_starts for j in range(i, i + span))]

    i = rng.choice(free(3, 18, 2))
    turns[i] = {"user": domain["item_intro"].format(v=val["coref"]),
                "assistant": rng.choice(["Noted, I can see that on your account too.",
                                         "Thanks, I've found that one on your account as well."])}
    defect = rng.choice(domain["defects"])
    turns[i + 1] = {"user": f"That one {defect}, by the way.",
                    "assistant": rng.choice(["Sorry about that. I'll add it to the notes.",
                                             "I'm sorry, that shouldn't happen. I've noted it."])}
    evidence["coref"] = [i, i + 1]
    what[i] = what[i + 1] = "item"
    notes[i] = {"persist": persist_spans("item", turns[i]["user"], val["coref"])}
    # the follow-up's "That one" points back at the item, named in turn i
    notes[i + 1] = {"refs": [{"span": "That one", "entity": val["coref"], "antecedent": i, "type": "demonstrative"}]}
    for k in probes[5:]:
        if k not in evidence:
            i = rng.choice(free(3, 20)); put(i, k, val[k]); evidence[k] = [i]
    # the superseded fact: stated early, corrected later
    i = rng.choice(free(3, 14)); put(i, superseded, old)
    i = rng.choice(free(i + 5, 26)); put(i, superseded + "_fix", val[superseded], old=old)
    evidence[superseded] = [i]
    if other:
        i = rng.choice(free(8, 30)); put(i, "confusable_" + ("ref" if confusable == "ref" else "item"), other)

    probe_at = {"case": a2, "credit": b3, "summary": N_TURNS - 1}
    for k in rng.sample(probes, len(probes)):
        if k in probe_at:
            continue
        lo = max(18, max(evidence[k]) + 10)
        options = [i for i in free(lo, N_TURNS - 2) if i - 1 not in probe_at.values() and i + 1 not in probe_at.values()]
        probe_at[k] = rng.choice(options or free(max(evidence[k]) + 5, N_TURNS - 2))
        turns[probe_at[k]] = {}  # reserve

    # Fill the rest with topic chatter (returns get a "back to ..." line).
    pools = {"A": rng.sample(fill_a, len(fill_a)), "B": rng.sample(fill_b, len(fill_b)),
             **{t: [GENERIC_TOPICS[t][1][0]] + rng.sample(GENERIC_TOPICS[t][1][1:], len(GENERIC_TOPICS[t][1]) - 1)
                for t in GENERIC_TOPICS}}
    misc = rng.sample(MISC, len(MISC))
    seen_topic: set[str] = set()
    for i in range(N_TURNS):
        t = topic[i]
        phrase = {"A": phrase_a, "B": phrase_b}.get(t) or GENERIC_TOPICS[t][0]
        returning = i in seg_starts and t in seen_topic
        seen_topic.add(t)
        if turns[i] is not None:
            continue
        if returning and t in ("A", "B"):
            user, assistant = pick(rng, RETURNS, phrase=phrase)
            turns[i] = {"user": user, "assistant": assistant[0].upper() + assistant[1:]}
        else:
            what[i] = "fill" if pools[t] else "misc"
            user, assistant = (pools[t] or misc).pop(0)
            turns[i] = {"user": user, "assistant": assistant}
    for k, i in probe_at.items():  # after the filling: case, credit and summary turns get a filler first
        what[i] = "probe:" + k
    for i, label in enumerate(fine_topics(topic, what, labels, domain, evidence, turns)):
        turns[i]["topic"] = label

    # Probes: the correct choice and three distractors with the same token count.
    text = (system + " " + " ".join(t.get("user", "") + " " + t.get("assistant", "") for t in turns)).lower()
    val["summary"] = f"{issue_a} and {issue_b}"
    for k, i in probe_at.items():
        questions, frame = PROBES[k]
        answer = val[k]
        forced = [old] if k == superseded else [other] if k == confusable else []
        tags = ["superseded"] if k == superseded else ["confusable"] if k == confusable else []
        target = ntok(tok, frame.format(v=answer, **fmt))
        cands = set()
        for _ in range(300):
            if k == "summary":
                v = f"{rng.choice(issues_a)} and {rng.choice(issues_b)}"
                parts = v.split(" and ")
            else:
                v = values[k](rng)
                parts = v.split(" ") if k == "name" else [item_re.fullmatch(v)[1]] if k == "coref" else [v]
            if not any(p.lower() in text for p in parts) and v not in used and v != answer:
                cands.add(v)
        cands = sorted(cands)
        rng.shuffle(cands)
        cands.sort(key=lambda v: abs(ntok(tok, frame.format(v=v, **fmt)) - target))
        distractors = forced[:]
        for v in cands:
            if len(distractors) == 3:
                break
            if k != "summary" or not any(p in d for d in distractors for p in v.split(" and ")):
                distractors.append(v)
        values_in_order = distractors[:]
        pos = rng.randint(0, 3)
        values_in_order.insert(pos, answer)
        choices = [frame.format(v=v, **fmt) for v in values_in_order]
        user = rng.choice(questions).format(defect=defect, **fmt)
        turns[i] = {"user": user, "assistant": choices[pos], "topic": turns[i]["topic"],
                    "probe": {"kind": KIND[k], "choices": choices, "answer": pos,
                              "expect": [issue_a, issue_b] if k == "summary" else [answer],
                              "forbid": forced, "evidence": evidence[k], "tags": tags},
                    "values": values_in_order}  # for check(); not written out
    for i, note in notes.items():  # after the topic labels, so each turn's keys read user, assistant, topic, ...
        if "probe" in turns[i]:
            raise RuntimeError(f"{did}: turn {i} is both a fact and a probe")
        turns[i].update(note)
    return {"id": did, "domain": domain["name"], "system": system, "turns": turns}


# Fine topics (docs/dialogue-format.md, "Topics"): one request per topic. A stated fact that is not part
# of the request being discussed (contact details, a preference, a date to book, a second item) is a
# topic of its own; a probe that asks about it again returns to that topic; the turn after such an
# aside returns to the request it interrupted. Small-talk asides are topics of their own.
FACT_TOPICS = {"email": "email-address", "phone": "mobile-number", "address": "postal-address",
               "address_fix": "postal-address", "channel": "contact-channel", "language": "letter-language",
               "allergen": "allergy", "confusable_ref": "older-reference", "confusable_item": "other-item"}
ACKNOWLEDGEMENTS = ("Okay, I'm back. Thanks for waiting.", "Thanks, that makes sense so far.")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def fine_topics(topic: list[str], what: list[str], labels: dict, domain: dict, evidence: dict,
                turns: list[dict]) -> list[str]:
    """The `topic` label of every turn at the granularity of one request. Uses no randomness, so a
    seed gives the same text as before and only the labels are finer."""
    coarse = [labels.get(t, t) for t in topic]
    fine: list[str] = []
    for i, kind in enumerate(what):
        if kind in ("date", "date_fix"):
            fine.append(slug(domain["date_label"]))
        elif kind in FACT_TOPICS:
            fine.append(FACT_TOPICS[kind])
        elif kind == "item":
            fine.append("second-item")
        elif kind == "probe:summary":
            fine.append("wrap-up")
        elif kind.startswith("probe:"):  # asking about a fact again returns to the topic it was stated in
            fine.append(None)  # filled below, once the evidence turn's label is known
        elif kind == "misc" and turns[i]["user"] not in ACKNOWLEDGEMENTS:
            fine.append("aside")  # numbered below: every aside is a topic of its own
        else:  # the request itself, its fillers, returns and the facts that belong to it (case, credit)
            fine.append(coarse[i])
    for i, kind in enumerate(what):
        if fine[i] is None:
            fine[i] = fine[max(evidence[kind.split(":")[1]])]
    for i, label in enumerate(fine):
        if label == "aside":
            fine[i] = fine[i - 1] if i and fine[i - 1].startswith("aside-") else f"aside-{i}"
    return fine


def words(s: str) -> int:
    return len(s.split())


def check(d: dict) -> None:
    """Assert the probes are fair: answers follow from evidence and only from evidence."""
    turns = d["turns"]
    assert len(turns) == N_TURNS
    text_of = [(t["user"] + " \n " + t["assistant"]).lower() for t in turns]
    everything = d["system"].lower() + " \n " + " \n ".join(text_of)
    for i, t in enumerate(turns):
        for key in ("user", "assistant"):
            assert 6 <= words(t[key]) <= 25, (d["id"], i, key, t[key])
        p = t.get("probe")
        if not p:
            continue
        ev = p["evidence"]
        assert ev and all(0 <= e < i for e in ev), (d["id"], i)
        assert t["assistant"] == p["choices"][p["answer"]]
        assert len(set(p["choices"])) == len(p["choices"]), (d["id"], i, p["choices"])
        for v in p["expect"]:
            assert any(v.lower() in text_of[e] for e in ev), (d["id"], i, v, "answer not in evidence")
            for j in range(min(ev) + 1, i):
                assert j in ev or v.lower() not in text_of[j], (d["id"], i, v, j, "answer restated")
        distractors = [v for n, v in enumerate(t["values"]) if n != p["answer"]]
        if not p["tags"]:
            for v in distractors:
                parts = v.split(" and ") if p["kind"] == "summary" else [v]
                assert not any(x.lower() in everything for x in parts), (d["id"], i, v, "distractor occurs")
            assert not p["forbid"]
        else:
            assert all(f.lower() in everything for f in p["forbid"]), (d["id"], i, p["forbid"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="data/dialogues.jsonl")
    ap.add_argument("--n", type=int, default=48, help="number of dialogues (6 per domain for 48)")
    ap.add_argument("--tokenizer", default=None, help="SmolLM2 tokenizer directory, for token counts "
                    "(default: the embedded model's converted copy)")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    from agent.model import convert_embedded
    tok = AutoTokenizer.from_pretrained(args.tokenizer or convert_embedded())

    rng = random.Random(args.seed)
    dialogues, redraws = [], 0
    for n in range(args.n):
        while True:
            try:
                d = make_dialogue(random.Random(rng.random()), f"cs-{n + 1:04d}", DOMAINS[n % len(DOMAINS)], tok)
                check(d)
                break
            except (AssertionError, IndexError, ValueError) as e:
                redraws += 1
                print(f"redraw {n + 1}: {e!r}"[:200], file=sys.stderr)
        dialogues.append(d)
    for d in dialogues:
        for t in d["turns"]:
            t.pop("values", None)
    out = Path(args.out)
    out.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dialogues), encoding="utf-8")
    loaded = load_dialogues([out])  # the contract validator

    lengths = []
    for d in dialogues:
        msgs = [{"role": "system", "content": d["system"]}]
        for t in d["turns"]:
            msgs += [{"role": "user", "content": t["user"]}, {"role": "assistant", "content": t["assistant"]}]
        lengths.append(ntok(tok, tok.apply_chat_template(msgs, tokenize=False)))
    probes = [t.probe for d in loaded for t in d.turns if t.probe]
    mismatched = sum(len({ntok(tok, c) for c in p.choices}) > 1 for p in probes)
    by_kind = {k: sum(p.kind == k for p in probes) for k in sorted({p.kind for p in probes})}
    by_tag = {k: sum(k in p.tags for p in probes) for k in ("superseded", "confusable")}
    print(f"wrote {len(loaded)} dialogues to {out} ({redraws} redraws)")
    print(f"tokens per dialogue: min {min(lengths)} mean {statistics.mean(lengths):.0f} max {max(lengths)}")
    print(f"probes: {len(probes)}, by kind {by_kind}, by tag {by_tag}, untagged {sum(not p.tags for p in probes)}")
    print(f"probes whose choices differ in token count: {mismatched}")
    persists = [sum(len(t.get("persist", [])) for t in d["turns"]) for d in dialogues]
    refs = [sum(len(t.get("refs", [])) for t in d["turns"]) for d in dialogues]
    print(f"annotations: {sum(persists)} persist spans ({statistics.mean(persists):.1f} per dialogue), "
          f"{sum(refs)} refs ({statistics.mean(refs):.1f} per dialogue)")


if __name__ == "__main__":
    main()
