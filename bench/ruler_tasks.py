"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the real context
size of your long-context language models?"), written here from the paper's task definitions.

Each sample is a context (the long text), a question and the list of reference strings; a
sample's score is the fraction of its references found in the answer (case-insensitive
substring), RULER's ``string_match_all``. Tasks (RULER's names; our haystacks):

* ``niah_single_1``: one needle ("One of the special magic numbers for <key> is: <value>.") in
  the noise haystack ("The grass is green. The sky is blue. ..." repeated); 7-digit value.
* ``niah_single_2`` / ``niah_single_3`` / ``niah_single_word``: one needle in Jane Austen text
  (``load_novels()``), the value a 7-digit number / a UUID / a word.
* ``niah_multikey_1``: 4 needles with different keys in Austen text, one key asked.
* ``niah_multikey_2``: the haystack is made of needles (every sentence is a key/value needle,
  7-digit values); one key asked. ``niah_multikey_3``: the same with UUID keys and values.
* ``niah_multivalue``: 4 needles with the same key and 4 values; all 4 values are references.
* ``niah_multiquery``: 4 needles with 4 keys, all 4 asked at once; 4 references.
* ``vt`` (variable tracking): one chain of 4 hops ("VAR AAAAA = 12345", "VAR BBBBB = VAR AAAAA",
  ...) spread in order through the noise haystack; the question gives the value, the
  references are the chain's 5 variable names.
* ``cwe`` (common-words extraction): a numbered list of words where 10 words appear ``freq_cw``
  times (30 at >= 4096 tokens, fewer for shorter targets) and the others 3 times; the 10
  frequent ones are the references.
* ``fwe`` (frequent-words extraction): "coded" random 5-letter words with Zipf (alpha 2)
  frequencies (counts are the Zipf expectation, rounded, so the order is never a tie); the
  3 most frequent are the references.

Length: each task has one size knob (haystack sentences or words, needles, list items); the
largest size whose chat-formatted prompt (context + question, ``prompt_ids``) fits ``tokens``
is found by bisection with the tokenizer, so prompts are at most ``tokens`` and close to it.

Determinism: a sample depends only on ``(seed, task, index)``, the tokenizer and the novels
(a ``random.Random`` seeded with that string, re-created for every size tried).

The prompt is split in two token sequences: the context ``pre + preamble + context`` (``pre``:
the chat template up to the user's message) and the question ``"\\n" + question + post +
answer_prefix`` (``post``: the template's end of the user turn and start of the answer), so
the question can come after a compressed context (query-agnostic) or in the same prompt
(query-aware: their concatenation, the same token ids).
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# Keys ("adjective-noun") and word values come from these lists (common English words).
ADJECTIVES = """able acid afraid ancient angry brave bright broad busy calm careful cheap
clean clever cold cool cruel curious damp dark dear deep dry eager early easy empty equal
fair famous fancy fast fierce flat fresh friendly full gentle giant glad golden good grand
great green happy hard heavy hollow honest huge humble jolly keen kind large late lazy light
little lively long loud lucky mad mellow mighty modern narrow neat nervous new nice noble
old open orange patient plain polite poor proud purple quick quiet rapid rare red rich
rough round royal rural sad safe salty sharp shiny short shy silent silly silver simple slow
small smart smooth soft solid sour spicy steep sticky strange strict strong sunny sweet
swift tall tame tender thick thin tidy tiny tough true vast warm weak wet wide wild wise
witty young""".split()

NOUNS = """apple arrow autumn badge bakery balloon banana barn basket beach bell bicycle
bird blanket boat bottle bridge brush bucket butter button cabin cake camera candle canoe
canyon carpet castle cattle cave cellar chair cherry chimney circle cliff clock cloud coast
coffee comet copper cottage crayon desert diamond dolphin dragon drum eagle engine falcon
feather fence field forest fountain garden giraffe glacier glove grape harbor helmet hill
honey horse island jacket jungle kettle kitten ladder lake lantern lemon library lighthouse
lion marble meadow melon mirror monkey mountain needle ocean orchard otter palace panda
parrot pebble pencil pepper piano pillow planet pocket pond potato puzzle rabbit river
rocket saddle sailor sandal school shadow sheep shell shield ship silk spider spoon squirrel
stable star stone storm sugar summer swan table teapot temple thunder tiger tomato tower
train tulip tunnel turtle umbrella valley violin wagon walnut whale window winter wizard
wolf yacht zebra""".split()

WORDS = sorted(set(ADJECTIVES + NOUNS + """acorn actor album anchor angle ant apron atlas
axe bacon bagel ball band bank barrel bay bean bear bed bee beet belt bench berry blade
block board bone book boot bowl box bread brick broom cactus cage camel canal candy cap
card cart cat chain chalk cheese chess chest chin cider city clay cloak coat coin comb cook
cord corn couch cow crab crane crown cup daisy dance deer desk dish dock door dove dress
duck dust ear earth egg elbow elk fabric fan farm fig film fish flag flame flute fog fork
fox frog fruit game gate gem ghost gift glass goat gold goose grass gravel guitar hammer
hat hawk hay heart hen hook horn hose hut ice ink iron ivy jam jar jelly jewel juice key
kite knee knife knot lamb lamp leaf leg lily lime linen lizard lock log loom map mask mast
meal mint mole moon moss moth mouse mud mug nail nest net nut oak oar oil olive onion owl
oyster paint pan paper park path peach pear pearl pen pig pin pine pipe plate plum poem
pole pony pot pump quilt radio rail rain ring road robe rock roof root rope rose rug ruler
salt sand scarf seal seed shirt shoe silo sink sled snail snow soap sock sofa soup spade
spring stamp steam stick straw stream string sun swing tail tape tea tent thread throne tile
toad toast tooth torch towel toy tray tree truck trunk tub vase vest vine wall wand wheat
wheel whip wing wire wool yard yarn""".split()))

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_single_word", "niah_multikey_1",
         "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe")
FAMILIES = {"niah_single": ("niah_single_1", "niah_single_2", "niah_single_3", "niah_single_word"),
            "niah_multikey": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
            "niah_multivalue": ("niah_multivalue",), "niah_multiquery": ("niah_multiquery",),
            "vt": ("vt",), "cwe": ("cwe",), "fwe": ("fwe",)}
# RULER's tokens to generate per task (niah 128, vt 30, cwe 120, fwe 50).
MAX_NEW_TOKENS = {"vt": 30, "cwe": 120, "fwe": 50}


def family(task: str) -> str:
    return next(f for f, ts in FAMILIES.items() if task in ts)


@dataclass
class Sample:
    task: str
    index: int
    context: str       # the long text (the preamble included)
    question: str      # asked after the context
    answer_prefix: str  # starts the assistant's answer
    refs: list
    meta: dict = field(default_factory=dict)


def score(answer: str, refs: list) -> float:
    """RULER's string_match_all for one sample: the fraction of ``refs`` found in ``answer``
    (case-insensitive substring)."""
    a = answer.lower()
    return sum(r.lower() in a for r in refs) / len(refs)


def template_parts(tok) -> tuple[str, str]:
    """(pre, post): the chat template's text before and after a user message (with the
    generation prompt)."""
    text = tok.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                   add_generation_prompt=True)
    pre, post = text.split("@@")
    return pre, post


def _ids(tok, s: str) -> list:
    return list(tok(s, add_special_tokens=False).input_ids)


def prompt_ids(tok, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids [1, n], question ids [1, q]); their concatenation is the full prompt."""
    pre, post = template_parts(tok)
    ctx = _ids(tok, pre + sample.context)
    qst = _ids(tok, "\n" + sample.question + post + sample.answer_prefix)
    return torch.tensor([ctx]), torch.tensor([qst])


# ---------------------------------------------------------------------------------------------
# values and keys
# ---------------------------------------------------------------------------------------------

def _number(rng) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _uuid(rng) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word(rng) -> str:
    return rng.choice(WORDS)


def _key(rng) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


VALUE = {"number": (_number, "number", "numbers"), "uuid": (_uuid, "uuid", "uuids"),
         "word": (_word, "word", "words")}


def _distinct(rng, draw, n: int, avoid=()) -> list:
    out: list = []
    while len(out) < n:
        v = draw(rng)
        if v not in out and v not in avoid:
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------------
# haystacks
# ---------------------------------------------------------------------------------------------

def _insert(units: list, items: list, depths: list) -> list:
    """``units`` (haystack sentences / words) with ``items[i]`` inserted at fraction
    ``depths[i]`` of it (in order of depth; at a sentence end for word haystacks: the cut moves
    back to the nearest word ending a sentence, at most 40 words)."""
    out, last = [], 0
    for d, it in sorted(zip(depths, items), key=lambda p: p[0]):
        cut = max(last, int(round(d * len(units))))
        for back in range(min(40, cut - last)):
            if units[cut - 1 - back].endswith((".", "!", "?", '."', '?"', '!"')):
                cut -= back
                break
        out += units[last:cut] + [it]
        last = cut
    return out + units[last:]


def _austen_words(rng, novels: dict, n_words: int) -> list:
    """``n_words`` consecutive words from a random place of a random novel (drawn the same way
    whatever ``n_words``: the draws use a fixed-size window)."""
    name = rng.choice(sorted(novels))
    words = novels[name].split()
    span = max(0, len(words) - n_words)
    start = rng.randrange(0, span + 1) if span else 0
    return words[start:start + n_words]


def _austen(rng, novels: dict, n_words: int) -> list:
    # Draw the start once for the largest size ever tried so that all sizes share it.
    return _austen_words(rng, novels, n_words)


# ---------------------------------------------------------------------------------------------
# tasks: each builder takes (rng, size, novels) and returns a Sample without task/index
# ---------------------------------------------------------------------------------------------

def _niah_text(kind: str, noun: str, nouns: str):
    intro = (f"Some special magic {nouns} are hidden within the following text. Make sure to "
             f"memorize it. I will quiz you about the {nouns} afterwards.\n")
    needle = lambda k, v: f"One of the special magic {nouns} for {k} is: {v}."  # noqa: E731
    return intro, needle


def _niah(haystack: str, value: str, n_keys: int, n_values: int, n_queries: int,
          key_kind: str = "word"):
    """A needle-in-a-haystack builder. haystack: "noise", "austen" or "needles" (the haystack
    is made of other key/value needles); ``n_keys`` needles with distinct keys hidden (one
    asked unless ``n_queries`` > 1), or one key with ``n_values`` values."""
    draw_v, noun, nouns = VALUE[value]
    draw_k = _key if key_kind == "word" else _uuid

    def build(rng, size, novels):
        intro, needle = _niah_text(value, noun, nouns)
        keys = _distinct(rng, draw_k, n_keys)
        vals = _distinct(rng, draw_v, max(n_keys, n_values))
        if n_values > 1:
            needles = [needle(keys[0], v) for v in vals[:n_values]]
            asked, refs = keys[:1], vals[:n_values]
        else:
            needles = [needle(k, v) for k, v in zip(keys, vals)]
            asked, refs = keys[:n_queries], vals[:n_queries]
        depths = [rng.random() for _ in needles]
        if haystack == "noise":
            units = [NOISE] * size
            body = " ".join(_insert(units, needles, depths))
        elif haystack == "austen":
            words = _austen(random.Random(rng.random()), novels, size)
            body = " ".join(_insert(words, needles, depths))
        else:  # a haystack of other needles (distinct keys and values)
            sub = random.Random(rng.random())
            others = []
            used_k, used_v = set(keys), set(vals)
            for _ in range(size):
                k = draw_k(sub)
                while k in used_k:
                    k = draw_k(sub)
                v = draw_v(sub)
                while v in used_v:
                    v = draw_v(sub)
                used_k.add(k)
                used_v.add(v)
                others.append(needle(k, v))
            body = " ".join(_insert(others, needles, depths))
        if len(asked) == 1:
            q = f"What are all the special magic {nouns} for {asked[0]} mentioned in the provided text?"
            if n_values == 1:
                q = f"What is the special magic {noun} for {asked[0]} mentioned in the provided text?"
            prefix = (f"The special magic {nouns if n_values > 1 else noun} for {asked[0]} "
                      f"mentioned in the provided text {'are' if n_values > 1 else 'is'}")
        else:
            ks = ", ".join(asked[:-1]) + " and " + asked[-1]
            q = f"What are all the special magic {nouns} for {ks} mentioned in the provided text?"
            prefix = f"The special magic {nouns} for {ks} mentioned in the provided text are"
        return Sample("", 0, intro + body, q, prefix, refs,
                      {"keys": keys, "values": vals[:len(needles)], "depths": depths,
                       "asked": asked, "needles": needles})
    return build


def _vt(n_hops: int = 4):
    def build(rng, size, novels):
        names = _distinct(rng, lambda r: "".join(r.choice(string.ascii_uppercase) for _ in range(5)),
                          n_hops + 1)
        value = str(rng.randrange(10_000, 100_000))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}."
                                                   for i in range(n_hops)]
        depths = sorted(rng.random() for _ in chain)
        body = " ".join(_insert([NOISE] * size, chain, depths))
        intro = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
        q = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f"Answer: According to the chain of variable assignments in the text above, "
                  f"{n_hops + 1} variables are assigned the value {value}, they are:")
        return Sample("", 0, intro + body, q, prefix, list(names),
                      {"value": value, "chain": chain, "depths": depths})
    return build


def _cwe(num_cw: int = 10, freq_ucw: int = 3):
    def build(rng, size, novels, freq_cw=30):
        words = rng.sample(WORDS, len(WORDS))
        common = words[:num_cw]
        uncommon = [words[num_cw + i] if num_cw + i < len(words) else
                    f"{words[(i // len(words)) % len(words)]}-{words[i % len(words)]}"
                    for i in range(size)]
        items = common * freq_cw + uncommon * freq_ucw
        rng.shuffle(items)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        intro = ("Below is a numbered list of words. In these words, some appear more often than "
                 "others. Memorize the ones that appear most often.\n")
        q = f"Question: What are the {num_cw} most common words in the above list?"
        prefix = f"Answer: The top {num_cw} words that appear most often in the list are:"
        return Sample("", 0, intro + body, q, prefix, list(common),
                      {"freq_cw": freq_cw, "freq_ucw": freq_ucw, "n_uncommon": size})
    return build


def _fwe(alpha: float = 2.0, top: int = 3):
    def build(rng, size, novels):
        n_vocab = max(top + 2, size // 8)
        vocab = _distinct(rng, lambda r: "".join(r.choice(string.ascii_lowercase) for _ in range(5)),
                          n_vocab)
        w = [1.0 / (r + 1) ** alpha for r in range(n_vocab)]
        tot = sum(w)
        counts = [max(1, int(round(size * x / tot))) for x in w]
        for r in range(top, 0, -1):  # strict order of the top words and the next one
            counts[r - 1] = max(counts[r - 1], counts[r] + 1)
        items = [v for v, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(items)
        body = " ".join(items)
        intro = ("Read the following coded text and track the frequency of each coded word. Find "
                 f"the {top} most frequently appearing coded words.\n")
        q = (f"Question: Do not provide any explanation. What are the {top} most frequently "
             "appearing words in the above coded text?")
        prefix = (f"Answer: According to the coded text above, the {top} most frequently "
                  "appearing words are:")
        return Sample("", 0, intro + body, q, prefix, vocab[:top], {"counts": counts[:top + 1]})
    return build


BUILDERS: dict[str, Callable] = {
    "niah_single_1": _niah("noise", "number", 1, 1, 1),
    "niah_single_2": _niah("austen", "number", 1, 1, 1),
    "niah_single_3": _niah("austen", "uuid", 1, 1, 1),
    "niah_single_word": _niah("austen", "word", 1, 1, 1),
    "niah_multikey_1": _niah("austen", "number", 4, 1, 1),
    "niah_multikey_2": _niah("needles", "number", 1, 1, 1),
    "niah_multikey_3": _niah("needles", "uuid", 1, 1, 1, key_kind="uuid"),
    "niah_multivalue": _niah("austen", "number", 1, 4, 1),
    "niah_multiquery": _niah("austen", "number", 4, 1, 4),
    "vt": _vt(4),
    "cwe": _cwe(),
    "fwe": _fwe(),
}


def prompt_tokens(tok, sample: Sample) -> int:
    c, q = prompt_ids(tok, sample)
    return c.shape[1] + q.shape[1]


def make_sample(task: str, index: int, tok, tokens: int, novels: Optional[dict] = None,
                seed: int = 0) -> Sample:
    """Sample ``index`` of ``task``: the largest size whose prompt (context + question) is at
    most ``tokens`` tokens."""
    if task not in BUILDERS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if "niah" in task and task not in ("niah_single_1", "niah_multikey_2", "niah_multikey_3") \
            and not novels:
        raise ValueError(f"{task}: needs novels (the Austen haystack)")
    build = BUILDERS[task]
    extra = {}
    if task == "cwe":  # RULER's 30 repeats of the common words, fewer when they would not fit
        extra["freq_cw"] = max(4, min(30, tokens * 30 // 4096))

    def at(size):
        s = build(random.Random(f"{seed}:{task}:{index}"), size, novels, **extra)
        s.task, s.index = task, index
        s.meta["size"] = size
        return s

    fits = lambda size: prompt_tokens(tok, at(size)) <= tokens  # noqa: E731
    if not fits(0):
        raise ValueError(f"{task}: even an empty haystack exceeds {tokens} tokens")
    lo, hi = 0, 8
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise RuntimeError("size search diverged")
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return at(lo)


def make_samples(tasks, n: int, tok, tokens: int, novels=None, seed: int = 0, first: int = 0) -> list:
    """Samples ``first`` to ``n - 1`` of every task, index-major (every task's sample ``first``
    first), so that a run cut short holds as many samples of each task."""
    return [make_sample(t, i, tok, tokens, novels, seed) for i in range(first, n) for t in tasks]


# ---------------------------------------------------------------------------------------------
# a character-level tokenizer (tests and --quick: no download)
# ---------------------------------------------------------------------------------------------

class _Enc:
    def __init__(self, ids):
        self.input_ids = ids


class CharTokenizer:
    """One token per ASCII character (ids 3..127; other characters map to "?"); 0 pad, 1 bos,
    2 eos. Enough of a transformers tokenizer for this module, ``kp.hf.compress_context``'s
    kvzip prompts and decoding: ``__call__(text).input_ids``, ``decode``, ``apply_chat_template``."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    chat_template = "char"
    PRE, POST = "<user>\n", "\n<assistant>\n"

    def __call__(self, text, add_special_tokens=False, **_):
        return _Enc([o if 3 <= (o := ord(c)) < 128 else ord("?") for c in text])

    def encode(self, text, **kw):
        return self(text).input_ids

    def decode(self, ids, skip_special_tokens=True, **_):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(chr(i) for i in ids if i >= 3)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(self.PRE + m["content"] for m in messages)
        text += self.POST if add_generation_prompt else ""
        return self(text).input_ids if tokenize else text


def toy_novels(n_words: int = 4000, seed: int = 0) -> dict:
    """A stand-in for the Austen novels (tests, --quick): sentences of words from ``WORDS``."""
    rng = random.Random(seed)
    out = []
    while len(out) < n_words:
        s = [rng.choice(WORDS) for _ in range(rng.randrange(5, 14))]
        s[0] = s[0].capitalize()
        s[-1] += "."
        out += s
    return {"toy": " ".join(out)}
