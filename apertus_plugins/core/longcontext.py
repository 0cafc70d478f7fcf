"""Synthetic verifiable long-context tasks (report section 3.3, Appendix F, section 4.3, Table 8).

The long-context extension and long-context SFT train on three synthetic tasks besides real
documents. Each example is one conversation, tokenized as one sequence: a long body inside the
first user turn, then question and answer turns. Only the answers are trained; the body (a real
document, a shuffled document or a synthetic haystack) and the questions are input.

* **CWE** (common-word extraction): how many times each of several words occurs in a document.
  The words are drawn from the document's ``CWE_TOP_K`` most frequent words of at least
  ``CWE_MIN_WORD_LEN`` letters that are not stop words; one question per word, each in one of
  ten question/answer formats (:data:`CWE_FORMATS`). A word is a run of letters (any script),
  compared without case.
* **DocOrder** (document-order reconstruction): the document's tokens cut into equal sections,
  shown shuffled under ``[Section k]`` headers numbered by shown position; the answer lists the
  section numbers in their original order, in one of ten formats (:data:`DOCORDER_FORMATS`).
* **Needles** (artificial needles, Xiong et al. 2025): numbered listings of integer key/value
  pairs, one of them holding the gold key; the answer gives its value and the listing it is in.

Buckets (section 3.3): a source document whose token count lies in ``[T/4, T/2)`` for target
length ``T`` is *hard* (10 CWE questions, 8 DocOrder sections); one in ``[T/2, T]`` (its
example still fitting ``T``) is *easy* (5 questions, 4 sections). Shorter, longer, empty, or
otherwise unusable documents are skipped with a reason (:class:`Skip`). Needle examples take a
length drawn uniformly from ``[T/4, T]``.

Mix (Appendix F, Tables F.1 and F.2, and Table 8): the three tasks' token shares of each
long-context step and of long-context SFT (:func:`report_mix`). The generator picks for each next
example the task furthest behind its share of the tokens written so far, so the shares of a run
follow the mix from its first examples on.

Streaming: examples are produced one at a time from an iterator of documents; a document is
tokenized chunk by chunk and abandoned once it exceeds the target, so memory holds one example
(a few bytes per token) whatever the number of examples, and never more than ``T`` tokens of a
document.

Everything is deterministic from the seed: each example draws from its own generator seeded by
``(seed, example index)``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .release import CONTEXT_LENGTH
from .targets import sft_mask
from .vocab import VocabSpec

__all__ = [
    "TASKS",
    "STEPS",
    "REPORT_TASK_TOKENS",
    "Bucket",
    "HARD",
    "EASY",
    "CWE_TOP_K",
    "CWE_MIN_WORD_LEN",
    "CWE_FORMATS",
    "DOCORDER_FORMATS",
    "SYSTEM_PROMPT",
    "Example",
    "Skip",
    "LongContextTasks",
    "report_mix",
    "count_words",
    "bucket_of",
]

#: The task names, in the order of :data:`REPORT_TASK_TOKENS`' columns.
TASKS = ("cwe", "docorder", "needles")

#: The long-context extension steps (section 3.3) by recipe name, and long-context SFT (section 4.3).
STEPS: dict[str, int] = {"32k": 32_768, "64k": 65_536, "128k": 131_072, "256k": CONTEXT_LENGTH,
                         "sft": CONTEXT_LENGTH}

#: Tokens of each task per step: Table F.1 (8B) and F.2 (70B), rows CWE, DocOrder, ArtificialNeedles;
#: ``sft``: Table 8's "Text (long-context)" rows.
REPORT_TASK_TOKENS: dict[str, dict[str, tuple[float, float, float]]] = {
    "8b": {"32k": (2.86e9, 1.79e9, 950.1e6), "64k": (2.66e9, 1.57e9, 943.6e6),
           "128k": (2.60e9, 1.41e9, 947.0e6), "256k": (2.58e9, 1.33e9, 948.7e6),
           "sft": (184.2e6, 92.9e6, 66.3e6)},
    "70b": {"32k": (2.73e9, 1.71e9, 908.0e6), "64k": (2.72e9, 1.60e9, 966.5e6),
            "128k": (2.28e9, 1.23e9, 831.2e6), "256k": (2.27e9, 1.16e9, 833.2e6),
            "sft": (236.8e6, 119.4e6, 85.3e6)},
}


def report_mix(model: str, step: str) -> dict[str, float]:
    """The report's token share of each task at ``step`` (``32k``..``256k``, ``sft``) for ``model`` (``8b``, ``70b``)."""
    if model not in REPORT_TASK_TOKENS:
        raise ValueError(f"model {model!r}: the report gives the mix for {', '.join(REPORT_TASK_TOKENS)}")
    steps = REPORT_TASK_TOKENS[model]
    if step not in steps:
        raise ValueError(f"step {step!r}: the report gives the mix for {', '.join(steps)}")
    tokens = steps[step]
    total = sum(tokens)
    return {t: v / total for t, v in zip(TASKS, tokens, strict=True)}


@dataclass(frozen=True)
class Bucket:
    """A difficulty bucket: source documents of ``[lo, hi)`` times the target length."""

    name: str
    lo: float
    hi: float
    cwe_questions: int
    docorder_sections: int


#: Section 3.3: shorter documents, more items; longer documents, fewer items.
HARD = Bucket("hard", 0.25, 0.5, 10, 8)
EASY = Bucket("easy", 0.5, 1.0, 5, 4)

#: CWE candidate words: the most frequent this many, of at least this many letters (LongContextQA's settings).
CWE_TOP_K = 15
CWE_MIN_WORD_LEN = 4
#: DocOrder: fewest tokens per section (a shorter document cannot be cut meaningfully).
DOCORDER_MIN_SECTION = 32
#: Needles: share of examples with the gold listing first, and within the first 5 % (LongContextQA's position bias).
NEEDLE_FIRST, NEEDLE_EARLY = 0.05, 0.03

SYSTEM_PROMPT = "You are a helpful assistant. Answer concisely."

#: Words that never count: function words and very common verbs (English; other languages have few of
#: four letters or more among their most frequent words' candidates).
STOPWORDS = frozenset("""
about above after again against also among around because been before being below between both
came come could does doing done down during each even ever every from further have having here
hers herself himself into itself just like made make many might more most much must myself never
only other ours ourselves over same shall should some such than that their theirs them themselves
then there these they this those through under until upon very were what when where which while
whom whose will with within without would your yours yourself yourselves said also well back
""".split())

_WORD = re.compile(r"[^\W\d_]+")


def count_words(text: str) -> Counter[str]:
    """Occurrences of every word of ``text`` (letter runs of any script, lower-cased)."""
    return Counter(m.group().lower() for m in _WORD.finditer(text))


def _countable(word: str) -> bool:
    return len(word) >= CWE_MIN_WORD_LEN and word not in STOPWORDS


# ---------------------------------------------------------------------------------------------- formats
def _q(word: str) -> str:
    return f'"{word}"'


#: Ten (question, answer) formats of a CWE turn: ``f(word, count) -> (question, answer)``.
CWE_FORMATS: tuple[Callable[[str, int], tuple[str, str]], ...] = (
    lambda w, n: (f"How many times does the word {_q(w)} occur in the document above?",
                  f"The word {_q(w)} occurs {n} times."),
    lambda w, n: (f"Count the occurrences of {_q(w)} in the text above (ignore capitalization). "
                  "Reply with the number only.", f"{n}"),
    lambda w, n: (f"In the document above, how often is the word {_q(w)} used? Answer as WORD: COUNT.",
                  f"{w}: {n}"),
    lambda w, n: (f"Give the frequency of {_q(w)} in the passage above as JSON with the keys "
                  '"word" and "count".', f'{{"word": "{w}", "count": {n}}}'),
    lambda w, n: (f"What is the number of occurrences of {_q(w)} in the text above? Start your answer "
                  'with "Count:".', f"Count: {n}"),
    lambda w, n: (f"Across the whole document above, how many occurrences of {_q(w)} are there, in any "
                  "capitalization?", f"There are {n} occurrences of {_q(w)}."),
    lambda w, n: (f"Tell me how often {_q(w)} appears above, in the form WORD = COUNT.", f"{w} = {n}"),
    lambda w, n: (f"How frequently is {_q(w)} written in the document above? Answer with the count "
                  'followed by "times".', f"{n} times"),
    lambda w, n: (f"Look through the text above once more: how many times is {_q(w)} there? Answer in "
                  "a full sentence.", f"{_q(w)} is there {n} times."),
    lambda w, n: (f"Report the count of the word {_q(w)} in the document above as WORD -> COUNT.",
                  f"{w} -> {n}"),
)


def _join(sep: str) -> Callable[[list[int]], str]:
    return lambda order: sep.join(str(x) for x in order)


#: Ten (question, answer) formats of DocOrder: ``(question, f(order) -> answer)``.
DOCORDER_FORMATS: tuple[tuple[str, Callable[[list[int]], str]], ...] = (
    ("The sections above are out of order. Give their original order as section numbers separated by "
     "commas, with no spaces.", _join(",")),
    ("Someone shuffled the sections of the document above. List the section numbers in the order the "
     "document was written, separated by single spaces.", _join(" ")),
    ("Restore the original order of the sections above. Answer with a JSON list of section numbers.",
     lambda order: "[" + ", ".join(str(x) for x in order) + "]"),
    ("In which order should the sections above be read? Answer with the section numbers joined by ' -> '.",
     _join(" -> ")),
    ("The document above lost its section order. Write the correct order of the section numbers "
     "separated by hyphens.", _join("-")),
    ("Put the shuffled sections above back in order. Answer with each section number in parentheses, "
     "one after the other.", lambda order: "".join(f"({x})" for x in order)),
    ("Order the sections above as in the original document: the section numbers separated by a comma "
     "and a space.", _join(", ")),
    ("The sections above are permuted. Answer with the original sequence of section numbers separated "
     "by vertical bars.", _join("|")),
    ("Reconstruct the original order of the sections above: one section number per line, nothing else.",
     _join("\n")),
    ("What was the original order of the sections above? Start your answer with 'Order:' and separate "
     "the numbers with commas.", lambda order: "Order: " + ", ".join(str(x) for x in order)),
)

_NEEDLE_INTRO = "Below is a numbered collection of listings; each maps integer keys to integer values."
_NEEDLE_QUESTION = ("Each listing above maps integer keys to integer values. Find key {key}: what is its value, "
                    "and which listing holds it? Answer in this form: The value of key {key} is <value> and "
                    "it is in Listing [<number>].")
_NEEDLE_ANSWER = "The value of key {key} is {value} and it is in Listing [{name}]."


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Example:
    """One training example: ``ids`` (int64) and the token-aligned loss mask ``mask`` (uint8, 1 = trained).

    ``facts`` holds what the answers state (CWE: ``{"counts": {word: count}}``; DocOrder:
    ``{"order": [...], "sections": N}``; Needles: ``{"key", "value", "listing", "listings"}``).
    """

    index: int
    task: str
    bucket: str | None
    source: str | None
    ids: np.ndarray
    mask: np.ndarray
    questions: list[str]
    answers: list[str]
    facts: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The JSON-ready description of the example (without its ids)."""
        return {"index": self.index, "task": self.task, "bucket": self.bucket, "source": self.source,
                "tokens": int(self.ids.size), "trained": int(self.mask.sum()), "answers": self.answers,
                "facts": self.facts}


@dataclass(frozen=True)
class Skip:
    """A source document that yields no example: its name, a reason code and the detail."""

    source: str
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.source}: skipped ({self.reason}): {self.detail}"


#: Skip reasons.
EMPTY, TOO_SHORT, TOO_LONG, FEW_WORDS = "empty", "too-short", "too-long", "too-few-words"


def bucket_of(n_tokens: int, length: int) -> Bucket | None:
    """The bucket of a source document of ``n_tokens`` for target ``length`` (None: shorter than ``length/4``)."""
    if n_tokens < math.ceil(HARD.lo * length):
        return None
    return HARD if n_tokens < math.ceil(HARD.hi * length) else EASY


# ---------------------------------------------------------------------------------------------- generator
class LongContextTasks:
    """Generate the synthetic tasks at one target length from a stream of documents.

    Args:
        chat: a :class:`~apertus_plugins.core.chat.ChatTokenizer` (its ``spec`` is used for the mask).
        length: the target length ``T`` in tokens (every example has between ``T/4`` and ``T``).
        mix: token share of each task (keys of :data:`TASKS`; zero or missing: not generated);
            :func:`report_mix` gives the report's.
        seed: the seed every draw derives from.
        chunk_chars: characters of a document tokenized at a time (memory bound, not output).
    """

    def __init__(self, chat: Any, length: int, mix: Mapping[str, float], seed: int = 0, *,
                 chunk_chars: int = 1 << 16) -> None:
        if int(length) < 256:
            raise ValueError(f"target length {length}: at least 256 tokens")
        unknown = sorted(set(mix) - set(TASKS))
        if unknown:
            raise ValueError(f"mix names unknown tasks {unknown}; tasks are {', '.join(TASKS)}")
        shares = {t: float(mix.get(t, 0.0)) for t in TASKS}
        if any(not math.isfinite(v) or v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
            raise ValueError(f"mix {dict(mix)}: shares must be finite, non-negative and not all zero")
        total = sum(shares.values())
        self.chat = chat
        self.spec: VocabSpec = chat.spec
        self.length = int(length)
        self.mix = {t: v / total for t, v in shares.items()}
        self.seed = int(seed)
        self.chunk_chars = int(chunk_chars)
        self.tokens = dict.fromkeys(TASKS, 0)
        self.examples = dict.fromkeys(TASKS, 0)
        self._user_start = self.spec.id("user_start")
        self._text_cache: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ helpers
    def _ids(self, text: str) -> np.ndarray:
        """Plain-text ids of a short string (cached: headers and separators repeat)."""
        hit = self._text_cache.get(text)
        if hit is None:
            hit = np.asarray(self.chat.text_ids(text), dtype=np.int64)
            if len(self._text_cache) < 4096:
                self._text_cache[text] = hit
        return hit

    def document_ids(self, text: str, limit: int) -> np.ndarray | None:
        """Ids of ``text`` tokenized chunk by chunk (cut before a space); None once more than ``limit``."""
        parts: list[np.ndarray] = []
        n = 0
        pos = 0
        size = self.chunk_chars
        while pos < len(text):
            end = min(len(text), pos + size)
            if end < len(text):
                cut = text.rfind(" ", pos + 1, end)
                end = cut if cut > pos else end
            ids = np.asarray(self.chat.text_ids(text[pos:end]), dtype=np.int64)
            n += ids.size
            if n > limit:
                return None
            parts.append(ids)
            pos = end
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _frame(self, turns: list[tuple[str, str]]) -> np.ndarray:
        """The conversation with an empty body: system, then (user, assistant) turns."""
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        for user, assistant in turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return np.asarray(self.chat.encode_conversation(messages, variant="training", enable_thinking=False).ids,
                          dtype=np.int64)

    def _example(self, index: int, task: str, bucket: str | None, source: str | None, body: np.ndarray,
                 turns: list[tuple[str, str]], facts: dict[str, Any]) -> Example | None:
        """Splice ``body`` at the start of the first user turn; None when it does not fit the target."""
        frame = self._frame(turns)
        if frame.size + body.size > self.length:
            return None
        at = int(np.flatnonzero(frame == self._user_start)[0]) + 1
        ids = np.concatenate([frame[:at], body, frame[at:]])
        mask = np.zeros(ids.size, dtype=np.uint8)
        mask[1:] = sft_mask(ids, self.spec)
        return Example(index, task, bucket, source, ids, mask, [q for q, _ in turns], [a for _, a in turns], facts)

    def _next_task(self) -> str:
        """The task furthest behind its share of the tokens so far (ties: :data:`TASKS` order)."""
        done = sum(self.tokens.values())
        live = [t for t in TASKS if self.mix[t] > 0]
        return max(live, key=lambda t: (self.mix[t] * (done + 1) - self.tokens[t], -TASKS.index(t)))

    # ------------------------------------------------------------------ tasks
    def cwe(self, index: int, source: str, text: str, body: np.ndarray, bucket: Bucket) -> Example | Skip:
        """Common-word extraction over one document (its ids already in ``body``)."""
        rng = np.random.default_rng([self.seed, index])
        counts = count_words(text)
        candidates = [(w, c) for w, c in counts.most_common() if _countable(w)][:CWE_TOP_K]
        n = bucket.cwe_questions
        if len(candidates) < n:
            return Skip(source, FEW_WORDS, f"{len(candidates)} distinct countable words (letters >= "
                                           f"{CWE_MIN_WORD_LEN}, no stop words), {n} needed for the {bucket.name} "
                                           "bucket")
        picks = rng.choice(len(candidates), size=n, replace=False)
        turns = []
        for k, p in enumerate(picks):
            word, count = candidates[int(p)]
            question, answer = CWE_FORMATS[int(rng.integers(len(CWE_FORMATS)))](word, count)
            turns.append(("\n\n" + question if k == 0 else question, answer))
        facts = {"counts": {candidates[int(p)][0]: candidates[int(p)][1] for p in picks}}
        ex = self._example(index, "cwe", bucket.name, source, body, turns, facts)
        return ex if ex is not None else Skip(source, TOO_LONG, f"{body.size} tokens and {n} questions exceed "
                                                                 f"the target {self.length}")

    def docorder(self, index: int, source: str, body: np.ndarray, bucket: Bucket) -> Example | Skip:
        """Document-order reconstruction of one document (its ids in ``body``)."""
        rng = np.random.default_rng([self.seed, index])
        n = bucket.docorder_sections
        if body.size < n * DOCORDER_MIN_SECTION:
            return Skip(source, TOO_SHORT, f"{body.size} tokens cannot make {n} sections of "
                                           f"{DOCORDER_MIN_SECTION} or more")
        size = body.size // n
        sections = [body[k * size:(k + 1) * size if k < n - 1 else body.size] for k in range(n)]
        perm = rng.permutation(n)  # perm[shown position] = original section; never the original order
        while np.array_equal(perm, np.arange(n)):
            perm = rng.permutation(n)
        order = [0] * n
        for shown, original in enumerate(perm):
            order[int(original)] = shown + 1
        parts = []
        for shown, original in enumerate(perm):
            if shown:
                parts.append(self._ids("\n\n"))
            parts += [self._ids(f"[Section {shown + 1}]\n"), sections[int(original)]]
        question, answer_of = DOCORDER_FORMATS[int(rng.integers(len(DOCORDER_FORMATS)))]
        facts = {"order": order, "sections": n}
        ex = self._example(index, "docorder", bucket.name, source, np.concatenate(parts),
                           [("\n\n" + question, answer_of(order))], facts)
        return ex if ex is not None else Skip(source, TOO_LONG, f"{body.size} tokens in {n} sections exceed the "
                                                                 f"target {self.length}")

    def needles(self, index: int) -> Example:
        """One artificial-needles example of a length drawn from ``[T/4, T]``."""
        rng = np.random.default_rng([self.seed, index])

        def number() -> int:
            digits = int(rng.integers(3, 5))
            return int(rng.integers(10 ** (digits - 1), 10 ** digits))

        key, value = number(), number()

        def listing(gold: bool) -> dict[int, int]:
            size = int(rng.integers(3, 5))
            at = int(rng.integers(size)) if gold else -1
            out: dict[int, int] = {}
            while len(out) < size:
                if len(out) == at:
                    out[key] = value
                    continue
                k, v = number(), number()
                if k != key and v != value and k not in out:
                    out[k] = v
            return out

        def line(name: int, entries: dict[int, int]) -> str:
            return f"\nListing [{name}] {{" + ", ".join(f"{k}: {v}" for k, v in entries.items()) + "}"

        frame_len = self._frame([("\n\n" + _NEEDLE_QUESTION.format(key=key),
                                  _NEEDLE_ANSWER.format(key=key, value=value, name=10 ** 5))]).size
        # the room of the gold listing (its longest form), reserved so that it always fits
        reserve = self._ids(line(10 ** 5, {key: value, 9999: 9999, 9998: 9998, 9997: 9997})).size + 8
        lo = math.ceil(HARD.lo * self.length) + 2 * reserve
        target = int(rng.integers(min(lo, self.length), self.length + 1))
        budget = max(0, target - frame_len - reserve)
        draw = rng.random()
        if draw < NEEDLE_FIRST:
            gold_at = 0
        elif draw < NEEDLE_FIRST + NEEDLE_EARLY:
            gold_at = int(rng.integers(max(1, budget // 20)))
        else:
            gold_at = int(rng.integers(max(1, budget)))
        parts = [self._ids(_NEEDLE_INTRO)]
        used = parts[0].size
        name, gold_name = 0, 0
        while True:
            gold = not gold_name and used >= gold_at
            piece = np.asarray(self.chat.text_ids(line(name + 1, listing(gold))), np.int64)
            if not gold and used + piece.size > budget:
                if gold_name:
                    break
                gold_at = used  # the gold listing goes in now, in its reserved room
                continue
            name += 1
            gold_name = name if gold else gold_name
            parts.append(piece)
            used += piece.size
        body = np.concatenate(parts)
        facts = {"key": key, "value": value, "listing": gold_name, "listings": name}
        turns = [("\n\n" + _NEEDLE_QUESTION.format(key=key), _NEEDLE_ANSWER.format(key=key, value=value,
                                                                                    name=gold_name))]
        ex = self._example(index, "needles", None, None, body, turns, facts)
        assert ex is not None  # the body was sized to fit
        return ex

    # ------------------------------------------------------------------ the stream
    def run(self, documents: Iterable[tuple[str, str] | Skip], *, max_tokens: int | None = None,
            max_examples: int | None = None) -> Iterator[Example | Skip]:
        """Examples (and the documents skipped, as :class:`Skip`) until the documents or a limit run out.

        ``documents`` yields ``(name, text)`` pairs (or a :class:`Skip` for an unreadable record, passed
        through). CWE and DocOrder take one document each; needles take none. Without documents to
        read (a needles-only mix) a limit is needed.
        """
        if max_tokens is None and max_examples is None and self.mix["cwe"] == self.mix["docorder"] == 0:
            raise ValueError("a needles-only mix needs max_tokens or max_examples")
        docs = iter(documents)
        index = 0
        while (max_tokens is None or sum(self.tokens.values()) < max_tokens) and \
                (max_examples is None or index < max_examples):
            task = self._next_task()
            if task == "needles":
                ex: Example | Skip = self.needles(index)
            else:
                ex = self._from_documents(task, index, docs)
                if ex is None:
                    return
            if isinstance(ex, Example):
                self.tokens[task] += int(ex.ids.size)
                self.examples[task] += 1
                index += 1
            yield ex

    def _from_documents(self, task: str, index: int, docs: Iterator[tuple[str, str] | Skip]) -> Example | Skip | None:
        """The next document's example for ``task``, or its :class:`Skip`; None when the documents end."""
        item = next(docs, None)
        if item is None or isinstance(item, Skip):
            return item
        source, text = item
        text = text.strip() if isinstance(text, str) else ""
        if not text:
            return Skip(source, EMPTY, "no text")
        body = self.document_ids(text, self.length)
        if body is None:
            return Skip(source, TOO_LONG, f"more than the target {self.length} tokens")
        bucket = bucket_of(body.size, self.length)
        if bucket is None:
            return Skip(source, TOO_SHORT, f"{body.size} tokens, under a quarter of the target {self.length}")
        if task == "cwe":
            return self.cwe(index, source, text, body, bucket)
        return self.docorder(index, source, body, bucket)
