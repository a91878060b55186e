"""The synthetic English-like corpus of the test assets (scripts/generate_test_assets.py).

Documents in C4's JSON-lines format (``{"text", "timestamp", "url"}``) filled from templates and
word lists with a seeded ``random.Random``: the same seed gives the same documents, byte for byte.
It is NOT C4 text (the project cannot ship C4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import regex

# ----------------------------------------------------------------------------------------------
# Synthetic corpus
# ----------------------------------------------------------------------------------------------

# fmt: off
NAMES = [
    "Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Henry", "Iris", "Jack", "Karen",
    "Leo", "Maria", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tom", "Vera", "Will", "Zoe",
]
SURNAMES = [
    "Brown", "Clark", "Davis", "Evans", "Fisher", "Green", "Hill", "King", "Lewis", "Miller",
    "Moore", "Parker", "Reed", "Smith", "Taylor", "Walker", "White", "Young",
]
CITIES = [
    "Springfield", "Riverton", "Oakdale", "Lakeview", "Fairport", "Millbrook", "Westfield",
    "Brookside", "Hillcrest", "Maplewood", "Greenville", "Northgate", "Stonebridge", "Clearwater",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]

# Each topic: nouns, adjectives, verbs (base form), site words, and topic-specific sentences.
TOPICS: dict[str, dict[str, list[str]]] = {
    "cooking": {
        "nouns": ["recipe", "soup", "bread", "cake", "salad", "sauce", "pasta", "dinner", "kitchen",
                  "oven", "pan", "garlic", "onion", "butter", "flour", "cheese", "tomato", "chicken"],
        "adjs": ["fresh", "warm", "simple", "tasty", "quick", "healthy", "sweet", "spicy", "creamy"],
        "verbs": ["bake", "cook", "mix", "stir", "serve", "slice", "taste", "heat", "chop"],
        "site": ["kitchen", "recipes", "food", "table", "cook"],
        "sents": [
            "Preheat the oven to {num3} degrees and {verb} the {noun} for {num2} minutes.",
            "Add the {noun} and {verb} until the {noun2} is {adj}.",
            "This {adj} {noun} is perfect for a busy {day} night.",
            "You will need two cups of flour, one cup of butter and a little salt.",
            "My family loves this {noun} because it is {adj} and easy to make.",
            "Serve the {noun} warm with a {adj} {noun2} on the side.",
        ],
    },
    "gardening": {
        "nouns": ["garden", "plant", "flower", "seed", "soil", "tree", "rose", "lawn", "leaf",
                  "root", "tomato", "herb", "bed", "pot", "water", "sun", "spring", "weed"],
        "adjs": ["green", "small", "healthy", "bright", "dry", "wet", "tall", "young", "strong"],
        "verbs": ["plant", "water", "grow", "cut", "dig", "feed", "pick", "move", "protect"],
        "site": ["garden", "green", "grow", "plant", "yard"],
        "sents": [
            "Most {noun}s need at least {num1} hours of sun every day.",
            "In early {month}, {verb} the {noun} in {adj} soil.",
            "Water the {noun} in the morning so the {noun2} can dry before night.",
            "A {adj} {noun} will grow quickly if you {verb} it every week.",
            "Keep the soil {adj} but never wet, and remove every weed you see.",
        ],
    },
    "travel": {
        "nouns": ["trip", "hotel", "beach", "city", "museum", "train", "flight", "island",
                  "mountain", "river", "market", "tour", "room", "view", "road", "bridge"],
        "adjs": ["beautiful", "quiet", "busy", "old", "famous", "cheap", "friendly", "sunny", "long"],
        "verbs": ["visit", "explore", "book", "walk", "see", "enjoy", "find", "reach", "stay"],
        "site": ["travel", "trip", "journey", "world", "go"],
        "sents": [
            "We spent {num1} days in {city} and loved every minute of it.",
            "The {noun} is only a short walk from the {adj} {noun2}.",
            "If you {verb} {city} in {month}, the weather is {adj} and warm.",
            "Our {noun} had a {adj} view of the {noun2} and the old town.",
            "Take the train from {city} to {city2}; the ride takes about {num1} hours.",
        ],
    },
    "sports": {
        "nouns": ["team", "game", "season", "coach", "player", "match", "goal", "ball", "field",
                  "league", "fan", "score", "win", "race", "club", "training"],
        "adjs": ["strong", "young", "fast", "great", "tough", "final", "home", "close", "big"],
        "verbs": ["win", "play", "score", "train", "lose", "lead", "beat", "join", "finish"],
        "site": ["sports", "score", "league", "team", "play"],
        "sents": [
            "The {city} {noun} won the {adj} game by a score of {num1} to {num1b}.",
            "{name} scored twice in the second half to lead the {noun} to a {adj} win.",
            "Coach {surname} said the {noun} will {verb} hard before the next {noun2}.",
            "Fans filled the {noun} on {day} night to watch the {adj} match.",
            "This season the club has won {num2} games and lost only {num1}.",
        ],
    },
    "technology": {
        "nouns": ["phone", "computer", "app", "software", "screen", "battery", "update", "data",
                  "network", "laptop", "camera", "system", "device", "file", "password", "user"],
        "adjs": ["new", "fast", "smart", "secure", "simple", "small", "powerful", "free", "digital"],
        "verbs": ["install", "update", "download", "use", "connect", "save", "open", "check", "fix"],
        "site": ["tech", "digital", "code", "byte", "app"],
        "sents": [
            "The {adj} {noun} comes with a {num2} hour battery and a bright screen.",
            "To {verb} the {noun}, open the settings menu and tap the update button.",
            "Many users say the {noun} is {adj} and easy to use.",
            "Always {verb} your {noun} and use a strong password.",
            "The company will release the {adj} {noun} in {month} for {price}.",
        ],
    },
    "health": {
        "nouns": ["body", "sleep", "water", "exercise", "doctor", "diet", "heart", "health",
                  "habit", "stress", "walk", "muscle", "meal", "energy", "rest", "vitamin"],
        "adjs": ["healthy", "regular", "good", "daily", "balanced", "gentle", "active", "calm"],
        "verbs": ["drink", "sleep", "eat", "walk", "rest", "stretch", "breathe", "relax", "move"],
        "site": ["health", "well", "life", "fit", "care"],
        "sents": [
            "Doctors say that adults should {verb} at least {num1} hours every night.",
            "A {adj} {noun} can help your {noun2} stay strong.",
            "Try to {verb} a glass of water before every meal.",
            "Even a short walk of {num2} minutes a day is good for your heart.",
            "If you feel stress, take a deep breath and {verb} for a few minutes.",
        ],
    },
    "business": {
        "nouns": ["company", "market", "customer", "price", "sale", "office", "service", "product",
                  "team", "plan", "cost", "profit", "store", "job", "manager", "report"],
        "adjs": ["small", "local", "new", "strong", "annual", "online", "global", "careful"],
        "verbs": ["sell", "buy", "grow", "hire", "manage", "offer", "build", "reduce", "open"],
        "site": ["business", "market", "trade", "biz", "work"],
        "sents": [
            "The {adj} {noun} reported sales of {price} million last year.",
            "Our {noun} helps every customer find the right {noun2}.",
            "The company plans to {verb} {num2} new stores in {city} next year.",
            "A {adj} {noun} is the key to a strong business.",
            "Contact our team today for a free quote on any {noun}.",
        ],
    },
    "science": {
        "nouns": ["study", "cell", "star", "planet", "energy", "light", "water", "animal",
                  "experiment", "result", "scientist", "ocean", "climate", "atom", "model", "theory"],
        "adjs": ["new", "small", "large", "early", "surprising", "careful", "important", "deep"],
        "verbs": ["measure", "study", "find", "show", "observe", "test", "explain", "predict"],
        "site": ["science", "lab", "discover", "nature", "research"],
        "sents": [
            "A {adj} {noun} shows that the {noun2} can change in just {num2} years.",
            "Scientists at the University of {city} {verb} the {noun} every day.",
            "The {noun} is about {num3} times larger than the {noun2}.",
            "These results help {verb} how the {noun} works.",
            "In {year}, a team led by Dr. {surname} found a {adj} {noun}.",
        ],
    },
    "home": {
        "nouns": ["house", "room", "wall", "floor", "door", "window", "roof", "paint", "kitchen",
                  "table", "light", "chair", "bath", "home", "tool", "project"],
        "adjs": ["clean", "bright", "old", "modern", "cozy", "large", "white", "wooden", "easy"],
        "verbs": ["paint", "clean", "fix", "build", "move", "replace", "design", "repair", "sand"],
        "site": ["home", "house", "living", "design", "build"],
        "sents": [
            "Before you {verb} the {noun}, cover the floor with an old sheet.",
            "This {adj} {noun} makes the whole room feel bright and open.",
            "Our {num1} bedroom house has a large {noun} and a {adj} garden.",
            "You can {verb} a {noun} in one weekend with a few simple tools.",
            "The {noun} is {adj}, clean and ready to move in.",
        ],
    },
    "pets": {
        "nouns": ["dog", "cat", "puppy", "kitten", "pet", "bird", "fish", "toy", "bowl", "walk",
                  "food", "vet", "bed", "leash", "park", "tail"],
        "adjs": ["happy", "friendly", "small", "playful", "calm", "old", "lazy", "smart", "loyal"],
        "verbs": ["feed", "walk", "train", "brush", "adopt", "play", "love", "watch", "carry"],
        "site": ["pet", "paws", "animal", "furry", "dog"],
        "sents": [
            "Our {adj} {noun} loves to {verb} in the park every morning.",
            "{name} adopted a {noun} from the {city} shelter last {month}.",
            "Take your {noun} to the vet at least once a year.",
            "A {adj} {noun} needs fresh water and a warm bed.",
            "It only takes {num2} minutes a day to {verb} your {noun}.",
        ],
    },
    "music": {
        "nouns": ["song", "band", "album", "concert", "guitar", "piano", "singer", "stage",
                  "show", "record", "tour", "voice", "drum", "note", "crowd", "night"],
        "adjs": ["live", "new", "loud", "soft", "classic", "beautiful", "famous", "happy"],
        "verbs": ["sing", "play", "record", "listen", "perform", "write", "dance", "hear"],
        "site": ["music", "sound", "song", "tune", "band"],
        "sents": [
            "The {adj} {noun} will {verb} at the {city} Theater on {day}.",
            "{name} {surname} wrote the {noun} in just {num1} days.",
            "Tickets for the {noun} start at {price} and sell out fast.",
            "Their {adj} album has {num2} songs and a {adj2} sound.",
            "The crowd began to sing as the band started the last {noun}.",
        ],
    },
    "education": {
        "nouns": ["school", "student", "teacher", "class", "book", "lesson", "course", "test",
                  "library", "reading", "project", "college", "grade", "program", "skill", "child"],
        "adjs": ["new", "young", "local", "free", "online", "creative", "hard", "useful"],
        "verbs": ["learn", "teach", "read", "write", "study", "join", "finish", "help", "practice"],
        "site": ["school", "learn", "class", "study", "edu"],
        "sents": [
            "Every {noun} in the {adj} program will {verb} for {num2} minutes a day.",
            "The {city} library offers a {adj} {noun} for children on {day}.",
            "Students who {verb} every day do better on the final test.",
            "Ms. {surname} has been a teacher at the school for {num2} years.",
            "Sign up now for our {adj} {noun} starting in {month}.",
        ],
    },
    "weather": {
        "nouns": ["rain", "snow", "wind", "storm", "sun", "cloud", "morning", "week", "weekend",
                  "temperature", "forecast", "sky", "afternoon", "night", "coast", "valley"],
        "adjs": ["cold", "warm", "heavy", "light", "strong", "clear", "cloudy", "mild", "dry"],
        "verbs": ["expect", "bring", "move", "stay", "fall", "reach", "clear", "drop", "rise"],
        "site": ["weather", "sky", "forecast", "climate", "storm"],
        "sents": [
            "Expect {adj} {noun} on {day} with a high of {num2} degrees.",
            "A {adj} storm will move across {city} late in the {noun}.",
            "The {noun} will {verb} by the weekend, and the sky will be clear.",
            "Temperatures will drop to {num1} degrees on {day} night.",
            "Residents near the {noun} should prepare for {adj} wind.",
        ],
    },
    "community": {
        "nouns": ["park", "event", "festival", "market", "meeting", "church", "library", "center",
                  "neighbor", "volunteer", "town", "council", "fair", "road", "street", "family"],
        "adjs": ["local", "annual", "free", "public", "small", "friendly", "open", "summer"],
        "verbs": ["join", "help", "attend", "host", "celebrate", "meet", "share", "support", "visit"],
        "site": ["news", "local", "town", "city", "daily"],
        "sents": [
            "The {adj} {noun} will take place in {city} on {day}, {month} {date}.",
            "Everyone is welcome to {verb} the {noun} at the town center.",
            "More than {num3} people came to the {adj} {noun} last year.",
            "The council will meet on {day} to talk about the new {noun}.",
            "Volunteers are needed to {verb} at the {noun} this {month}.",
        ],
    },
}
# fmt: on

SHARED_SENTS = [
    "{name} {surname} from {city} says the {noun} is {adj}.",
    "There are {num2} {noun}s in {city} and many more in {city2}.",
    "The best time to {verb} the {noun} is in {month}.",
    "We asked {name} why the {noun} is so {adj}, and the answer was simple.",
    "On {day}, {name} and {name2} went to {city} to {verb} the {noun}.",
    "It is {adj}, it is {adj2}, and it is the best {noun} we have seen.",
    "Here are {num1} simple ways to {verb} your {noun} this year.",
    "Many people do not know that the {noun} can be {adj}.",
    "If you want to {verb} a {noun}, start with something {adj}.",
    "The {noun} was {adj} and the {noun2} was even better.",
]

OPENERS = [
    "{Topic} tips: how to {verb} a {adj} {noun}",
    "Why the {noun} in {city} is so {adj}",
    "{num1} things to know about your {noun}",
    "A {adj} guide to the {noun}",
    "The {adj} {noun} of {city}",
    "How {name} learned to {verb} the {noun}",
    "News from {city}: {adj} {noun} this {month}",
]

CLOSERS = [
    "Click here to read more.",
    "Share this post with your friends.",
    "Thanks for reading, and see you next week!",
    "Leave a comment below and tell us what you think.",
    "Contact us today to learn more.",
    "Posted by {name} {surname} on {month} {date}, {year}.",
    "Sign up for our newsletter to get more {topic} news.",
    "All rights reserved. Copyright {year}.",
]

TLDS = ["example", "example.com", "example.org", "example.net"]
SITE_SUFFIX = ["daily", "hub", "corner", "today", "life", "guide", "world", "blog", "zone"]


_A_AN = regex.compile(r"\b([Aa]) ([aeiouAEIOU])")


def _fill(template: str, rng: random.Random, topic: str, t: dict[str, list[str]]) -> str:
    """Fill one template's slots from the topic's vocabulary."""

    def pick(key: str) -> str:
        return rng.choice(t[key])

    nouns = rng.sample(t["nouns"], 2)
    adjs = rng.sample(t["adjs"], 2)
    names = rng.sample(NAMES, 2)
    cities = rng.sample(CITIES, 2)
    values = {
        "noun": nouns[0],
        "noun2": nouns[1],
        "adj": adjs[0],
        "adj2": adjs[1],
        "verb": pick("verbs"),
        "name": names[0],
        "name2": names[1],
        "surname": rng.choice(SURNAMES),
        "city": cities[0],
        "city2": cities[1],
        "day": rng.choice(DAYS),
        "month": rng.choice(MONTHS),
        "date": str(rng.randint(1, 28)),
        "year": str(rng.randint(1990, 2019)),
        "num1": str(rng.randint(2, 9)),
        "num1b": str(rng.randint(0, 6)),
        "num2": str(rng.randint(10, 60)),
        "num3": str(rng.randint(100, 450)),
        "price": f"${rng.randint(5, 999)}",
        "topic": topic,
        "Topic": topic.capitalize(),
    }
    out = _A_AN.sub(r"\1n \2", template.format(**values))
    return out[0].upper() + out[1:]


def _document(rng: random.Random) -> dict[str, str]:
    topic = rng.choice(sorted(TOPICS))
    t = TOPICS[topic]
    title = _fill(rng.choice(OPENERS), rng, topic, t)
    paragraphs = []
    for _ in range(rng.randint(1, 5)):
        sents = []
        for _ in range(rng.randint(2, 6)):
            pool = t["sents"] if rng.random() < 0.7 else SHARED_SENTS
            sents.append(_fill(rng.choice(pool), rng, topic, t))
        paragraphs.append(" ".join(sents))
    if rng.random() < 0.3:  # a short list, as web pages often have
        items = rng.sample(t["nouns"], 3)
        paragraphs.append("\n".join(f"- {rng.choice(t['adjs'])} {item}" for item in items))
    if rng.random() < 0.6:
        paragraphs.append(_fill(rng.choice(CLOSERS), rng, topic, t))
    text = title + "\n" + "\n".join(paragraphs)
    ts = (
        f"2019-{rng.randint(1, 4):02d}-{rng.randint(1, 28):02d}T"
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    )
    site = f"www.{rng.choice(t['site'])}{rng.choice(SITE_SUFFIX)}.{rng.choice(TLDS)}"
    slug = "-".join(title.lower().replace(":", "").replace("$", "").split()[:6])
    return {"text": text, "timestamp": ts, "url": f"https://{site}/{rng.randint(1, 999)}/{slug}"}


def generate_corpus(n_docs: int, seed: int) -> list[dict[str, str]]:
    """``n_docs`` synthetic C4-style documents (``text``, ``timestamp``, ``url``) from ``seed``."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(n_docs)]


def write_jsonl(docs: list[dict[str, str]], path: Path) -> None:
    """Write documents as JSON lines (C4's format), UTF-8, ``\\n`` line endings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
