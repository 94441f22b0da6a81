"""The prompt set of the ring and speculative benchmarks, written for this project.

Six categories, three prompts each, as chat messages for the instruct model: open writing,
QA, math, code, summarisation of a passage, retrieval-style quoting. The last two carry
their source text in the prompt, which is where prompt-lookup drafting should shine;
the first four are open-ended. `plain_answers` reads back, tokenised, the prompts and
the plain-decoding answers a bench_spec result holds for them. It does not know how
prompts are timed.
"""

from __future__ import annotations

OPEN_ENDED = ("open_writing", "qa", "math", "code")
GROUNDED = ("summarisation", "quoting")
CATEGORIES = OPEN_ENDED + GROUNDED

PASSAGE_LIGHTHOUSE = (
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. "
    "For ninety years a keeper and his family lived in the cottage at its foot, trimming the wick "
    "every four hours and winding the clockwork that turned the lens. In 1962 the light was "
    "automated, and the last keeper, Margaret Hale, moved to the mainland, where she wrote a short "
    "memoir about storms, shipwrecks and the loneliness of winter. The lens itself, a first-order "
    "Fresnel lens made in Paris, was removed in 1985 and now stands in the harbour museum. Today "
    "the tower is run by a volunteer society that opens it to visitors on summer weekends and "
    "raises money to repair the salt-damaged ironwork of the gallery."
)

PASSAGE_BEES = (
    "Honey bees communicate the location of food through a movement known as the waggle dance. "
    "A forager returning to the hive runs in a straight line while shaking her body, then loops "
    "back to repeat the run. The angle of the straight run relative to vertical tells the other "
    "bees the direction of the food relative to the sun, and the duration of the waggle tells "
    "them the distance: roughly one second of waggling for every kilometre. Karl von Frisch "
    "decoded the dance in the 1940s and shared the 1973 Nobel Prize in Physiology or Medicine "
    "for this work. Later experiments with robotic bees confirmed that the dance alone, without "
    "scent cues, is enough to send recruits to the right place."
)

PROMPTS: dict[str, tuple[str, ...]] = {
    "open_writing": (
        "Write a short story of about 150 words about a robot who learns to paint.",
        "Write a friendly email to a neighbour inviting them to a garden party next Saturday.",
        "Write a short description of a busy market on a rainy morning.",
    ),
    "qa": (
        "Why do leaves change colour in autumn? Explain in a paragraph.",
        "What are the main differences between a virus and a bacterium?",
        "How does a refrigerator keep food cold?",
    ),
    "math": (
        "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed "
        "over the whole journey? Show your working step by step.",
        "A recipe needs 3 eggs for every 2 cups of flour. How many eggs are needed for 8 cups of "
        "flour? Explain your reasoning.",
        "A bookshop sold 48 books on Monday and twice as many on Tuesday. How many books did it sell "
        "on the two days together? Show your working.",
    ),
    "code": (
        "Write a Python function that checks whether a string is a palindrome, ignoring spaces and "
        "case, and explain how it works.",
        "Write a Python function that returns the n-th Fibonacci number using a loop, with a docstring.",
        "Write a Python function that counts how often each word appears in a text and returns a dictionary.",
    ),
    "summarisation": (
        f"Summarise the following passage in three sentences.\n\n{PASSAGE_LIGHTHOUSE}",
        f"Summarise the following passage for a ten-year-old.\n\n{PASSAGE_BEES}",
        f"{PASSAGE_LIGHTHOUSE}\n\nIn two sentences, what is this passage about?",
    ),
    "quoting": (
        f"{PASSAGE_LIGHTHOUSE}\n\nQuote, word for word, the sentences of this passage that describe "
        "what happened to the lens and who runs the tower today.",
        f"{PASSAGE_BEES}\n\nCopy exactly the sentences of this passage that explain how the dance "
        "encodes direction and distance.",
        f"Repeat the first three sentences of this passage exactly.\n\n{PASSAGE_BEES}",
    ),
}


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def prompt_set(per_category: int) -> list[tuple[str, str]]:
    """(category, prompt) pairs, the first `per_category` of each category, in category order."""
    return [(cat, p) for cat in CATEGORIES for p in PROMPTS[cat][:per_category]]


def long_text() -> str:
    """Filler for long-prompt timing (TTFT): the passages, repeated by the caller to length."""
    return PASSAGE_LIGHTHOUSE + " " + PASSAGE_BEES


def plain_answers(bench: dict) -> list[tuple[str, list[int], list[int]]]:
    """(category, chat-encoded prompt ids, plain-decoding answer ids) for each prompt of a
    bench_spec result (`bench`, its JSON), in its order, tokenised as its model's store does."""
    from transformers import AutoTokenizer

    from coordinator.jobs.engine import encode_chat
    from shard.store import open_or_prepare

    store = open_or_prepare(bench["conditions"]["model"], progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    per_category = len(bench["conditions"]["prompt_tokens"][CATEGORIES[0]])
    runs = bench["raw"]["bf16"]["none"]["runs"]
    out = []
    for (category, prompt), run in zip(prompt_set(per_category), runs, strict=True):
        if run["category"] != category:
            raise ValueError(f"bench_spec result out of order: run {run['category']!r} where {category!r} was expected")
        out.append((category, encode_chat(tokenizer, messages(prompt)), run["tokens"]))
    return out
