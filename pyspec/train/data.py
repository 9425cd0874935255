"""Self-distillation data: the target generates from diverse seed prompts through pyspec's own batched
engine, and the target's final hidden states of every position are recorded on the way (a
recording drafter that proposes nothing sees the prefill chunks and the committed tokens).

The seed prompts are written here from templates x topics (instructions, explanations, lists,
stories, code, math, rewriting, dialogue), or, for the ``self`` set, written by the target itself:
given only the opening of a user turn in its chat template, an instruction-tuned model writes a
request of the kind it was tuned on (the "Magpie" method). They never come from MT-bench or
HumanEval, which are for measurement only.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from pyspec.drafters.base import Draft, Drafter
from pyspec.models.loader import load_weights_only
from pyspec.train.prompts import user_turn_prefix  # noqa: F401 (the 'self' prompt set's)

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


# The "diverse" set adds what the basic templates miss and assistants are asked every day:
# personas and role-play, reasoning puzzles, science and humanities questions, opinion essays,
# editing, and extraction / summarization over a passage in the prompt (passages assembled here
# from random facts), each in several phrasings and answer formats.
ROLES = [
    "a ship captain in the 1800s", "a grumpy medieval blacksmith", "a friendly museum guide",
    "a detective in a noir film", "a kindergarten teacher", "a Mars colony engineer",
    "a famous chef", "a sports commentator", "a travel agent", "a wise old librarian",
    "a startup founder pitching to investors", "a park ranger", "a nervous first-time pilot",
    "a personal fitness coach", "a customer support agent", "a tour guide in Rome",
]
DIVERSE_TEMPLATES = [
    "Pretend you are {r}. Describe your typical morning in character.",
    "You are {r}. A visitor asks you about {t}. Answer in character.",
    "Act as {r} and give advice to someone who is struggling with {t}.",
    "Role-play as {r}: write a short speech to open a conference on {t}.",
    "Imagine you are {r} writing a diary entry about an unexpected encounter with {t}.",
    "Stay in character as {r} and explain why {t} matters to you.",
    "There are {n} apples and {m} baskets. If each basket holds the same number and {k} apples "
    "are left over, how many apples are in each basket? Think step by step.",
    "Alice is older than Bob, Bob is older than Carol, and Dan is younger than Carol. Who is the "
    "second oldest? Explain your reasoning.",
    "A farmer has {n} chickens and {m} cows. How many legs are there in total? Show your work.",
    "If today is {day}, what day of the week will it be in {n} days? Explain.",
    "A rectangle has a perimeter of {p} cm and one side of {k} cm. What is its area?",
    "What is {n} percent of {q}? Then explain how to compute percentages mentally.",
    "Solve for x: {k}x + {n} = {q}. Explain each step.",
    "A store offers {k}0% off an item that costs ${q}. What is the final price with {m}% tax?",
    "Is the following argument valid? 'All {t} experts read a lot. Sam reads a lot. Therefore "
    "Sam is a {t} expert.' Explain.",
    "Explain the scientific principle behind {s} in simple terms.",
    "What would happen if {s} suddenly stopped working? Discuss the consequences.",
    "Describe an experiment a high-school student could do to demonstrate {s}.",
    "What is the difference between {s} and {s2}?",
    "Discuss how {h} shaped modern society.",
    "Write a persuasive essay arguing that {h} is more important than {h2}.",
    "What are the ethical questions raised by {t}? Give at least three perspectives.",
    "Compare the economic effects of {h} in two different countries.",
    "Edit the following paragraph for grammar and clarity: '{bad}'",
    "Rewrite this text in a more formal tone: '{bad}'",
    "Summarize the following passage in two sentences.\n\n{passage}",
    "Extract every person, place and date mentioned in the text below and return them as "
    "JSON.\n\n{passage}",
    "Read the report below and list the numbers it mentions, with what each one measures."
    "\n\n{passage}",
    "Based on this text, answer: who did what, and when?\n\n{passage}",
    "Turn the following notes into a short news article.\n\n{passage}",
    "Write a travel blog post about a trip to {place}, highlighting culture and food.",
    "Write a product review of a {thing} you bought last month, with pros and cons.",
    "Draft a polite message declining an invitation to a {event}.",
    "Write a limerick about {t}.",
    "Write a short screenplay scene set in {place} involving {t}.",
    "Create a riddle whose answer is {thing}, then explain the answer.",
    "Give me five creative names for a {thing} company and explain each.",
    "Write a Python class that models a {thing} with at least three methods.",
    "Explain the time complexity of binary search and write it in C++.",
    "Write a bash script that {c}.",
    "Find the bug in this Python code and fix it: def add(a, b): return a - b",
    "Write a Python function that {c}, then explain how it handles edge cases.",
    "Explain the difference between a list and a tuple in Python with examples.",
    "Write a regular expression that matches {pattern} and explain each part.",
]
SCIENCE = [
    "photosynthesis", "gravity", "the greenhouse effect", "electric circuits", "natural selection",
    "plate tectonics", "the Doppler effect", "buoyancy", "DNA replication", "nuclear fusion",
    "the water cycle", "magnetism", "chemical bonding", "vaccination", "sound waves", "friction",
]
HUMANITIES = [
    "the Industrial Revolution", "the invention of writing", "the Renaissance", "globalization",
    "the printing press", "universal suffrage", "the internet", "public education",
    "the Cold War", "urbanization", "the abolition of slavery", "the scientific method",
]
PLACES = ["Kyoto", "Lisbon", "Nairobi", "Reykjavik", "Buenos Aires", "Hanoi", "Cape Town",
          "Vancouver", "Istanbul", "Marrakesh", "Prague", "Sydney"]
THINGS = ["coffee machine", "bicycle", "smartwatch", "backpack", "electric kettle", "tent",
          "library", "bank account", "parking garage", "music playlist", "garden"]
EVENTS = ["wedding", "birthday party", "team dinner", "conference", "book club meeting"]
PATTERNS = ["an email address", "a US phone number", "a date like 2024-05-17",
            "a hexadecimal color code", "a time like 14:35"]
NAMES = ["Maria Lopez", "Ken Tanaka", "Aisha Bello", "Lukas Meyer", "Priya Nair", "Tom Walsh",
         "Sofia Rossi", "Omar Haddad", "Elena Petrova", "James Okafor"]
BAD = ["me and him goes to the store yesterday and buyed three apple",
       "their going too the park tomorow if it dont rain",
       "the datas shows that less peoples is using cars then before",
       "i has finished the report but it need more work on it's conclusion"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


# The "wide" set: the same kinds of requests as "diverse", but topics, places, people, roles and
# objects are composed from far larger word pools. Written because a head trained on the diverse
# set agreed with the target 0.40 of the time on unseen prompts of its own templates and topics
# but 0.30 over topics it never saw; a head trained on this set instead did no better on either
# unseen topics or MT-bench (README, "Where the MT-bench gap comes from"). Kept for variety: the
# shipped drafter trains on both sets.
ANIMALS = [
    "wolves", "penguins", "octopuses", "elephants", "kangaroos", "owls", "salmon", "bats",
    "dolphins", "ants", "camels", "tortoises", "hummingbirds", "jellyfish", "gorillas", "foxes",
    "crows", "sharks", "frogs", "horses", "bison", "parrots", "snails", "polar bears", "lynxes",
    "beavers", "flamingos", "moths", "lobsters", "hedgehogs", "yaks", "seals", "termites",
]
FOODS = [
    "sourdough bread", "kimchi", "olive oil", "dark chocolate", "ramen", "cheese making", "tofu",
    "maple syrup", "spices", "rice farming", "pizza", "coffee roasting", "herbal tea", "dumplings",
    "lentil soup", "pickles", "honey", "avocados", "tortillas", "curry", "smoked fish", "yogurt",
    "wine making", "mangoes", "falafel", "pasta", "barbecue", "sushi", "porridge", "jam",
]
PLACES_WIDE = [
    "Iceland", "Peru", "Mongolia", "Norway", "Kenya", "Vietnam", "Portugal", "Canada", "Egypt",
    "New Zealand", "Morocco", "Finland", "Chile", "Nepal", "Scotland", "Madagascar", "Japan",
    "Mexico", "Greece", "Ghana", "Antarctica", "the Sahara", "the Alps", "the Amazon", "Siberia",
    "the Arctic", "Patagonia", "Venice", "Berlin", "Mumbai", "Seoul", "Toronto", "Lagos", "Lima",
    "Oslo", "Dublin", "Havana", "Bangkok", "Cairo", "Melbourne", "Montreal", "Edinburgh", "Quito",
    "Tbilisi", "Zanzibar", "Bhutan", "Sicily", "Tasmania", "the Andes", "the Mekong delta",
]
JOBS = [
    "nurse", "architect", "electrician", "librarian", "pilot", "farmer", "journalist", "dentist",
    "firefighter", "translator", "plumber", "astronomer", "baker", "lawyer", "accountant",
    "veterinarian", "carpenter", "teacher", "software engineer", "geologist", "chef", "tailor",
    "paramedic", "beekeeper", "surveyor", "pharmacist", "sailor", "photographer", "archivist",
    "data analyst", "glassblower", "zookeeper", "diplomat", "midwife", "mechanic", "curator",
]
OBJECTS = [
    "umbrella", "telescope", "wristwatch", "sewing machine", "drone", "typewriter", "compass",
    "refrigerator", "violin", "kayak", "microscope", "lantern", "printer", "skateboard",
    "thermostat", "vacuum cleaner", "headphones", "wheelbarrow", "e-reader", "sailboat",
    "pressure cooker", "chess clock", "hammock", "robot vacuum", "fountain pen", "solar lamp",
    "canoe", "greenhouse", "treadmill", "blender",
]
FIELDS = [
    "marine biology", "economics", "linguistics", "epidemiology", "civil engineering",
    "psychology", "astronomy", "archaeology", "genetics", "statistics", "philosophy",
    "materials science", "oceanography", "sociology", "cryptography", "neuroscience",
    "meteorology", "botany", "anthropology", "game theory", "logistics", "urban ecology",
    "nutrition science", "acoustics", "seismology", "robotics", "accounting", "ethics",
    "probability", "immunology", "graph theory", "geometry", "thermodynamics", "optics",
]
HISTORY = [
    "the fall of the Berlin Wall", "the Black Death", "the Apollo program", "the Meiji Restoration",
    "the Great Depression", "the invention of the telephone", "the Ottoman Empire",
    "the Viking age", "the Mongol Empire", "the construction of the pyramids", "the gold rush",
    "the Enlightenment", "the age of exploration", "the first vaccines", "the Inca Empire",
    "the Industrial Revolution in Britain", "the founding of the United Nations",
    "the invention of paper", "the Hanseatic League", "the space race",
]
HOBBIES = [
    "rock climbing", "pottery", "chess", "birdwatching", "surfing", "calligraphy", "woodworking",
    "stargazing", "salsa dancing", "fly fishing", "gardening", "film photography", "sailing",
    "juggling", "quilting", "trail running", "beekeeping", "model trains", "magic tricks",
    "archery", "cycling", "watercolor painting", "scuba diving", "crossword puzzles", "yoga",
]
TECH = [
    "electric scooters", "blockchain", "heat pumps", "self-driving cars", "smart homes",
    "wind turbines", "lithium batteries", "satellite internet", "facial recognition",
    "gene editing", "nuclear power", "open-source software", "cloud storage", "hydrogen fuel",
    "noise-cancelling headphones", "password managers", "spreadsheets", "GPS", "QR codes",
    "vertical farms", "desalination", "virtual reality", "online banking", "email spam filters",
]
FIRST = ["Ana", "Bruno", "Chen", "Dara", "Emeka", "Fatima", "Gustav", "Hana", "Ivan", "Jonas",
         "Keiko", "Leila", "Mateo", "Nadia", "Oskar", "Paula", "Quentin", "Rosa", "Sami", "Tariq",
         "Uma", "Viktor", "Wen", "Yusuf", "Zoe", "Ingrid", "Rahul", "Amara", "Diego", "Lena"]
LAST = ["Silva", "Novak", "Kim", "Andersen", "Mensah", "Rahman", "Fischer", "Ito", "Kowalski",
        "Moreau", "Santos", "Lindqvist", "Adeyemi", "Costa", "Nguyen", "Schmidt", "Haddad",
        "Petrov", "Byrne", "Ortiz", "Yilmaz", "Sato", "Varga", "Dubois", "Mwangi", "Jensen"]
WIDE_POOLS = ANIMALS + FOODS + PLACES_WIDE + JOBS + OBJECTS + FIELDS + HISTORY + HOBBIES + TECH
WIDE_TOPIC_FORMS = [
    "{a}", "{food}", "{hobby}", "{tech}", "{field}", "{h}", "the history of {place}",
    "how {a} survive the winter", "the economy of {place}", "careers in {field}",
    "{hobby} for beginners", "{tech} in {place}", "the daily work of a {job}",
    "{food} in {place}", "repairing a {obj}", "the science of {food}", "{a} in {place}",
    "the future of {tech}", "{field} and {tech}", "the invention of the {obj}",
    "becoming a {job}", "protecting {a}", "{hobby} in {place}", "what {field} says about {hobby}",
]


def _wide_topic(rng: random.Random) -> str:
    return rng.choice(WIDE_TOPIC_FORMS).format(
        a=rng.choice(ANIMALS), food=rng.choice(FOODS), hobby=rng.choice(HOBBIES),
        tech=rng.choice(TECH), field=rng.choice(FIELDS), h=rng.choice(HISTORY),
        place=rng.choice(PLACES_WIDE), job=rng.choice(JOBS), obj=rng.choice(OBJECTS))


def _wide_role(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(ROLES)
    return f"a {rng.choice(JOBS)} in {rng.choice(PLACES_WIDE)}"


def _passage(rng: random.Random, wide: bool = False) -> str:
    if wide:
        a, b = (f"{rng.choice(FIRST)} {rng.choice(LAST)}" for _ in range(2))
        place, topic = rng.choice(PLACES_WIDE), _wide_topic(rng)
    else:
        a, b = rng.sample(NAMES, 2)
        place, topic = rng.choice(PLACES), rng.choice(TOPICS)
    year, n, m = rng.randint(1990, 2025), rng.randint(3, 900), rng.randint(2, 60)
    month = rng.choice(["January", "March", "May", "July", "September", "November"])
    return (f"On {month} {rng.randint(1, 28)}, {year}, {a} opened a small research center on "
            f"{topic} in {place}. In its first year it employed {m} people and received {n} "
            f"visitors. {b}, who joined as director in {year + rng.randint(1, 4)}, said the goal "
            f"was to make {topic} understandable to everyone. Funding grew by "
            f"{rng.randint(5, 80)} percent the following year, and a second site opened in "
            f"{rng.choice(PLACES_WIDE if wide else PLACES)}.")


PROMPT_SETS = ("basic", "diverse", "wide", "self")


def seed_prompts(n: int, seed: int = 0, prompt_set: str = "diverse") -> List[str]:
    """``n`` distinct prompts (deterministic for a seed). ``prompt_set``: ``"basic"`` (the 32
    original templates), ``"diverse"`` (those plus the category-wide ones above, each drawn with
    equal chance between the two lists) or ``"wide"`` (the diverse templates over topics, places,
    people, roles and objects composed from the larger word pools). The ``self`` set needs the
    target: :func:`self_prompts`."""
    if prompt_set == "self":
        raise ValueError("the 'self' prompt set is written by the target: use self_prompts(llm, n)")
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {', '.join(PROMPT_SETS)}; got {prompt_set!r}")
    rng = random.Random(seed)
    wide = prompt_set == "wide"
    out, seen = [], set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        if prompt_set == "basic" or rng.random() < 0.5:
            tpl = rng.choice(TEMPLATES)
            if wide:
                t, u = _wide_topic(rng), _wide_topic(rng)
            else:
                t, u = rng.sample(TOPICS, 2)
            p = tpl.format(t=t, u=u, c=rng.choice(CODE_TASKS), n=rng.randint(2, 90),
                           m=rng.randint(2, 30), k=rng.randint(1, 12))
        else:
            tpl = rng.choice(DIVERSE_TEMPLATES)
            s1, s2 = rng.sample(SCIENCE, 2)
            h1, h2 = rng.sample(HUMANITIES + HISTORY if wide else HUMANITIES, 2)
            # Keyword order is draw order: the diverse set's prompts must stay as they were.
            p = tpl.format(
                r=_wide_role(rng) if wide else rng.choice(ROLES),
                t=_wide_topic(rng) if wide else rng.choice(TOPICS), n=rng.randint(2, 90),
                m=rng.randint(2, 30), k=rng.randint(1, 12), q=rng.randint(20, 500),
                p=2 * rng.randint(14, 60), day=rng.choice(DAYS), s=s1, s2=s2, h=h1, h2=h2,
                bad=rng.choice(BAD), passage=_passage(rng, wide),
                place=rng.choice(PLACES_WIDE if wide else PLACES),
                thing=rng.choice(OBJECTS if wide else THINGS), event=rng.choice(EVENTS),
                c=rng.choice(CODE_TASKS),
                pattern=rng.choice(PATTERNS))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def self_prompts(llm, n: int, seed: int = 0, *, batch: int = 64, max_tokens: int = 128,
                 temperature: float = 0.8, top_p: float = 0.95, min_words: int = 3,
                 progress: bool = True) -> List[str]:
    """``n`` distinct user requests written by the target itself (deterministic for a seed): it
    samples a user turn after :func:`user_turn_prefix`. Kept: requests that end their turn within
    ``max_tokens`` tokens, have at least ``min_words`` words, and are not duplicates; the rest
    are drawn again, up to ``10 * n`` tries in all (fewer than ``n`` then comes back, with a
    note). :func:`pyspec.train.prompts.synthesize_prompts` with its filters relaxed (no language
    filter, only duplicates up to case, spacing and punctuation dropped)."""
    from pyspec.train.prompts import synthesize_prompts

    r = synthesize_prompts(llm, n, seed=seed, batch=batch, max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p, min_words=min_words,
                           max_words=1 << 30, min_latin=0.0, near_duplicate=1.0,
                           progress=progress)
    if r["kept"] < n:
        print(f"note: the target wrote {r['kept']} distinct requests in {r['draws']} tries; "
              f"{n} were asked for")
    elif progress:
        print(f"the target wrote {r['kept']} distinct requests in {r['draws']} tries")
    return r["prompts"]


class _Recorder(Drafter):
    """Proposes nothing; keeps the target's hidden state of every computed position."""

    name = "recorder"
    needs_hidden = True
    max_draft_depth = 1

    def __init__(self):
        self.hidden: Dict[int, Dict[int, torch.Tensor]] = {}

    def _put(self, rid, start, h):
        d = self.hidden.setdefault(rid, {})
        h = h.cpu()  # (a GPU target's states stay on its device through the engine)
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
    # bf16 [len(tokens) - 1, H]: hidden of positions 0 .. len - 2; None for a corpus drafter's
    # documents (tokens only) until :func:`with_feature_layers` computes them
    hidden: Optional[torch.Tensor]
    num_prompt: Optional[int]  # None: not known (a corpus drafter's documents)


# A saved corpus (data.pt, features-*.pt): plain tensors, lists and strings only, so it loads with
# torch.load(weights_only=True), which runs no code from the file.
CORPUS_FORMAT = "pyspec.train.corpus"
CORPUS_VERSION = 2


def save_sequences(seqs: List[Sequence_], path: str) -> None:
    """Write a corpus (``data.pt``, ``features-*.pt``) that :func:`load_sequences` reads back:
    the tokens of every sequence as one int64 tensor and offsets, the prompt lengths (-1: not
    known) and the hidden states (None where there are none). Written under a temporary name and
    renamed into place, so an interrupted save never leaves a partial file."""
    lens = [len(s.tokens) for s in seqs]
    state = {
        "format": CORPUS_FORMAT,
        "version": CORPUS_VERSION,
        "tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64),
        "offsets": torch.tensor([0] + lens, dtype=torch.int64).cumsum(0),
        "num_prompt": torch.tensor([-1 if s.num_prompt is None else s.num_prompt for s in seqs],
                                   dtype=torch.int64),
        "hidden": [s.hidden for s in seqs],
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_sequences(path: str, what: str = "--data",
                   regenerate: Optional[str] = None) -> List[Sequence_]:
    """A corpus saved by ``train-draft`` (its ``data.pt``, or a ``features-*.pt``): the generated
    sequences. Read with ``torch.load(weights_only=True)``: nothing in the file runs. Any other
    file is a ValueError naming it (``what``: the option that gave it); so is a corpus of an
    older pyspec, which pickled Python objects. ``regenerate``: how to make the file again, for
    the errors (default: generate the corpus again)."""
    hint = f"; {regenerate}" if regenerate else ""
    again = regenerate or "generate the corpus again (train-draft without --data)"
    state = load_weights_only(
        path,
        lambda name: f"{what}: {path!r} holds pickled Python objects (it names {name}), which "
                     "pyspec does not load (unpickling can run any code): a corpus saved by an "
                     f"older pyspec, or not a corpus at all. To go on, {again}; or, only for a "
                     "file you made yourself, convert it once: python -c \"import "
                     f"pyspec.train.data as D; D.convert_pickled_corpus({path!r})\"",
        lambda why: f"{what}: {path!r} is not a corpus saved by train-draft (its data.pt) nor a "
                    f"corpus drafter folder: torch.load failed ({why}){hint}")
    problem = _corpus_problem(state)
    if problem:
        raise ValueError(f"{what}: {path!r} is a torch file but not a corpus saved by train-draft "
                         f"(its data.pt): {problem}{hint}")
    tokens, offsets = state["tokens"].tolist(), state["offsets"].tolist()
    return [Sequence_(tokens[lo:hi], h, None if n < 0 else n)
            for lo, hi, h, n in zip(offsets[:-1], offsets[1:], state["hidden"],
                                    state["num_prompt"].tolist())]


def _corpus_problem(state) -> str:
    """What keeps a loaded object from being a saved corpus ('' when nothing does)."""
    if not isinstance(state, dict) or state.get("format") != CORPUS_FORMAT:
        return f"it holds a {type(state).__name__}"
    if state.get("version") != CORPUS_VERSION:
        return f"corpus version {state.get('version')!r}; this pyspec reads {CORPUS_VERSION}"
    tokens, offsets = state.get("tokens"), state.get("offsets")
    num_prompt, hidden = state.get("num_prompt"), state.get("hidden")
    for name, t in (("tokens", tokens), ("offsets", offsets), ("num_prompt", num_prompt)):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1):
            return f"its {name!r} is not a 1-D int64 tensor"
    n = len(num_prompt)
    if not isinstance(hidden, list) or len(hidden) != n or len(offsets) != n + 1:
        return "its counts of prompt lengths, offsets and hidden states disagree"
    lens = offsets.diff()
    if offsets[0] != 0 or offsets[-1] != len(tokens) or bool((lens < 0).any()):
        return "its offsets do not split its tokens"
    if bool(((num_prompt < -1) | (num_prompt > lens)).any()):
        return "a prompt length is past its sequence"
    for h, k in zip(hidden, lens.tolist()):
        if h is not None and not (isinstance(h, torch.Tensor) and h.is_floating_point()
                                  and h.dim() == 2 and h.shape[0] == k - 1):
            return "a hidden state is not a [len - 1, H] float tensor"
    return ""


def convert_pickled_corpus(path: str, out: Optional[str] = None) -> str:
    """Rewrite a corpus an older pyspec pickled (a list of ``Sequence_`` objects) in the current
    format, at ``out`` (default: in place). This unpickles the file, which runs whatever code it
    holds: only for a file you made yourself."""
    seqs = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(seqs, list) or not all(isinstance(s, Sequence_) for s in seqs):
        raise ValueError(f"{path!r} is not a pickled train-draft corpus (a list of sequences); "
                         f"it holds a {type(seqs).__name__}")
    save_sequences(seqs, out or path)
    return out or path


def corpus_sequences(path: str, vocab_size: int) -> List[Sequence_]:
    """A corpus drafter folder's documents (``train-draft --method suffix``) as sequences without
    features: the target's answers, ready for one teacher-forced pass instead of generating them
    again."""
    from pyspec.drafters.suffix import read_corpus

    tokens, offsets = read_corpus(path, vocab_size)
    return [Sequence_(tokens[lo:hi].tolist(), None, None)
            for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()) if hi - lo >= 2]


def generate_corpus(llm, prompts: List[str], *, max_tokens: int = 256, batch: int = 64,
                    temperature_mix=(0.0, 0.7), seed: int = 0, progress: bool = True,
                    first: int = 0, hidden: bool = True) -> List[Sequence_]:
    """Run the target over ``prompts`` (chat template) and return tokens + hidden states.
    ``first``: the index of ``prompts[0]`` in a longer list generated in shards (each prompt's
    temperature and seed follow its index, so shards give what one run over the list gives).
    ``hidden=False``: tokens only (a corpus, or data whose features a training run computes in
    one teacher-forced pass): nothing is recorded, which keeps memory and files small at scale
    (the final hidden states take 2 bytes x hidden size per token)."""
    from tqdm import tqdm

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    rec = _Recorder() if hidden else None
    need = max(len(llm.chat_prompt([{"role": "user", "content": p}])) for p in prompts[:64])
    blocks = batch * ((need + max_tokens + 64) // 16 + 2)
    runner = ModelRunner(llm.model, num_blocks=blocks, block_size=16)
    eng = Engine(runner, drafter=rec or "none", max_num_seqs=batch, max_num_batched_tokens=4096,
                 enable_prefix_cache=False, adaptive=False, gamma=1)
    eos = [int(e) for e in llm.tokenizer.eos_token_ids]
    out: List[Sequence_] = []
    bar = tqdm(total=len(prompts), desc="generating", disable=not progress, unit="prompt")
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in chunk]
        params = [SamplingParams(max_tokens=max_tokens,
                                 temperature=temperature_mix[(first + lo + i)
                                                             % len(temperature_mix)],
                                 seed=seed * 1_000_003 + first + lo + i, stop_token_ids=eos)
                  for i in range(len(chunk))]
        rids = [eng.add_request(p, sp) for p, sp in zip(ids, params)]
        while eng.has_unfinished():
            eng.step()
        for rid, p in zip(rids, ids):
            res = eng.result(rid, pop=True)
            toks = p + res.token_ids
            if rec is None:
                out.append(Sequence_(toks, None, len(p)))
                continue
            h = rec.hidden.pop(rid, {})
            n = len(toks) - 1
            if any(k not in h for k in range(n)):
                continue  # incomplete record (should not happen); skip the sample
            out.append(Sequence_(toks, torch.stack([h[k] for k in range(n)]), len(p)))
        bar.update(len(chunk))
    bar.close()
    return out


def generate_sharded(llm, prompts: List[str], out_dir: str, tag: str, *, shard: int,
                     progress: bool = True, **kw) -> List[Sequence_]:
    """:func:`generate_corpus` over ``prompts`` in shards of ``shard`` prompts, each saved as
    ``out_dir/shards/{tag}-NNNNN.pt`` when done: a rerun loads the finished shards and generates
    only the rest (the same sequences as one run: seeds follow the prompt index). The shards are
    removed by the caller once the whole corpus is saved."""
    import hashlib
    import json
    import shutil

    if shard < 1:
        raise ValueError(f"the shard size must be >= 1 prompts; got {shard}")
    folder = os.path.join(out_dir, "shards")
    # What the shards were made from: shards of other prompts or options are not reused.
    key = hashlib.sha256(json.dumps([prompts, shard, sorted(kw.items())], default=str)
                         .encode("utf-8")).hexdigest()
    manifest = os.path.join(folder, f"{tag}.json")
    if os.path.isfile(manifest):
        with open(manifest) as f:
            same = json.load(f).get("key") == key
        if not same:
            print(f"the shards in {folder} were made from other prompts or options: "
                  "generating again")
            shutil.rmtree(folder)
    os.makedirs(folder, exist_ok=True)
    with open(manifest, "w") as f:
        json.dump({"key": key, "prompts": len(prompts), "shard": shard}, f)
    out: List[Sequence_] = []
    for k, lo in enumerate(range(0, len(prompts), shard)):
        path = os.path.join(folder, f"{tag}-{k:05d}.pt")
        if os.path.isfile(path):
            part = load_sequences(path, "--out (a finished shard)",
                                  f"delete {path} to generate that shard again")
            if progress:
                print(f"loaded shard {k} ({len(part)} sequences) from {path}")
        else:
            part = generate_corpus(llm, prompts[lo:lo + shard], first=lo, progress=progress,
                                   **kw)
            save_sequences(part, path)
        out.extend(part)
    return out


def token_subset(seqs: List[Sequence_], tokens: int, seed: int = 0) -> List[Sequence_]:
    """Whole sequences drawn in a seeded random order until they hold at least ``tokens`` tokens
    (all of them if the corpus is smaller), kept in corpus order. The order depends on the seed
    and the corpus alone, so with one seed a smaller subset is part of every larger one: points
    of a data-scaling curve differ only in how much data they add."""
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    picked, total = [], 0
    for k in order:
        if total >= tokens:
            break
        picked.append(k)
        total += len(seqs[k].tokens)
    return [seqs[k] for k in sorted(picked)]


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


@torch.inference_mode()
def with_feature_layers(llm, seqs: List[Sequence_], layers, *, progress: bool = True
                        ) -> List[Sequence_]:
    """The corpus with the target's outputs of ``layers`` (the last the final layer) at every
    position instead of its recorded final hidden states: one teacher-forced forward per sequence
    over the recorded tokens (a prefill is much cheaper than generating them again)."""
    from tqdm import tqdm

    from pyspec.models.llama import feature_layers
    from pyspec.runner import ModelRunner, SeqStep

    m = llm.model
    layers = feature_layers(layers, m.cfg.num_hidden_layers)
    # Several sequences per forward (up to ``budget`` pages), each in its own pages.
    pages = [(len(s.tokens) - 1 + 15) // 16 for s in seqs]
    budget = max(256, max(pages))
    runner = ModelRunner(m, num_blocks=budget, block_size=16)
    out: List[Optional[Sequence_]] = [None] * len(seqs)
    bar = tqdm(total=len(seqs), desc="features", disable=not progress, unit="seq")
    i = 0
    while i < len(seqs):
        batch, steps, used = [], [], 0
        while i < len(seqs) and used + pages[i] <= budget:
            table = list(range(used, used + pages[i]))
            steps.append(SeqStep(seqs[i].tokens[:-1], 0, table, None, "none"))
            batch.append(i)
            used += pages[i]
            i += 1
        res = runner.step(steps, return_hidden=layers)
        for j, k in enumerate(batch):
            s = seqs[k]
            lo, hi = res.row_indptr[j], res.row_indptr[j + 1]
            out[k] = Sequence_(s.tokens, res.hidden[lo:hi].to(torch.bfloat16), s.num_prompt)
        bar.update(len(batch))
    bar.close()
    return out
