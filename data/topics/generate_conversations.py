"""Generate conversational training dialogues for the topic classifier (data/topics/conversations.jsonl).

    python data/topics/generate_conversations.py --seed 1 --n 180 --out data/topics/conversations.jsonl

data/dialogues.jsonl is built for memory probes: its user turns rarely answer the assistant, so a
classifier trained on it alone takes every message with a number or a name in it for a new topic and
never learns that "It's order BH-551" after "Can you give me the order number?" continues the request.
These dialogues are shorter and more conversational: the assistant asks, the user answers; follow-ups
say "it" and "that"; side questions, small talk and contact preferences interrupt for a turn or two;
requests are picked back up with a cue ("going back to the refund") or without one, near or far.
Labels follow docs/dialogue-format.md, "Topics". The domains (bank, energy, car rental, gym, food
delivery, streaming, parcel courier, online courses, pharmacy) differ from those of data/dialogues.jsonl
and of the natural dialogues in tests/fixtures/topics-natural.jsonl (a development check, never trained on).
No probes; not read by `palace eval` (it reads data/*.jsonl, not this folder).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

# A request: openers (user, assistant), ordered steps (user, assistant: the user line follows from the
# previous assistant line), stand-alone follow-ups that name the request (for picking it back up later).
DOMAINS = {
    "bank": dict(
        system="You are {agent}, the support assistant of {company}, a retail bank.",
        companies=["Harbour Bank", "Crestline Savings", "Meridian Bank"],
        slots=dict(merchant=["Quickmart", "Zentro Games", "Bolt Taxis", "Luma Streaming"],
                   amount=["£42.99", "£18.50", "£129.00", "£64.20"], card=["4417", "9032", "2286", "7710"],
                   payee=["my landlord", "my sister", "the nursery", "my builder"]),
        requests={
            "unknown-charge": dict(
                keywords=["the charge", "that payment", "the {merchant} charge", "the dispute"],
                openers=[("There's a payment on my account I don't recognise.", "I can look into that. What's the amount and the merchant?"),
                         ("I've been charged {amount} by {merchant} and I never bought anything there.", "Sorry to hear that. When did the payment go out?")],
                steps=[("It's {amount} from {merchant}, last Tuesday.", "Thanks, I can see it. Was your card with you at the time?"),
                       ("Yes, it's never left my wallet.", "Then it may be fraud. I'll open a dispute for you."),
                       ("How long does a dispute take?", "Usually up to fifteen working days."),
                       ("Do I get the money back in the meantime?", "Yes, a temporary credit should appear within two days."),
                       ("Should I cancel the card?", "I'd recommend it. I can freeze it now and send a new one."),
                       ("Yes, please freeze it.", "Done, the card ending {card} is frozen.")],
                followups=[("has the temporary credit for the {merchant} payment come through yet?", "Not yet, it should show by tomorrow."),
                           ("will {merchant} be told about the dispute?", "Yes, their bank is contacted as part of the dispute."),
                           ("what happens if the dispute about the charge is rejected?", "Then we explain why and you can appeal the decision.")]),
            "new-card": dict(
                keywords=["the new card", "the replacement card", "my card"],
                openers=[("I need a replacement card, mine has stopped working.", "I can order one. Is it the card ending {card}?"),
                         ("My debit card snapped in half, can I get a new one?", "Of course. Shall I send it to your home address?")],
                steps=[("Yes, that's the one.", "Thanks. The new card will arrive in three to five working days."),
                       ("Will it have the same PIN?", "Yes, your PIN stays the same."),
                       ("Can I use it in the app before it arrives?", "Yes, the card details appear in the app straight away."),
                       ("Great, and the old one?", "Please cut it up once the new one works.")],
                followups=[("when exactly will the new card arrive?", "Within five working days, by post."),
                           ("does the replacement card have a new number?", "Yes, it has a new number but the same PIN.")]),
            "standing-order": dict(
                keywords=["the standing order", "the transfer to {payee}", "the regular payment"],
                openers=[("I'd like to set up a standing order to {payee}.", "Sure. How much and how often?"),
                         ("Can you help me change my monthly payment to {payee}?", "Of course. What should the new amount be?")],
                steps=[("{amount} every month, on the first.", "Got it. Which account should it come from?"),
                       ("From my current account.", "Thanks, the standing order is set up from your current account."),
                       ("When is the first payment?", "The first one goes out on the first of next month."),
                       ("Can I stop it any time?", "Yes, you can cancel it in the app whenever you like.")],
                followups=[("can I change the amount of the standing order later?", "Yes, you can edit it up to a day before it's due."),
                           ("will {payee} see my name on the standing order?", "Yes, your name and the reference are shown.")]),
            "overdraft": dict(
                keywords=["the overdraft", "my overdraft limit"],
                openers=[("I'd like to ask about increasing my overdraft.", "I can check that. What limit did you have in mind?"),
                         ("How much does my overdraft cost me each month?", "It depends on how much you use. Do you want me to check last month?")],
                steps=[("Around five hundred pounds would help.", "Thanks. I can offer a limit of five hundred at the standard rate."),
                       ("What's the interest rate on that?", "It's 35 percent a year, charged daily on what you use."),
                       ("That's quite high.", "It is, so it's best for short-term use."),
                       ("Okay, let's go ahead anyway.", "Done, your overdraft limit is now five hundred pounds.")],
                followups=[("does the overdraft affect my credit score?", "Using it responsibly usually doesn't harm your score."),
                           ("can I lower my overdraft limit again later?", "Yes, any time, in the app or by chat.")]),
        }),
    "energy": dict(
        system="You are {agent}, a customer service agent for {company}, an energy supplier.",
        companies=["Brightwatt Energy", "Kestrel Power", "Greenfield Gas & Electric"],
        slots=dict(amount=["£38", "£112", "£86", "£154"], reading=["14522", "09871", "33410", "27765"],
                   month=["March", "May", "October", "January"], day=["Tuesday", "Thursday", "Friday", "Monday"]),
        requests={
            "high-bill": dict(
                keywords=["the bill", "my bill", "the {amount} bill"],
                openers=[("My latest bill is way higher than usual.", "Sorry about that. Was it based on a meter reading or an estimate?"),
                         ("Why is my {month} bill {amount} more than last month?", "Let me check. Did you send us a meter reading recently?")],
                steps=[("I think it was an estimate.", "Yes, it was estimated. Could you give me a reading now?"),
                       ("The meter says {reading}.", "Thanks, with that reading your bill drops by about {amount}."),
                       ("So will you send a corrected bill?", "Yes, a corrected bill will be emailed within two days."),
                       ("Do I still pay the old amount on Friday?", "No, the direct debit will use the corrected bill."),
                       ("Good, that's a relief.", "Glad to help. Sending readings monthly avoids estimates.")],
                followups=[("has the corrected bill been sent yet?", "It's being prepared and will arrive by email soon."),
                           ("will the direct debit change because of the corrected bill?", "Yes, it will match the corrected amount.")]),
            "smart-meter": dict(
                keywords=["the smart meter", "the meter installation", "the installation"],
                openers=[("Can I get a smart meter installed?", "Yes, installations are free. Do you own the property?"),
                         ("I'd like to book a smart meter appointment.", "Happy to. Which day suits you best?")],
                steps=[("Yes, I own the house.", "Great. The engineer needs about two hours. Which day works?"),
                       ("{day} morning would be ideal.", "Booked for {day} morning between eight and twelve."),
                       ("Do I need to be at home?", "Yes, someone over eighteen must be there."),
                       ("Will the power be off during the visit?", "Only for about thirty minutes.")],
                followups=[("what time will the smart meter engineer arrive?", "Between eight and twelve; they call thirty minutes ahead."),
                           ("does the smart meter installation cost anything?", "No, it's completely free.")]),
            "moving-house": dict(
                keywords=["the move", "moving house", "the new place"],
                openers=[("I'm moving house next month, what do I need to do?", "Congratulations! What's the moving date?"),
                         ("I'm moving out, can I take my account with me?", "Yes, you can. When is the move?")],
                steps=[("The 14th of {month}.", "Thanks. Please send a final meter reading on that day."),
                       ("And at the new place?", "We can supply it too if you give us the new address."),
                       ("It's 22 Orchard Way.", "Thanks, I've added 22 Orchard Way from the 14th."),
                       ("Will my tariff stay the same?", "Yes, your tariff moves with you.")],
                followups=[("do I send the final meter reading on moving day?", "Yes, on the day you move out."),
                           ("is the account at the new place set up from the 14th?", "Yes, supply starts on the 14th.")]),
            "payment-plan": dict(
                keywords=["the payment plan", "paying in instalments", "the arrears"],
                openers=[("I'm struggling to pay what I owe, can I spread it out?", "Of course, we can set up a payment plan. How much could you manage a month?"),
                         ("Is there a way to pay my balance in smaller amounts?", "Yes. What monthly amount would be affordable?")],
                steps=[("Maybe thirty pounds a month.", "That works. The balance would be cleared in about ten months."),
                       ("Is there any interest?", "No, payment plans are interest-free."),
                       ("What if I miss one?", "Just contact us and we'll adjust it."),
                       ("Okay, please set it up.", "Done, the first payment is on the first of next month.")],
                followups=[("when is the first payment of the plan?", "On the first of next month."),
                           ("can I pay the plan off early?", "Yes, you can clear it whenever you like.")]),
        }),
    "car-rental": dict(
        system="You are {agent}, the support assistant of {company}, a car rental company.",
        companies=["Roadrunner Rentals", "Velocar", "Milestone Car Hire"],
        slots=dict(city=["Malaga", "Porto", "Nice", "Glasgow"], booking=["VR-40921", "VR-77135", "VR-12088", "VR-56410"],
                   day=["Saturday", "Sunday", "Wednesday", "Thursday"], amount=["€95", "€60", "€240", "€150"]),
        requests={
            "pickup-change": dict(
                keywords=["the pickup", "the collection time", "the booking"],
                openers=[("I need to change the pickup time for my rental in {city}.", "Sure. What's the booking number?"),
                         ("My flight lands later now, can I collect the car later?", "Probably. Which booking is it?")],
                steps=[("It's {booking}.", "Thanks. What time would you like instead?"),
                       ("Around ten at night.", "The {city} desk is open until eleven, so ten is fine."),
                       ("Is there an extra charge for that?", "No, there's no fee for changing the time."),
                       ("What if my flight is delayed even more?", "Call the desk and they'll hold the car for an hour.")],
                followups=[("is the desk in {city} definitely open for a late pickup?", "Yes, until eleven every night."),
                           ("did the new pickup time save on booking {booking}?", "Yes, the booking shows the new time.")]),
            "deposit": dict(
                keywords=["the deposit", "my deposit", "the {amount} hold"],
                openers=[("I returned the car a week ago and the deposit is still held.", "Sorry about that. What's the booking number?"),
                         ("Why have you kept {amount} of my deposit?", "Let me look. Which booking was it?")],
                steps=[("{booking}.", "Thanks. The car was returned with less fuel than at pickup."),
                       ("I filled it up right before returning it!", "Do you have the fuel receipt?"),
                       ("Yes, I can send a photo of it.", "Please upload it and I'll ask for the charge to be reversed."),
                       ("How long until I get it back?", "Within five working days of the review.")],
                followups=[("has the deposit been released yet?", "Not yet, the review takes up to two days."),
                           ("did you get the photo of the fuel receipt for the deposit?", "Yes, it's attached to the case.")]),
            "child-seat": dict(
                keywords=["the child seat", "the car seat"],
                openers=[("Can I add a child seat to my booking?", "Yes. How old is the child?"),
                         ("Do you provide car seats for toddlers?", "We do. How old is your child?")],
                steps=[("She's three.", "Then a forward-facing seat is right. It's eight euros a day."),
                       ("Will it already be fitted?", "The desk staff will fit it when you collect the car."),
                       ("Okay, add one please.", "Done, a child seat is added to your booking.")],
                followups=[("will the child seat be fitted when I collect the car?", "Yes, staff fit it at pickup."),
                           ("how much is the child seat per day again?", "Eight euros a day.")]),
            "insurance-excess": dict(
                keywords=["the insurance", "the excess", "the cover"],
                openers=[("What's the excess on the basic insurance?", "On basic cover the excess is one thousand euros. Would you like to reduce it?"),
                         ("Should I take your extra insurance?", "It depends. Do you want to lower the excess to zero?")],
                steps=[("How much does the zero-excess cover cost?", "It's fifteen euros a day."),
                       ("Does it cover the tyres and windscreen?", "Yes, tyres, glass and the underside are included."),
                       ("Fine, add it.", "Done, you have zero-excess cover now.")],
                followups=[("does the zero-excess cover include the windscreen?", "Yes, glass is included."),
                           ("can I cancel the extra insurance before pickup?", "Yes, free of charge until pickup.")]),
        }),
    "gym": dict(
        system="You are {agent}, a member services assistant at {company}.",
        companies=["Pulse Fitness", "Ironbridge Gym", "Summit Health Clubs"],
        slots=dict(branch=["Riverside", "Old Town", "Northgate", "Harbour"], day=["Monday", "Wednesday", "Friday", "Sunday"],
                   member=["GM-30417", "GM-88120", "GM-56233", "GM-71904"]),
        requests={
            "freeze": dict(
                keywords=["the freeze", "freezing my membership", "the pause"],
                openers=[("I'd like to freeze my membership for a couple of months.", "No problem. What's your membership number?"),
                         ("Can I pause my gym membership while I'm injured?", "Yes, you can. How long would you like to pause for?")],
                steps=[("It's {member}.", "Thanks. How long should the freeze last?"),
                       ("Two months, from next week.", "Done, your membership is frozen for two months from Monday."),
                       ("Do I pay anything during the freeze?", "Just a small fee of five pounds a month."),
                       ("And it restarts automatically?", "Yes, it restarts after two months.")],
                followups=[("when does the freeze on my membership end?", "Exactly two months from Monday."),
                           ("is the freeze fee taken by direct debit?", "Yes, by the same direct debit.")]),
            "class-booking": dict(
                keywords=["the class", "the spin class", "the booking"],
                openers=[("I can't book the spin class on {day} in the app.", "Let me check. Which branch is it?"),
                         ("The app says the yoga class is full, is there a waiting list?", "There is. Which class and branch?")],
                steps=[("The {branch} one.", "That class is full, but I can put you on the waiting list."),
                       ("Yes, please do.", "Done. You'll get a message if a place frees up."),
                       ("How often do places free up?", "Most weeks two or three people cancel."),
                       ("Can I book next week's already?", "Bookings open seven days ahead, at six in the morning.")],
                followups=[("am I still on the waiting list for the class?", "Yes, you're second on the list."),
                           ("what time do class bookings open?", "Seven days ahead at six in the morning.")]),
            "billing": dict(
                keywords=["the double charge", "the payment", "the billing"],
                openers=[("I've been charged twice for this month.", "Sorry about that. Can you tell me the dates of both payments?"),
                         ("Why did two payments come out of my account this month?", "Let me check that. Which dates do you see?")],
                steps=[("The first and the third.", "I can see both. The second was a mistake."),
                       ("So I'll get it back?", "Yes, I've requested a refund of the second payment."),
                       ("When will it arrive?", "In three to five working days."),
                       ("Will it happen again next month?", "No, the duplicate mandate has been removed.")],
                followups=[("has the refund for the double payment gone through?", "It's on its way, within five days."),
                           ("are you sure I won't be charged twice next month?", "Yes, the duplicate has been removed.")]),
            "guest-pass": dict(
                keywords=["the guest pass", "bringing a friend"],
                openers=[("Can I bring a friend to the gym this weekend?", "Yes, with a guest pass. Is it their first visit?"),
                         ("How do guest passes work?", "Members get two free guest passes a month. Would you like one?")],
                steps=[("Yes, it's her first time.", "Then the pass is free. What's her name?"),
                       ("Maya Chen.", "Thanks, a guest pass for Maya Chen is ready for Saturday."),
                       ("Does she need to bring ID?", "Yes, photo ID at reception.")],
                followups=[("is the guest pass for Maya ready?", "Yes, it's valid all Saturday."),
                           ("how many guest passes do I have left?", "One more this month.")]),
        }),
    "food-delivery": dict(
        system="You are {agent}, the support assistant of {company}, a food delivery app.",
        companies=["Dishdash", "Forkly", "Spoonful"],
        slots=dict(restaurant=["Thai Orchid", "Luigi's", "Burger Barn", "Sakura Sushi"],
                   order=["FD-2041", "FD-8730", "FD-5522", "FD-9016"], amount=["£6", "£12", "£9", "£4"]),
        requests={
            "missing-item": dict(
                keywords=["the missing item", "the missing dish", "my order from {restaurant}"],
                openers=[("My order from {restaurant} arrived without the main dish.", "Sorry about that! What's the order number?"),
                         ("Part of my food order is missing.", "Oh no. Which restaurant was it from?")],
                steps=[("{order}.", "Thanks. Which item was missing?"),
                       ("The curry, the most important part.", "I'm sorry. I can refund it or have it sent again."),
                       ("A refund, please, I've eaten something else now.", "Done, {amount} is refunded to your card."),
                       ("When will that show up?", "Usually within three days.")],
                followups=[("is the refund for the missing curry on its way?", "Yes, it shows within three days."),
                           ("will {restaurant} be told they forgot the dish?", "Yes, we pass it on to the restaurant.")]),
            "late-courier": dict(
                keywords=["the courier", "the late delivery", "the driver"],
                openers=[("My food is forty minutes late and the courier isn't moving.", "Sorry! Let me check where the courier is."),
                         ("The app says my order is nearby but nothing has arrived.", "Let me look. Is it order {order}?")],
                steps=[("Yes, that's it.", "The courier seems stuck in traffic two streets away."),
                       ("Can you call him?", "I've messaged him; he says five more minutes."),
                       ("The food will be cold by then.", "I understand. I've added a {amount} voucher for the delay."),
                       ("Thanks, that helps a bit.", "You're welcome, and sorry again.")],
                followups=[("is the courier any closer now?", "Yes, he's just around the corner."),
                           ("will the voucher for the late delivery expire?", "It's valid for thirty days.")]),
            "allergy": dict(
                keywords=["the allergy note", "my allergy"],
                openers=[("How do I tell the restaurant about a nut allergy?", "You can add a note at checkout. Shall I add it to your profile too?"),
                         ("I have a severe sesame allergy. Can restaurants see that?", "Yes, if it's in your profile. Shall I add it?")],
                steps=[("Yes please, add it to my profile.", "Done, every restaurant will see the allergy note."),
                       ("Will they definitely read it?", "It's printed on the order ticket, but please also call for severe allergies."),
                       ("Good to know.", "Stay safe, and enjoy your food.")],
                followups=[("is the allergy note on every order now?", "Yes, it's printed on every ticket."),
                           ("can I check the allergy note in my profile?", "Yes, under profile and then dietary needs.")]),
            "promo-code": dict(
                keywords=["the promo code", "the discount", "the code"],
                openers=[("My promo code isn't working at checkout.", "Let me help. What's the code?"),
                         ("The app rejected my discount code.", "Sorry about that. Which code did you enter?")],
                steps=[("WELCOME10.", "That code is for first orders only, and this is your third."),
                       ("Oh, I didn't know that.", "No problem. I can give you a one-off ten percent code instead."),
                       ("That would be great.", "Done, use SORRY10 on your next order.")],
                followups=[("does the new code work on any restaurant?", "Yes, on any restaurant for one order."),
                           ("when does the discount code expire?", "At the end of the month.")]),
        }),
}

DOMAINS.update({
    "streaming": dict(
        system="You are {agent}, the help assistant of {company}, a video streaming service.",
        companies=["Flickbox", "Streamline+", "Vista TV"],
        slots=dict(device=["smart TV", "games console", "tablet", "laptop"], plan=["Standard", "Premium", "Basic"],
                   amount=["£10.99", "£15.99", "£6.99"], show=["Harbour Lights", "The Quiet Coast", "Iron Valley"]),
        requests={
            "playback-error": dict(
                keywords=["the playback problem", "the error", "the buffering"],
                openers=[("Videos keep freezing on my {device} every few minutes.", "Sorry about that. Does it happen on every show?"),
                         ("I get an error code when I try to watch anything.", "Let me help. What does the error say?")],
                steps=[("Yes, every single one.", "Thanks. Could you restart the {device} and the router?"),
                       ("I've done that twice already.", "Okay. What internet speed do you get?"),
                       ("About 20 megabits.", "That's enough for HD. Let's try lowering the quality to check."),
                       ("Lowering it helped a bit.", "Then the app cache may be full. Clearing it should fix it.")],
                followups=[("the freezing on the {device} is still happening, what next?", "Then I'll raise it with our technical team."),
                           ("should I reinstall the app because of the error?", "Yes, a reinstall often clears it.")]),
            "plan-upgrade": dict(
                keywords=["the upgrade", "my plan", "the {plan} plan"],
                openers=[("I'd like to upgrade my plan so I can watch in 4K.", "Sure. That's the {plan} plan. Shall I switch you now?"),
                         ("How much is it to add another screen to my plan?", "That's on the {plan} plan. Would you like to upgrade?")],
                steps=[("How much does it cost?", "It's {amount} a month."),
                       ("Is it charged straight away?", "Only the difference for the rest of this month."),
                       ("Okay, go ahead.", "Done, you're on the {plan} plan now."),
                       ("Can I go back if I don't like it?", "Yes, you can downgrade at any time.")],
                followups=[("does the {plan} plan include downloads?", "Yes, on up to four devices."),
                           ("when will the upgrade show on my bill?", "On your next monthly bill.")]),
            "account-sharing": dict(
                keywords=["the profiles", "my son's profile", "the kids profile"],
                openers=[("Can I set up a separate profile for my son?", "Yes. Would you like it to be a kids profile?"),
                         ("Someone else seems to be using my account.", "Let's secure it. Do you recognise the devices signed in?")],
                steps=[("Yes, he's only eight.", "Then a kids profile is best. It only shows age-rated shows."),
                       ("Can I lock my own profile with a PIN?", "Yes, under profile settings you can add a four-digit PIN."),
                       ("Good, I'll do that tonight.", "Great, that keeps your profile private.")],
                followups=[("can my son's profile watch {show}?", "No, that's rated fifteen, so it's hidden from kids profiles."),
                           ("how do I change the PIN on my profile later?", "Under profile settings, then PIN.")]),
            "missing-show": dict(
                keywords=["the missing show", "{show}", "that series"],
                openers=[("I can't find {show} anymore, was it removed?", "Let me check. Were you in the middle of watching it?"),
                         ("Where has the second season of {show} gone?", "Let me look. Which country are you watching from?")],
                steps=[("Yes, I was on episode five.", "It leaves this month due to licensing, sorry."),
                       ("That's so annoying.", "I know. It's still available until the 30th."),
                       ("Will it come back?", "Sometimes licences are renewed, but I can't promise.")],
                followups=[("is {show} really gone after the 30th?", "Yes, unless the licence is renewed."),
                           ("will I get a message if {show} comes back?", "Yes, if you add it to your watchlist.")]),
        }),
    "courier": dict(
        system="You are {agent}, the support assistant of {company}, a parcel delivery company.",
        companies=["SwiftParcel", "Parcelway", "Hermit Express"],
        slots=dict(tracking=["SP2044817", "SP9930142", "SP5581206"], day=["tomorrow", "Friday", "Monday"],
                   shop=["Lumo Shoes", "Kitchenly", "Pagewise Books"]),
        requests={
            "lost-parcel": dict(
                keywords=["the parcel", "my parcel", "the lost parcel"],
                openers=[("My parcel says delivered but it isn't here.", "Sorry about that. What's the tracking number?"),
                         ("I've been waiting a week for a parcel from {shop}.", "Let me check. Do you have the tracking number?")],
                steps=[("It's {tracking}.", "Thanks. The driver marked it as left in a safe place."),
                       ("Where exactly? I've looked everywhere.", "The photo shows a green bin by a door."),
                       ("That's not my bin, that's my neighbour's.", "Could you check with your neighbour?"),
                       ("They don't have it either.", "Then I'll open an investigation with the depot.")],
                followups=[("any news on the investigation into my parcel?", "The depot is checking the driver's route today."),
                           ("will {shop} send a new one if the parcel is lost?", "Yes, once our investigation confirms it.")]),
            "redelivery": dict(
                keywords=["the redelivery", "the missed delivery", "the card through my door"],
                openers=[("I missed a delivery and got a card through the door.", "No problem. Would you like it redelivered?"),
                         ("Can you redeliver a parcel I missed yesterday?", "Sure. Which day suits you?")],
                steps=[("Yes, {day} if possible.", "Booked for {day} between nine and five."),
                       ("Can I get a narrower time slot?", "You'll get a one-hour window on the morning of delivery."),
                       ("What if I'm out again?", "We can leave it with a neighbour or at a pickup point.")],
                followups=[("is the redelivery still booked for {day}?", "Yes, it's on the van for {day}."),
                           ("can the redelivery go to a pickup point instead?", "Yes, I can change that for you.")]),
            "customs-fee": dict(
                keywords=["the customs fee", "the import charge", "the duty"],
                openers=[("Why do I have to pay a customs fee on my parcel?", "It came from outside the country, so import tax is due. Did you order it from abroad?"),
                         ("I got a message asking for an import charge, is it real?", "Let me check it's genuine. What's the tracking number?")],
                steps=[("Yes, from a shop in the US.", "Then VAT and a handling fee are due before delivery."),
                       ("How much is it?", "Twelve pounds fifty in total."),
                       ("Can I pay on the doorstep?", "No, it has to be paid online before we deliver.")],
                followups=[("has the customs fee been paid now?", "Yes, I can see the payment."),
                           ("can I get a refund of the import charge if I return it?", "You'd claim that from the tax office.")]),
            "return-label": dict(
                keywords=["the return", "the return label", "sending it back"],
                openers=[("I need to send a parcel back to {shop}, how do I do it?", "You'll need a return label. Did {shop} give you a code?"),
                         ("Can I print a return label at the shop?", "Yes. Do you have the return code?")],
                steps=[("Yes, it's RT-5521.", "Thanks, that code works at any of our drop-off points."),
                       ("Is there one near the high street?", "Yes, the newsagent on the high street takes returns."),
                       ("Do I need a box?", "Any sturdy packaging is fine.")],
                followups=[("does the return label cost anything?", "No, {shop} has already paid for it."),
                           ("how long until {shop} gets the return?", "Usually two to three working days.")]),
        }),
    "online-course": dict(
        system="You are {agent}, the learner support assistant of {company}.",
        companies=["Learnwell", "Brightpath Academy", "SkillForge"],
        slots=dict(course=["Data Analysis", "Spanish for Beginners", "Web Design", "Photography Basics"],
                   date=["the 12th", "next Friday", "the end of the month"]),
        requests={
            "certificate": dict(
                keywords=["the certificate", "my certificate"],
                openers=[("I finished the {course} course but I haven't received a certificate.", "Congratulations! Did you pass the final quiz?"),
                         ("Where do I download my certificate?", "It's in your profile once the course is complete. Which course is it?")],
                steps=[("Yes, with 85 percent.", "Great. Certificates are issued within 48 hours of passing."),
                       ("It's been three days.", "Sorry, let me reissue it now."),
                       ("Thanks. Can I add it to my CV?", "Yes, there's a share link for your CV and profiles.")],
                followups=[("has the certificate been reissued yet?", "Yes, it's in your profile now."),
                           ("does the certificate show my grade?", "Yes, it shows your final score.")]),
            "refund-course": dict(
                keywords=["the refund", "the course refund", "my money back"],
                openers=[("I'd like a refund for a course I bought by mistake.", "I can help. When did you buy it?"),
                         ("The {course} course isn't what I expected, can I get my money back?", "Possibly. How much of it have you watched?")],
                steps=[("Two days ago.", "Then you're within the fourteen-day refund window."),
                       ("I haven't started it at all.", "Good, then a full refund is possible."),
                       ("Please go ahead.", "Done, the refund will reach your card in five days.")],
                followups=[("will the refund go to the card I paid with?", "Yes, the same card."),
                           ("is the course still in my account after the refund?", "No, access ends when the refund is made.")]),
            "deadline": dict(
                keywords=["the deadline", "the assignment", "the extension"],
                openers=[("Can I get an extension for my assignment?", "Possibly. When is it due?"),
                         ("I'm going to miss the assignment deadline because I'm ill.", "Sorry to hear that. When is it due?")],
                steps=[("It's due on {date}.", "I can extend it by one week."),
                       ("Do I need a doctor's note?", "Not for a one-week extension."),
                       ("Great, one week is enough.", "Done, the new deadline shows on your dashboard.")],
                followups=[("does the extension change the exam date too?", "No, only the assignment deadline."),
                           ("can I see the new deadline in the app?", "Yes, on your dashboard.")]),
            "login-problem": dict(
                keywords=["the login problem", "signing in", "my account access"],
                openers=[("I can't log in to my account, it says my password is wrong.", "Let's fix that. Have you tried resetting it?"),
                         ("My account got locked after too many attempts.", "I can unlock it. Which email do you sign in with?")],
                steps=[("The reset email never arrives.", "Please check spam. I can also send it again now."),
                       ("Found it in spam, thanks.", "Great, the link is valid for one hour."),
                       ("It worked, I'm in.", "Perfect. You may want to turn on two-step login.")],
                followups=[("how do I turn on two-step login?", "Under security settings in your profile."),
                           ("will my account lock again if I mistype?", "Only after five wrong attempts in a row.")]),
        }),
    "pharmacy": dict(
        system="You are {agent}, an assistant at {company}, an online pharmacy.",
        companies=["MediPost", "Wellbeing Pharmacy", "CareChem"],
        slots=dict(medicine=["my inhaler", "my blood pressure tablets", "my allergy tablets"],
                   day=["Thursday", "Saturday", "Wednesday"]),
        requests={
            "repeat-prescription": dict(
                keywords=["the prescription", "my repeat prescription", "{medicine}"],
                openers=[("I need to reorder {medicine}.", "Of course. Is it a repeat prescription from your GP?"),
                         ("My repeat prescription hasn't arrived.", "Let me check. When did you order it?")],
                steps=[("Yes, it's a repeat.", "Thanks. We've asked your GP to approve it."),
                       ("How long does that take?", "Usually two working days."),
                       ("And then it's posted?", "Yes, by tracked post, arriving in one or two days.")],
                followups=[("has the GP approved my prescription yet?", "Yes, it was approved this morning."),
                           ("can the prescription be delivered on {day}?", "Yes, I can request a {day} delivery.")]),
            "wrong-medicine": dict(
                keywords=["the wrong medicine", "the mix-up", "the wrong box"],
                openers=[("I've been sent the wrong strength of tablets.", "I'm very sorry. Please don't take them. What strength did you get?"),
                         ("The box I received isn't my medication.", "Please don't take it. What does the label say?")],
                steps=[("It says 20 milligrams instead of 10.", "Thanks. We'll send the correct ones today."),
                       ("What do I do with the wrong ones?", "Please return them with the prepaid envelope."),
                       ("Will the right ones come tomorrow?", "Yes, by next-day delivery.")],
                followups=[("is the correct medicine definitely on its way?", "Yes, it left this afternoon."),
                           ("did you get the wrong tablets I sent back?", "Yes, they arrived safely.")]),
            "consultation": dict(
                keywords=["the consultation", "the appointment", "the video call"],
                openers=[("Can I book a video consultation with a pharmacist?", "Yes. What would you like to discuss?"),
                         ("I'd like advice about side effects from a pharmacist.", "I can book a short video call. Which day suits you?")],
                steps=[("Some side effects from new tablets.", "I can book you a fifteen-minute call."),
                       ("{day} afternoon, please.", "Booked for {day} at three o'clock."),
                       ("Do I need to prepare anything?", "Please have the medicine box with you.")],
                followups=[("is the consultation still at three on {day}?", "Yes, you'll get a link an hour before."),
                           ("can I move the video call to the morning?", "Yes, there's a slot at ten.")]),
            "delivery-address": dict(
                keywords=["the address", "the delivery address"],
                openers=[("I'm staying with my daughter, can you deliver there instead?", "Yes. What's the address?"),
                         ("Please change the delivery address on my account.", "Sure. What's the new address?")],
                steps=[("It's 9 Willow Crescent.", "Thanks, I've updated it to 9 Willow Crescent."),
                       ("Just for the next order, please.", "Okay, only the next order goes there."),
                       ("Thank you.", "You're welcome.")],
                followups=[("is the next order going to Willow Crescent?", "Yes, 9 Willow Crescent."),
                           ("will the address go back to my home after that?", "Yes, automatically.")]),
        }),
})

# Asides: topics of their own for a turn or two. Side questions (a keyword, a second turn, a later
# revisit), small talk, contact preferences (with a later confirmation that returns to them).
SIDE = [
    dict(kw="the station branch", turns=[("Is there a branch near the station?", "Yes, there's one just across the road from the station."), ("Is it open late?", "Until eight every weekday.")],
         revisit=("is the station branch open on Saturdays too?", "Yes, nine till five on Saturdays.")),
    dict(kw="the app", turns=[("Do you have an app for iPhone?", "Yes, it's in the App Store."), ("And for Android?", "Yes, in the Play Store too.")],
         revisit=("does the app work on tablets as well?", "Yes, on phones and tablets.")),
    dict(kw="the opening hours", turns=[("What are your opening hours on Sundays?", "We're open ten till four on Sundays.")],
         revisit=("were you open until four on Sundays?", "Yes, ten till four.")),
    dict(kw="my email address", turns=[("Can I change the email address on my account?", "Yes, under profile and then contact details.")],
         revisit=("do I need to confirm the new email address?", "Yes, we send a confirmation link.")),
    dict(kw="the student discount", turns=[("Is there a student discount?", "Yes, ten percent with a valid student card."), ("How do I prove I'm a student?", "Upload your student card in the app.")],
         revisit=("does the student discount apply straight away?", "Yes, from your next payment.")),
    dict(kw="my password", turns=[("How do I reset my password?", "Use the forgotten password link on the login page."), ("I never get the reset email.", "Check your spam folder, or I can send it again.")],
         revisit=("the password reset worked, thanks. Does it log out my other devices?", "Yes, all other devices are signed out.")),
    dict(kw="the referral scheme", turns=[("Do you have a referral scheme?", "Yes, you both get a credit when a friend joins.")],
         revisit=("how much is the referral credit?", "Ten pounds each.")),
    dict(kw="the helpline", turns=[("Is there a phone number I can call instead?", "Yes, our helpline is open eight till eight.")],
         revisit=("is the helpline free to call?", "Yes, it's a free number.")),
    dict(kw="paper statements", turns=[("Can I get my statements on paper?", "Yes, you can switch to paper in your settings.")],
         revisit=("is there a charge for paper statements?", "No, paper statements are free.")),
    dict(kw="bank holidays", turns=[("Are you open on bank holidays?", "Yes, with shorter hours, ten till two.")],
         revisit=("so on the bank holiday it's ten till two?", "Exactly, ten till two.")),
    dict(kw="the newsletter", turns=[("How do I stop your marketing emails?", "Click unsubscribe at the bottom of any email."), ("Will I still get receipts?", "Yes, receipts are sent regardless.")],
         revisit=("I unsubscribed but still get the newsletter.", "It can take up to a week to stop completely.")),
    dict(kw="the gift card", turns=[("Do you sell gift cards?", "Yes, from ten to a hundred pounds, on our website.")],
         revisit=("can gift cards be sent by email?", "Yes, as e-gift cards.")),
    dict(kw="accessibility", turns=[("Is your website screen-reader friendly?", "Yes, it's tested with the main screen readers.")],
         revisit=("can I get documents in braille as well?", "Yes, on request.")),
    dict(kw="the complaint", turns=[("How do I make a formal complaint about a staff member?", "You can use the complaints form on our website."), ("How long do you take to reply?", "Within ten working days.")],
         revisit=("is there a reference number for complaints?", "Yes, you get one when you submit the form.")),
    dict(kw="my data", turns=[("Can I get a copy of the data you hold on me?", "Yes, you can request it and we reply within a month.")],
         revisit=("do I request my data by email?", "Yes, or through the privacy page.")),
    dict(kw="the loyalty points", turns=[("Do I earn loyalty points on this?", "Yes, one point per pound spent.")],
         revisit=("how do I use my loyalty points?", "You can redeem them at checkout.")),
]
SIDE_CUES = ["While I'm here, ", "By the way, ", "Quick question: ", "Unrelated, but ", "Oh, and ", "Also, ", "",
             "Before I forget, ", "Random question: ", "", "Totally different thing, ", "", "Oh, one thing: ",
             "Just wondering, ", "On another note, "]
SMALL_TALK = [("Sorry, my dog keeps barking at the postman.", "Ha, no problem at all."),
              ("It's been such a long week, honestly.", "I hear you. Hopefully the weekend is relaxing."),
              ("You're much quicker than the last person I spoke to.", "That's kind of you, thanks!"),
              ("The weather here is awful today.", "Sorry to hear that, perfect day to stay in."),
              ("Are you a real person, by the way?", "I'm a virtual assistant, but I can get a colleague if you like."),
              ("Hang on, someone's at the door.", "No rush, I'll be here."),
              ("Sorry, I'm typing on my phone on the bus.", "No worries, take your time."),
              ("My coffee just went cold waiting for the website to load, ha.", "Oh no! Sorry about that."),
              ("Do you enjoy working in support?", "I do, every chat is a bit different."),
              ("I'm off on holiday next week, can't wait.", "Lovely! Anywhere nice?"),
              ("Sorry for all the questions today.", "Not at all, that's what I'm here for."),
              ("My cat just walked across the keyboard, sorry.", "Ha, cats always know when you're busy.")]
PREFERENCES = [(("Please only contact me by email, I can't take calls at work.", "Noted, we'll only contact you by email."),
                ("Just to check, you'll email me rather than call, right?", "Yes, email only, as you asked.")),
               (("Text messages are best for me, not emails.", "Got it, we'll use text messages."),
                ("You'll text me the update, yes?", "Yes, by text message as you prefer.")),
               (("Please don't call before ten in the morning, I work nights.", "Understood, no calls before ten."),
                ("And remember, no calls before ten, please.", "Of course, it's on your profile.")),
               (("I'd prefer letters in large print, my eyesight isn't great.", "No problem, I've set large print for your letters."),
                ("Will the letters really be in large print?", "Yes, large print is set on your account.")),
               (("Could you write to me in Spanish from now on? It's easier for me.", "Of course, I've set Spanish as your language."),
                ("The emails will be in Spanish, right?", "Yes, all emails will be in Spanish.")),
               (("Please call my mobile, not the landline.", "Noted, we'll only call your mobile."),
                ("Remember, mobile only, not the landline.", "Yes, mobile only, it's noted.")),
               (("I'm hard of hearing, so please don't phone me, use chat or email.", "Understood, chat or email only."),
                ("So nobody will phone me, right?", "Right, no phone calls, only chat or email."))]
NEW_CUES = ["Another thing: ", "Separately, ", "I also have another question. ", "One more thing. ", "Also, ", "",
            "", "Something else: ", "Different question: ", "Next thing: ", "", "Oh, and ", "While I have you, ",
            "There's something else too. ", "Now, ", "", "I have a second problem. "]
RETURN_CUES = ["Going back to {kw}, ", "Back to {kw}: ", "About {kw} again, ", "Coming back to {kw}, ", "On {kw}, ",
               "Regarding {kw}, ", "One more question about {kw}: ", "Sorry, back to {kw}. ", "And {kw}: ",
               "Can we go back to {kw}? ", "Just one more on {kw}: ", "Right, {kw}. ", "Returning to {kw}, ",
               "As for {kw}, ", "Also about {kw}, "]
CLOSINGS = [("That's everything, thanks for your help.", "You're welcome, have a great day!"),
            ("Okay, that's all for today.", "Thanks for getting in touch. Bye for now!"),
            ("Perfect, thank you so much.", "My pleasure. Take care!"),
            ("Great, I think that covers it. Bye!", "Glad I could help. Goodbye!"),
            ("Thanks, you've been very helpful.", "You're welcome! Anything else, just get in touch."),
            ("Alright, I'll leave it there. Cheers.", "Cheers, have a good day!")]
AGENTS = ["Sam", "Alex", "Mia", "Noah", "Ivy", "Theo", "Lena", "Omar"]


def fill(text: str, slots: dict) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: slots[m.group(1)], text)


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def make(rng: random.Random, did: str, domain_name: str) -> dict:
    domain = DOMAINS[domain_name]
    slots = {k: rng.choice(v) for k, v in domain["slots"].items()}
    names = rng.sample(sorted(domain["requests"]), rng.randint(2, 4))
    state = {n: dict(steps=list(domain["requests"][n]["steps"]), followups=rng.sample(
        domain["requests"][n]["followups"], len(domain["requests"][n]["followups"])), started=False) for n in names}
    asides = rng.sample(SIDE, 3)
    revisits: list = []
    prefs = rng.sample(PREFERENCES, 1)
    smalls = rng.sample(SMALL_TALK, 2)
    turns: list[dict] = []

    def say(topic: str, user: str, assistant: str) -> None:
        turns.append({"user": cap(fill(user, slots)), "assistant": fill(assistant, slots), "topic": topic})

    def work(name: str, n: int, cue: str | None) -> None:
        """n turns of request `name`: its opener the first time; else cue None goes on with its next step
        (after a short interruption), and a cue ("" for none) picks it up with a follow-up that names it."""
        req, st = domain["requests"][name], state[name]
        if not st["started"]:
            user, assistant = rng.choice(req["openers"])
            say(name, (rng.choice(NEW_CUES) if turns else "") + user, assistant)
            st["started"] = True
            n -= 1
        elif (cue is not None or not st["steps"]) and st["followups"]:
            user, assistant = st["followups"].pop()
            prefix = cue.format(kw=rng.choice(req["keywords"])) if cue else ""
            say(name, prefix + (user if prefix and not prefix.endswith(". ") else cap(user)), assistant)
            n -= 1
        for _ in range(n):
            if st["steps"]:
                say(name, *st["steps"].pop(0))
            elif st["followups"]:
                user, assistant = st["followups"].pop()
                say(name, cap(user), assistant)

    def aside() -> None:
        kind = rng.random()
        if kind < 0.55 and asides:
            side = asides.pop()
            label = f"side-question-{len(turns)}"
            first_user, first_reply = side["turns"][0]
            say(label, rng.choice(SIDE_CUES) + first_user[0].lower() + first_user[1:] if rng.random() < 0.8
                else first_user, first_reply)
            if len(side["turns"]) > 1 and rng.random() < 0.5:
                say(label, *side["turns"][1])
            revisits.append((label, side))
        elif kind < 0.8 and prefs and not any(t["topic"] == "contact-preference" for t in turns):
            say("contact-preference", *prefs[0][0])
        elif smalls:
            say(f"small-talk-{len(turns)}", *smalls.pop())

    def revisit() -> bool:
        """Come back to an earlier side question (with a cue naming it, or without one)."""
        if not revisits:
            return False
        label, side = revisits.pop(rng.randrange(len(revisits)))
        user, reply = side["revisit"]
        cue = rng.choice(RETURN_CUES).format(kw=side["kw"]) if rng.random() < 0.5 else ""
        say(label, cue + (user if cue and not cue.endswith((". ", "? ")) else cap(user)), reply)
        return True

    # the plan: open the first request, then alternate work, asides, new requests and returns
    work(names[0], rng.randint(2, 4), None)
    pending = names[1:]
    active = names[0]
    for _ in range(rng.randint(6, 9)):
        r = rng.random()
        started = [n for n in names if state[n]["started"]]
        if r < 0.3:
            aside()
            if rng.random() < 0.75:  # pick the interrupted request back up, usually without a cue
                work(active, rng.randint(1, 2), rng.choice(RETURN_CUES) if rng.random() < 0.3 else None)
        elif r < 0.55 and pending:
            active = pending.pop(0)
            work(active, rng.randint(2, 4), None)
        elif r < 0.85 and len(started) > 1:
            back = rng.choice([n for n in started if n != active])
            active = back
            work(back, rng.randint(1, 3), rng.choice(RETURN_CUES) if rng.random() < 0.6 else "")
        elif any(t["topic"] == "contact-preference" for t in turns) and rng.random() < 0.4:
            say("contact-preference", *prefs[0][1])
        elif rng.random() < 0.5 and revisit():
            if rng.random() < 0.7:
                work(active, rng.randint(1, 2), rng.choice(RETURN_CUES) if rng.random() < 0.3 else None)
        else:
            work(active, rng.randint(1, 2), None)
    say("wrap-up", *rng.choice(CLOSINGS))
    system = domain["system"].format(agent=rng.choice(AGENTS), company=rng.choice(domain["companies"]))
    return {"id": did, "domain": domain_name, "system": system, "turns": turns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=180)
    ap.add_argument("--out", default="data/topics/conversations.jsonl")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    names = sorted(DOMAINS)
    dialogues = [make(random.Random(rng.random()), f"conv-{i + 1:04d}", names[i % len(names)]) for i in range(args.n)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dialogues), encoding="utf-8")
    turns = [len(d["turns"]) for d in dialogues]
    bounds = [sum(a["topic"] != b["topic"] for a, b in zip(d["turns"], d["turns"][1:])) for d in dialogues]
    print(f"wrote {len(dialogues)} dialogues to {out}: {sum(turns)} turns ({min(turns)}-{max(turns)} per dialogue), "
          f"{sum(bounds)} boundaries")


if __name__ == "__main__":
    main()
