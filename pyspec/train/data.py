"""Self-distillation data: the target generates from diverse seed prompts through pyspec's own batched
engine, and the target's final hidden states of every position are recorded on the way (a
recording drafter that proposes nothing sees the prefill chunks and the committed tokens).

The seed prompts are written here from templates x topics (instructions, explanations, lists,
stories, code, math, rewriting, dialogue); they never come from MT-bench or HumanEval, which are
for measurement only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from pyspec.drafters.base import Draft, Drafter

TEMPLATES = [
    "Explain {t} to a curious teenager in a few paragraphs.",
    "Write a short story in which {t} plays a central role.",
    "Give me a numbered list of practical tips about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a formal email to a colleague proposing a project about {t}.",
    "Summarize the history of {t} in one paragraph.",
    "Write a poem about {t}.",
    "Describe a typical day of someone whose job involves {t}.",
    "Compare {t} with {u}. Which matters more and why?",
    "I am giving a five-minute talk on {t}. Draft an outline with key points.",
    "Write a dialogue between two friends arguing about {t}.",
    "List five common misconceptions about {t} and correct each one.",
    "How would you teach {t} to a class of ten-year-olds? Describe a lesson plan.",
    "Write a product description for an app that helps people with {t}.",
    "What questions should a beginner ask before getting into {t}?",
    "Write a blog post introduction about {t}, in a friendly tone.",
    "Give step-by-step instructions for a weekend project related to {t}.",
    "Write a haiku sequence (three haikus) about {t}.",
    "Imagine the year 2100. How has {t} changed? Answer in a short essay.",
    "Rewrite this sentence to be more concise and formal: 'So basically {t} is kind of a big "
    "deal for a lot of people these days.'",
    "Write a Python function that {c}. Include a docstring and an example.",
    "Explain what this task needs and then write JavaScript code that {c}.",
    "Write a SQL query and explain it: a table of {t} records, find the ten most recent ones.",
    "Write unit tests in Python for a function that {c}.",
    "A shop sells {n} items on Monday and {m} more each following day. How many items does it "
    "sell in a week? Show your reasoning.",
    "If a train travels {n} kilometers in {m} hours, what is its average speed? Explain.",
    "Solve step by step: {n} * {m} + {k} - {n}.",
    "A recipe needs {k} eggs for {n} people. How many eggs for {m} people? Explain.",
    "Translate into simple English and explain the meaning: 'The early bird catches the worm.'",
    "Write a cover letter paragraph for a job in {t}.",
    "What would a debate about {t} sound like? Give the strongest argument for each side.",
    "Create a study plan for learning about {t} in four weeks.",
]
TOPICS = [
    "renewable energy", "the water cycle", "medieval castles", "volcanoes", "honey bees",
    "public libraries", "electric cars", "chess openings", "the human immune system", "coffee",
    "urban gardening", "the printing press", "black holes", "jazz music", "marathon training",
    "remote work", "ancient Egypt", "recycling plastics", "photosynthesis", "the stock market",
    "social media", "sleep hygiene", "the Roman Empire", "machine learning", "bicycle repair",
    "ocean tides", "bread baking", "time management", "climate change", "dinosaurs",
    "the French Revolution", "budget travel", "meditation", "3D printing", "rainforests",
    "the history of the internet", "board games", "public speaking", "vaccines", "mountain hiking",
    "classical architecture", "the moon landing", "personal finance", "birdwatching", "robotics",
    "language learning", "earthquakes", "opera", "composting", "cybersecurity", "tea ceremonies",
    "space telescopes", "fermentation", "city planning", "wildfires", "origami", "the Silk Road",
    "nutrition labels", "solar panels", "video game design", "coral reefs", "train travel",
    "minimalism", "the periodic table", "podcasting", "whales", "desert ecosystems",
    "smartphone addiction", "volunteering", "quantum computing", "knitting", "antibiotics",
    "democracy", "street food", "glaciers", "typography", "mushroom foraging", "the Olympics",
]
CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts the vowels in a text", "merges two sorted lists", "finds duplicates in a list",
    "computes the nth Fibonacci number iteratively", "converts Celsius to Fahrenheit",
    "removes punctuation from a string", "flattens a nested list", "groups words by first letter",
    "returns the median of a list of numbers", "validates an email address with a simple rule",
    "computes the factorial of a number", "finds the longest word in a sentence",
    "rotates a list by k positions", "parses a CSV line into fields", "computes a running average",
    "checks whether two strings are anagrams", "returns the prime numbers below n",
    "capitalizes every word in a title",
]


def seed_prompts(n: int, seed: int = 0) -> List[str]:
    """``n`` distinct prompts from the templates (deterministic for a seed)."""
    rng = random.Random(seed)
    out, seen = [], set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        tpl = rng.choice(TEMPLATES)
        t, u = rng.sample(TOPICS, 2)
        p = tpl.format(t=t, u=u, c=rng.choice(CODE_TASKS), n=rng.randint(2, 90),
                       m=rng.randint(2, 30), k=rng.randint(1, 12))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


class _Recorder(Drafter):
    """Proposes nothing; keeps the target's hidden state of every computed position."""

    name = "recorder"
    needs_hidden = True
    max_draft_depth = 1

    def __init__(self):
        self.hidden: Dict[int, Dict[int, torch.Tensor]] = {}

    def _put(self, rid, start, h):
        d = self.hidden.setdefault(rid, {})
        for k in range(h.shape[0]):
            d[start + k] = h[k].to(torch.bfloat16).clone()

    def prefill(self, chunks):
        for c in chunks:
            self._put(c.request_id, c.start, c.hidden)

    def observe(self, results):
        for v in results:
            self._put(v.request_id, v.start, v.hidden)

    def propose(self, reqs):
        return [Draft([int(r.context[-1])], [-1]) for r in reqs]

    def release(self, rid):
        pass  # kept until collected (a preempted request re-records the same positions)


@dataclass
class Sequence_:
    tokens: List[int]  # prompt + generated
    hidden: torch.Tensor  # bf16 [len(tokens) - 1, H]: hidden of positions 0 .. len - 2
    num_prompt: int


def generate_corpus(llm, prompts: List[str], *, max_tokens: int = 256, batch: int = 64,
                    temperature_mix=(0.0, 0.7), seed: int = 0, progress: bool = True
                    ) -> List[Sequence_]:
    """Run the target over ``prompts`` (chat template) and return tokens + hidden states."""
    from tqdm import tqdm

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    rec = _Recorder()
    need = max(len(llm.chat_prompt([{"role": "user", "content": p}])) for p in prompts[:64])
    blocks = batch * ((need + max_tokens + 64) // 16 + 2)
    runner = ModelRunner(llm.model, num_blocks=blocks, block_size=16)
    eng = Engine(runner, drafter=rec, max_num_seqs=batch, max_num_batched_tokens=4096,
                 enable_prefix_cache=False, adaptive=False, gamma=1)
    eos = [int(e) for e in llm.tokenizer.eos_token_ids]
    out: List[Sequence_] = []
    bar = tqdm(total=len(prompts), desc="generating", disable=not progress, unit="prompt")
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in chunk]
        params = [SamplingParams(max_tokens=max_tokens,
                                 temperature=temperature_mix[(lo + i) % len(temperature_mix)],
                                 seed=seed * 1_000_003 + lo + i, stop_token_ids=eos)
                  for i in range(len(chunk))]
        rids = [eng.add_request(p, sp) for p, sp in zip(ids, params)]
        while eng.has_unfinished():
            eng.step()
        for rid, p in zip(rids, ids):
            res = eng.result(rid, pop=True)
            toks = p + res.token_ids
            h = rec.hidden.pop(rid, {})
            n = len(toks) - 1
            if any(k not in h for k in range(n)):
                continue  # incomplete record (should not happen); skip the sample
            out.append(Sequence_(toks, torch.stack([h[k] for k in range(n)]), len(p)))
        bar.update(len(chunk))
    bar.close()
    return out


def token_counts(seqs: List[Sequence_], vocab: int) -> torch.Tensor:
    c = torch.zeros(vocab, dtype=torch.int64)
    for s in seqs:
        c += torch.bincount(torch.tensor(s.tokens), minlength=vocab)
    return c


def draft_vocabulary(seqs: List[Sequence_], vocab: int, size: int,
                     always: Optional[List[int]] = None) -> torch.Tensor:
    """The ``size`` most frequent target tokens (plus ``always``), sorted ids."""
    counts = token_counts(seqs, vocab).double()
    if always:
        counts[torch.tensor(always)] = float("inf")
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values
