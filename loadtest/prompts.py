"""What the simulated users ask for: prompts, output lengths and decoders."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Varied on purpose: short questions, code, long contexts, lists, arithmetic, translation.
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits that are red.",
    "Translate to French: 'The weather is nice today and I would like to go for a walk.'",
    "What is 17 multiplied by 23? Show your steps.",
    "Write a haiku about a cat sleeping in the sun.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give three tips for writing readable code.",
    "What does HTTP stand for, and what is it used for?",
    "Continue the story: The lighthouse keeper found a letter washed up on the shore. It said",
    "Write a SQL query that counts orders per customer from a table orders(id, customer_id).",
    "Explain the difference between a list and a tuple in Python.",
    "Describe how a bicycle works to a five-year-old.",
    "def quicksort(xs):\n    # sort the list xs and return a new list\n",
    "Name the planets of the solar system in order from the sun.",
    (
        "Read the following text and answer the question.\n"
        "Text: The Amazon rainforest covers much of the Amazon basin of South America. "
        "This basin encompasses seven million square kilometres, of which five and a half "
        "million square kilometres are covered by the rainforest. The region includes territory "
        "belonging to nine nations. The majority of the forest is contained within Brazil, with "
        "60% of the rainforest, followed by Peru with 13%, and Colombia with 10%.\n"
        "Question: Which country contains most of the Amazon rainforest?"
    ),
    (
        "Here is a log excerpt:\n"
        "2024-05-01 12:00:01 INFO server started on port 8000\n"
        "2024-05-01 12:00:05 WARN slow request /v1/completions took 2.3s\n"
        "2024-05-01 12:00:09 ERROR upstream timeout while loading model weights\n"
        "2024-05-01 12:00:10 INFO retrying model load\n"
        "What went wrong, and what would you check first?"
    ),
    "Write a short email asking a colleague to review a pull request.",
    "Why do leaves change color in autumn?",
]

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their can has more if will would "
    "about time model token cache batch queue server request stream decode draft verify accept "
    "river mountain window garden number system network memory value signal market history"
).split()


def synthetic_prompt(rng: random.Random, words: int) -> str:
    """Random words: exercises prompt lengths without any meaning for the model to latch on to."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass(frozen=True)
class IntDistribution:
    """An integer drawn per request: `"32"` (fixed), `"16:128"` (uniform) or `"16,64,256"`."""

    choices: tuple[int, ...] = ()
    low: int = 0
    high: int = 0

    @classmethod
    def parse(cls, text: str) -> IntDistribution:
        text = str(text).strip()
        if ":" in text:
            low, high = (int(x) for x in text.split(":", 1))
            if not 0 < low <= high:
                raise ValueError(f"bad range {text!r}: need 0 < low <= high")
            return cls(low=low, high=high)
        choices = tuple(int(x) for x in text.split(",") if x.strip())
        if not choices or min(choices) <= 0:
            raise ValueError(f"bad value {text!r}: need positive integers")
        return cls(choices=choices)

    def sample(self, rng: random.Random) -> int:
        return rng.choice(self.choices) if self.choices else rng.randint(self.low, self.high)


class PromptSource:
    """Draws prompts from the built-in set, synthetic random-length text, or both (`mixed`)."""

    KINDS = ("builtin", "synthetic", "mixed")

    def __init__(self, kind: str = "mixed", synthetic_words: str = "8:256"):
        if kind not in self.KINDS:
            raise ValueError(f"prompt set must be one of {', '.join(self.KINDS)}, not {kind!r}")
        self.kind = kind
        self.words = IntDistribution.parse(synthetic_words)

    def sample(self, rng: random.Random) -> str:
        kind = self.kind if self.kind != "mixed" else rng.choice(("builtin", "synthetic"))
        if kind == "builtin":
            return rng.choice(BUILTIN_PROMPTS)
        return synthetic_prompt(rng, self.words.sample(rng))


def parse_decoder_mix(text: str) -> list[str]:
    """`"ar:3,speculative:1"` → a wheel of names; user n takes `wheel[n % len(wheel)]`.

    A deterministic wheel (not a random pick) keeps the mix exact even with a handful of users.
    """
    wheel: list[str] = []
    for item in text.split(","):
        name, _, weight = item.strip().partition(":")
        if not name:
            continue
        count = int(weight) if weight else 1
        if count < 0:
            raise ValueError(f"negative weight in decoder mix {text!r}")
        wheel.extend([name] * count)
    if not wheel:
        raise ValueError(f"empty decoder mix {text!r}")
    return wheel
