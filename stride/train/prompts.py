"""Prompts to self-distil from: an operator's own traffic (JSONL) or a built-in generator.

A draft head learns what its target says, so its training prompts should look like what the
target will be asked. The best source is real traffic: a JSONL file of `{"messages": [...]}`
(chat) or `{"prompt": "..."}` lines. Without one, `builtin_prompts` composes requests of many
kinds (questions, explanations, code, lists, rewriting, stories, arithmetic, advice, ...) over
several hundred subjects, so that the head sees the target's register across tasks rather than
one template's answers; `stride.train.data` can add prompts the target writes itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

Prompt = list[dict[str, str]] | str  # chat messages, or a plain completion prompt

SUBJECTS = [
    s.strip()
    for s in """
photosynthesis, volcanoes, black holes, the water cycle, plate tectonics, tides, rainbows,
earthquakes, the immune system, vaccines, DNA, the human heart, sleep, memory, muscles,
digestion, bones, the brain, honeybees, octopuses, wolves, elephants, coral reefs, rainforests,
deserts, glaciers, the ocean floor, the Roman Empire, ancient Egypt, the printing press,
the industrial revolution, the Silk Road, the Renaissance, the moon landing,
the French Revolution, the Cold War, the Great Wall of China, electricity, magnets, gravity,
friction, sound waves, light, lenses, atoms, chemical reactions, acids and bases, inflation,
interest rates, supply and demand, taxes, budgeting, saving money, credit scores, startups,
marketing, remote work, job interviews, public speaking, negotiation, leadership, teamwork,
habits, time management, meditation, running, yoga, nutrition, vitamins, drinking water,
cooking pasta, baking bread, coffee, tea, chocolate, cheese, spices, fermentation, gardening,
composting, houseplants, growing tomatoes, recycling, solar panels, wind turbines,
electric cars, batteries, climate change, air pollution, the internet, email, passwords,
encryption, cloud computing, databases, operating systems, compilers, machine learning,
neural networks, search engines, web browsers, smartphones, GPS, satellites, robots,
3D printing, blockchains, video games, chess, music theory, the piano, the guitar, jazz,
painting, photography, film editing, poetry, novels, libraries, museums, theatre,
architecture, bridges, skyscrapers, trains, airplanes, ships, bicycles, traffic jams, cities,
maps, weather forecasts, hurricanes, snow, clouds, the seasons, the solar system, Mars,
Jupiter, stars, comets, telescopes, rockets, friendship, kindness, curiosity, courage,
patience, honesty, gratitude, failure, learning languages, dogs, cats, horses, birds,
bird migration, camping, hiking, swimming, football, basketball, tennis, the Olympics,
a healthy breakfast, a small business, a city park, a school library, a mountain village,
a rainy afternoon, a long train journey, an old lighthouse, the stock market, volunteering,
first aid, fire safety, online privacy, social media, podcasts, board games, origami,
knitting, woodworking, bees and flowers, the desert at night, a busy airport, a farmers market
""".split(",")
]

LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "Java", "C", "C++", "TypeScript", "Bash", "SQL"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest element of a list", "merges two sorted lists", "removes duplicates from a "
    "list", "computes the factorial of n", "converts Celsius to Fahrenheit", "parses a CSV line",
    "checks whether two strings are anagrams", "computes the average of a list of numbers",
    "returns the n-th triangular number", "flattens a nested list", "counts vowels in a string",
    "validates an email address", "reads a file and prints its lines", "sorts a list of names",
    "computes the greatest common divisor", "implements binary search", "capitalizes each word",
    "sums the digits of a number", "generates a random password", "checks for balanced brackets",
    "finds the second smallest number", "converts a number to binary", "rotates a list by k",
]
AUDIENCES = ["a child", "a beginner", "a high-school student", "an expert", "a grandparent",
             "a busy manager", "a tourist", "a new employee"]
FORMS = ["a short poem", "a haiku", "a limerick", "a two-sentence story", "a short story",
         "a diary entry", "a product description", "a news headline and lede", "a riddle",
         "a motivational quote", "a tweet", "a short dialogue", "a fable", "a song chorus"]
NAMES = ["Alice", "Ben", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas",
         "Kemal", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stickers", "coins", "tickets"]

TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "How does {s} work?",
    "Explain {s} to {a}.", "Why is {s} important?", "Give me three facts about {s}.",
    "What are the pros and cons of {s}?", "Write {f} about {s}.", "Summarize what {s} is in "
    "one paragraph.", "List five things everyone should know about {s}.",
    "What are common misconceptions about {s}?", "Compare {s} and {t}.",
    "What is the difference between {s} and {t}?", "How are {s} and {t} related?",
    "Give me a step-by-step guide to learning about {s}.", "Write a short essay on {s}.",
    "Describe {s} in three sentences.", "What questions would a scientist ask about {s}?",
    "Write a quiz with three questions about {s}.", "What is the history of {s}?",
    "Give an analogy that explains {s}.", "Write a blog post introduction about {s}.",
    "What would happen if {s} disappeared?", "Give me tips about {s}.",
    "Write {f} that mentions {s} and {t}.", "Tell me a fun fact about {s}.",
    "How would you teach {s} to {a}?", "Create a short lesson plan about {s}.",
    "Write an email to a friend about {s}.", "Define {s} and give an example.",
]
CODE_TEMPLATES = [
    "Write a {l} function that {c}.", "How do I write a program in {l} that {c}?",
    "Show me {l} code that {c}, with comments.", "Write a function that {c} and explain it.",
    "Write a {l} function that {c}, and a test for it.", "Implement in {l}: a function that {c}.",
]
REWRITE_TEMPLATES = [
    "Rewrite this sentence to sound more formal: '{x}'", "Fix the grammar: '{x}'",
    "Translate to Spanish: '{x}'", "Translate to German: '{x}'", "Paraphrase: '{x}'",
    "Make this sentence shorter: '{x}'", "Is this sentence positive or negative? '{x}'",
    "Turn this into a question: '{x}'", "Continue this text: '{x}'",
]
SENTENCES = [
    "i think we should of left earlier because the traffic was bad",
    "The meeting was moved to Thursday afternoon because the manager is travelling.",
    "our team finished the project two weeks ahead of schedule",
    "The new cafe on the corner serves the best croissants in town.",
    "He didn't like the movie, the ending was to long and confusing.",
    "Please remember to water the plants while I am away on holiday.",
    "The results of the experiment surprised everyone in the lab.",
    "I can't believe how quickly the summer went by this year.",
    "The library will be closed on Monday for maintenance work.",
    "She has been learning to play the violin for three years.",
]
MATH_TEMPLATES = [
    "{n} has {x} {i} and buys {y} more. How many {i} does {n} have now?",
    "{n} had {x} {i} and gave {y} away. How many are left?",
    "What is {x} times {y}?", "What is {x} plus {y} minus {z}?",
    "If a box holds {y} {i}, how many boxes are needed for {x} {i}?",
    "{n} reads {y} pages a day. How many pages in {z} days?",
    "What is {x} percent of {big}?", "Is {big} divisible by {y}? Explain.",
]


def builtin_prompts(count: int, seed: int = 0) -> list[Prompt]:
    """`count` chat prompts of many kinds, reproducible from `seed`."""
    rng = random.Random(seed)

    def one() -> str:
        kind = rng.random()
        if kind < 0.62:
            s, t = rng.sample(SUBJECTS, 2)
            return rng.choice(TEMPLATES).format(
                s=s, t=t, a=rng.choice(AUDIENCES), f=rng.choice(FORMS)
            )
        if kind < 0.80:
            language, task = rng.choice(LANGUAGES), rng.choice(CODE_TASKS)
            return rng.choice(CODE_TEMPLATES).format(l=language, c=task)
        if kind < 0.90:
            return rng.choice(REWRITE_TEMPLATES).format(x=rng.choice(SENTENCES))
        x, y, z = rng.randint(2, 60), rng.randint(2, 12), rng.randint(2, 9)
        return rng.choice(MATH_TEMPLATES).format(
            n=rng.choice(NAMES), i=rng.choice(ITEMS), x=x, y=y, z=z, big=rng.randint(100, 999)
        )

    seen: dict[str, None] = {}  # distinct prompts, in the order drawn
    for _ in range(20 * count):
        if len(seen) == count:
            break
        seen.setdefault(one())
    return [[{"role": "user", "content": text}] for text in seen]


def read_prompts(path: Path) -> list[Prompt]:
    """JSONL: `{"messages": [...]}` (the last turn is answered; an assistant turn at the end is
    dropped, so logged conversations can be used as they are) or `{"prompt": "..."}`."""
    out: list[Prompt] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item: dict[str, Any] = json.loads(line)
        if "messages" in item:
            messages = [m for m in item["messages"] if isinstance(m.get("content"), str)]
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            if messages:
                out.append(messages)
        elif isinstance(item.get("prompt"), str):
            out.append(item["prompt"])
        else:
            raise ValueError(f"{path}:{n}: need 'messages' or 'prompt'")
    return out
