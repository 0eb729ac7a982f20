"""Generate the bundled XSum-style sample data (``data/sample/*.jsonl``).

Every article is written from templates, word lists and a seeded ``random.Random``, so
the output is the same on every machine and the script's output is committed next to it.
Each summary restates the article's key facts (who, where, what, how many), so a model
fine-tuned on it has something learnable to do.

    python -m data.make_sample            # rewrites data/sample/
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
TRAIN_FILE = "xsum_sample.jsonl"
VALIDATION_FILE = "xsum_sample_validation.jsonl"

FIRST_NAMES = [
    "Alice", "Bryn", "Carys", "Dafydd", "Eleanor", "Fiona", "Gareth", "Hamish", "Imran",
    "Joanna", "Kieran", "Leila", "Morag", "Niamh", "Owen", "Priya", "Rhys", "Siobhan",
    "Tomasz", "Usha", "Victor", "Wendy", "Yusuf", "Zara", "Callum", "Ewan", "Aisha", "Declan",
]
SURNAMES = [
    "Anderson", "Baker", "Campbell", "Davies", "Evans", "Fraser", "Gallagher", "Hughes",
    "Iqbal", "Jones", "Kowalski", "Lloyd", "MacLeod", "Nolan", "O'Brien", "Patel", "Quinn",
    "Roberts", "Singh", "Thomson", "Walsh", "Young", "Murray", "Reid", "Khan", "Morgan",
]
TOWNS = [
    "Aberdeen", "Bangor", "Cardiff", "Derry", "Dundee", "Exeter", "Galway", "Inverness",
    "Leeds", "Lincoln", "Newport", "Norwich", "Oban", "Perth", "Plymouth", "Preston",
    "Swansea", "Stirling", "Wrexham", "York", "Belfast", "Carlisle", "Hull", "Truro",
]
REGIONS = [
    "the Highlands", "north Wales", "the West Midlands", "County Antrim", "Cornwall",
    "the Borders", "Yorkshire", "Fife", "Gwynedd", "East Anglia", "Cumbria", "Lancashire",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]
CLUB_SUFFIXES = ["United", "City", "Rovers", "Athletic", "Town", "Albion", "Wanderers"]
COMPANY_WORDS = ["Northern", "Atlas", "Harbour", "Summit", "Greenfield", "Keystone", "Meridian"]
COMPANY_KINDS = ["Foods", "Engineering", "Logistics", "Energy", "Textiles", "Software", "Retail"]
ANIMALS = ["otters", "red squirrels", "puffins", "seals", "barn owls", "pine martens", "bats"]
BUILDINGS = ["library", "swimming pool", "community centre", "museum", "theatre", "market hall"]
ILLNESSES = ["flu", "norovirus", "measles", "chest infections", "whooping cough"]
CROPS = ["potatoes", "barley", "strawberries", "apples", "wheat", "oats"]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def _pick(rng: random.Random, sentences: list[str], k: int) -> list[str]:
    return rng.sample(sentences, min(k, len(sentences)))


def _sport(rng: random.Random) -> tuple[str, str]:
    home = f"{rng.choice(TOWNS)} {rng.choice(CLUB_SUFFIXES)}"
    away = f"{rng.choice([t for t in TOWNS if not home.startswith(t)])} {rng.choice(CLUB_SUFFIXES)}"
    goals_home, goals_away = rng.randint(2, 5), rng.randint(0, 1)
    scorer, manager = _person(rng), _person(rng)
    minute = rng.randint(5, 88)
    crowd = rng.randint(3, 40) * 1000 + rng.randint(0, 999)
    position = rng.randint(1, 12)
    opening = (
        f"{home} beat {away} {goals_home}-{goals_away} on {rng.choice(WEEKDAYS)} to move up to "
        f"{_ordinal(position)} place in the league table."
    )
    body = [
        f"{scorer} opened the scoring after {minute} minutes with a low shot from the edge of the area.",
        "The visitors had chances before the break but could not find a way past the home goalkeeper.",
        f"A crowd of {crowd:,} watched the match, the largest at the ground this season.",
        f"{away} had won their previous three games and arrived as favourites.",
        f"Manager {manager} said: \"The players showed real character and deserved the win.\"",
        f"The home side will now travel to {rng.choice(TOWNS)} next weekend.",
        f"{scorer} has now scored {rng.randint(6, 21)} goals in all competitions this season.",
        "Supporters stayed behind after the final whistle to applaud the team.",
    ]
    summary = f"{home} beat {away} {goals_home}-{goals_away}, with {scorer} scoring the opening goal."
    return _assemble(rng, opening, body), summary


def _business(rng: random.Random) -> tuple[str, str]:
    company = f"{rng.choice(COMPANY_WORDS)} {rng.choice(COMPANY_KINDS)}"
    town = rng.choice(TOWNS)
    jobs = rng.randint(2, 60) * 10
    boss = _person(rng)
    growing = rng.random() < 0.5
    investment = rng.randint(2, 90)
    if growing:
        opening = f"{company} is to create {jobs} new jobs at its site in {town} as part of a {investment}m pound expansion."
        summary = f"{company} plans to create {jobs} jobs in {town} with a {investment}m pound investment."
        extra = f"Recruitment for the new roles is expected to begin in {rng.choice(MONTHS)}."
    else:
        opening = f"{company} has announced that {jobs} jobs are at risk at its plant in {town}."
        summary = f"Up to {jobs} jobs are at risk at {company}'s plant in {town}."
        extra = f"Unions said they would seek urgent talks with management in {rng.choice(MONTHS)}."
    body = [
        extra,
        f"Chief executive {boss} said the decision followed a review of the firm's operations.",
        f"The company employs about {jobs * rng.randint(3, 9)} people across {rng.randint(2, 9)} sites.",
        f"Sales rose by {rng.randint(2, 19)}% last year, although costs have also increased sharply.",
        f"Local councillors described the news as an important moment for {town}.",
        f"The firm was founded in {rng.randint(1890, 2005)} and supplies customers in {rng.randint(3, 40)} countries.",
        f"Economists said rising energy prices were putting pressure on manufacturers in {rng.choice(REGIONS)}.",
    ]
    return _assemble(rng, opening, body), summary


def _council(rng: random.Random) -> tuple[str, str]:
    town = rng.choice(TOWNS)
    building = rng.choice(BUILDINGS)
    cost = rng.randint(1, 25)
    leader = _person(rng)
    votes_for, votes_against = rng.randint(20, 40), rng.randint(2, 19)
    opening = (
        f"Councillors in {town} have approved plans for a new {building} costing {cost}m pounds."
    )
    body = [
        f"The proposal was backed by {votes_for} votes to {votes_against} at a meeting on {rng.choice(WEEKDAYS)}.",
        f"Council leader {leader} said the {building} would serve families across {rng.choice(REGIONS)}.",
        "Opponents argued that the money should be spent on repairing roads instead.",
        f"Work is due to start in {rng.choice(MONTHS)} and should take about {rng.randint(9, 30)} months.",
        f"The old {building} closed {rng.randint(2, 11)} years ago because of safety concerns.",
        f"A public consultation received more than {rng.randint(3, 20) * 100} responses.",
        "Part of the cost will be met by a grant from the government.",
    ]
    summary = f"A new {cost}m pound {building} in {town} has been approved by councillors."
    return _assemble(rng, opening, body), summary


def _weather(rng: random.Random) -> tuple[str, str]:
    region = rng.choice(REGIONS)
    hazard = rng.choice(["heavy rain", "snow", "strong winds", "flooding", "ice"])
    homes = rng.randint(1, 90) * 100
    hours = rng.randint(6, 48)
    forecaster = _person(rng)
    opening = f"A yellow weather warning for {hazard} has been issued for {region} for the next {hours} hours."
    body = [
        f"About {homes:,} homes were left without power overnight, according to the network operator.",
        f"Several roads near {rng.choice(TOWNS)} were closed and drivers were told to avoid unnecessary journeys.",
        f"Forecaster {forecaster} said conditions were expected to improve by {rng.choice(WEEKDAYS)}.",
        f"Schools in {rng.choice(TOWNS)} opened late while staff cleared paths and car parks.",
        f"Train services were cancelled between {rng.choice(TOWNS)} and {rng.choice(TOWNS)}.",
        f"Emergency services said they had received {rng.randint(20, 300)} calls since the evening.",
        "Residents were advised to check on elderly neighbours.",
    ]
    summary = f"A warning for {hazard} is in place across {region}, where {homes:,} homes lost power."
    return _assemble(rng, opening, body), summary


def _science(rng: random.Random) -> tuple[str, str]:
    animal = rng.choice(ANIMALS)
    region = rng.choice(REGIONS)
    percent = rng.randint(10, 80)
    years = rng.randint(3, 25)
    researcher = _person(rng)
    rising = rng.random() < 0.5
    trend = "risen" if rising else "fallen"
    opening = f"The number of {animal} in {region} has {trend} by {percent}% over the past {years} years, a study has found."
    body = [
        f"Researchers from the university in {rng.choice(TOWNS)} counted the animals at {rng.randint(12, 150)} sites.",
        f"Dr {researcher}, who led the study, said the results were {'encouraging' if rising else 'worrying'}.",
        f"Volunteers helped to collect data every {rng.choice(['spring', 'summer', 'autumn', 'winter'])}.",
        "The team believes changes in farming and habitat explain much of the trend.",
        "The findings have been published in a scientific journal.",
        "Conservation groups called for long-term monitoring of the population.",
        f"Similar surveys are now planned in {rng.choice(REGIONS)}.",
    ]
    summary = f"{animal.capitalize()} numbers in {region} have {trend} by {percent}% in {years} years, researchers say."
    return _assemble(rng, opening, body), summary


def _health(rng: random.Random) -> tuple[str, str]:
    illness = rng.choice(ILLNESSES)
    town = rng.choice(TOWNS)
    cases = rng.randint(12, 400)
    wards = rng.randint(1, 6)
    doctor = _person(rng)
    opening = f"A hospital in {town} has closed {wards} wards to new patients after {cases} cases of {illness}."
    body = [
        "Visitors have been asked to stay away unless their visit is essential.",
        f"Medical director Dr {doctor} said staff were working hard to contain the outbreak.",
        f"Cases of {illness} usually rise during the {rng.choice(['winter', 'autumn', 'spring'])} months.",
        "The health board said planned operations would go ahead where possible.",
        "People with symptoms were urged to contact their GP rather than go to the emergency department.",
        f"Last year a similar outbreak led to the closure of {rng.randint(1, 8)} wards for {rng.randint(3, 20)} days.",
    ]
    summary = f"{wards} wards at a hospital in {town} have closed after {cases} cases of {illness}."
    return _assemble(rng, opening, body), summary


def _crime(rng: random.Random) -> tuple[str, str]:
    name = _person(rng)
    age = rng.randint(19, 71)
    town = rng.choice(TOWNS)
    item = rng.choice(["cars", "bicycles", "laptops", "power tools", "watches", "phones"])
    count = rng.randint(5, 60)
    months = rng.randint(6, 60)
    opening = f"A {age}-year-old man from {town} has been jailed for {months} months for stealing {count} {item}."
    body = [
        f"{name} admitted the thefts when he appeared at court on {rng.choice(WEEKDAYS)}.",
        f"The court heard the offences took place between {rng.choice(MONTHS)} and {rng.choice(MONTHS)} last year.",
        f"Police recovered most of the {item} during a search of a lock-up garage.",
        "The judge said the thefts had caused real distress to the victims.",
        "A detective said officers were pleased with the outcome of the case.",
        f"Items worth about {rng.randint(2, 90)},000 pounds were taken in total.",
    ]
    summary = f"{name}, {age}, from {town}, has been jailed for stealing {count} {item}."
    return _assemble(rng, opening, body), summary


def _transport(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(TOWNS, 2)
    minutes = rng.randint(10, 45)
    cost = rng.randint(20, 900)
    minister = _person(rng)
    year = rng.randint(2026, 2035)
    opening = f"A new rail link between {a} and {b} will cut journey times by {minutes} minutes, the government has said."
    body = [
        f"The project is expected to cost {cost}m pounds and open in {year}.",
        f"Transport minister {minister} said the line would bring the two cities closer together.",
        f"Trains will run every {rng.choice([15, 20, 30, 60])} minutes during the day.",
        f"Business leaders in {a} welcomed the announcement.",
        "Campaigners said the money would be better spent on local bus services.",
        f"About {rng.randint(2, 30)},000 passengers are expected to use the line each week.",
        "Construction work will require the closure of the existing station for several months.",
    ]
    summary = f"A {cost}m pound rail link will cut journeys between {a} and {b} by {minutes} minutes."
    return _assemble(rng, opening, body), summary


def _farming(rng: random.Random) -> tuple[str, str]:
    crop = rng.choice(CROPS)
    region = rng.choice(REGIONS)
    percent = rng.randint(10, 60)
    farmer = _person(rng)
    cause = rng.choice(["a wet spring", "a summer drought", "late frosts", "a shortage of pickers"])
    opening = f"Farmers in {region} say this year's {crop} harvest is down by {percent}% because of {cause}."
    body = [
        f"{farmer}, who farms near {rng.choice(TOWNS)}, said it was the worst year he could remember.",
        f"Shoppers could see higher prices for {crop} in the coming months.",
        "The farming union has asked the government for emergency support.",
        "Some growers have already left fields unharvested.",
        f"The harvest usually brings in about {rng.randint(20, 300)}m pounds to the local economy.",
        "Experts warned that such seasons could become more common.",
    ]
    summary = f"The {crop} harvest in {region} has fallen by {percent}% after {cause}."
    return _assemble(rng, opening, body), summary


def _culture(rng: random.Random) -> tuple[str, str]:
    artist = _person(rng)
    town = rng.choice(TOWNS)
    event = rng.choice(["music festival", "book festival", "arts festival", "film festival"])
    visitors = rng.randint(5, 90) * 1000
    days = rng.randint(2, 10)
    opening = f"{artist} has been announced as the headline act at this year's {town} {event}."
    body = [
        f"The {event} will run for {days} days in {rng.choice(MONTHS)}.",
        f"Organisers expect about {visitors:,} visitors, a record for the event.",
        f"Tickets go on sale on {rng.choice(WEEKDAYS)} morning.",
        f"{artist} said: \"I have wonderful memories of {town} and cannot wait to come back.\"",
        f"The event was first held in {rng.randint(1960, 2015)} and has grown every year since.",
        "Local hotels said they were already close to fully booked.",
        "A free programme for schools will also be offered.",
    ]
    summary = f"{artist} will headline the {days}-day {town} {event}, which expects {visitors:,} visitors."
    return _assemble(rng, opening, body), summary


TOPICS: list[Callable[[random.Random], tuple[str, str]]] = [
    _sport, _business, _council, _weather, _science, _health, _crime, _transport, _farming,
    _culture,
]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _background(rng: random.Random) -> list[str]:
    town, region = rng.choice(TOWNS), rng.choice(REGIONS)
    return [
        f"A spokesperson for the council in {town} said further updates would be published on {rng.choice(WEEKDAYS)}.",
        f"The issue was raised in parliament by the member for {town}, {_person(rng)}.",
        f"Similar cases have been reported in {region} and in {rng.choice(TOWNS)} in recent years.",
        f"Figures released in {rng.choice(MONTHS)} showed a change of {rng.randint(2, 30)}% compared with the year before.",
        f"Local resident {_person(rng)} said many people in the area had been talking about little else.",
        f"A report on the matter is due to be published in {rng.choice(MONTHS)} next year.",
        f"Community groups in {region} have set up a meeting to discuss what happens next.",
    ]


def _assemble(rng: random.Random, opening: str, body: list[str]) -> str:
    # The fixed lead, then most of the topic's sentences and some background, shuffled:
    # about 80-200 words, with the key facts always in the lead.
    chosen = _pick(rng, body, rng.randint(len(body) - 1, len(body)))
    chosen += _pick(rng, _background(rng), rng.randint(2, 4))
    rng.shuffle(chosen)
    return " ".join([opening, *chosen])


def make_records(num_records: int, seed: int, id_prefix: str) -> list[dict[str, str]]:
    """Return ``num_records`` records ``{"id", "document", "summary"}``, fixed by ``seed``."""
    rng = random.Random(seed)
    records = []
    for i in range(num_records):
        document, summary = rng.choice(TOPICS)(rng)
        records.append({"id": f"{id_prefix}-{i:04d}", "document": document, "summary": summary})
    return records


def write_jsonl(records: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=SAMPLE_DIR)
    parser.add_argument("--num-train", type=int, default=300)
    parser.add_argument("--num-validation", type=int, default=40)
    args = parser.parse_args()
    write_jsonl(make_records(args.num_train, seed=0, id_prefix="train"), args.out_dir / TRAIN_FILE)
    write_jsonl(
        make_records(args.num_validation, seed=1, id_prefix="validation"),
        args.out_dir / VALIDATION_FILE,
    )


if __name__ == "__main__":
    main()
