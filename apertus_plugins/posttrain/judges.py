"""LLM judges: a small interface and an OpenAI-compatible HTTP backend (a ``vllm serve`` endpoint).

A judge does two things, both driven by configurable prompt templates:

* :meth:`Judge.feedback` writes textual feedback on a response (SDPO: a judge that sees the
  charter tells the policy what to improve);
* :meth:`Judge.rate` returns a score: the expected value of the judge's distribution over the
  rating tokens of a scale (online DPO: helpfulness on 1..5), read from the log-probabilities of
  the first generated token;
* :meth:`OpenAIJudge.preference` compares a response with a baseline response (the
  charter-alignment eval's length-controlled win rate): the judge's probability, from the same
  log-probabilities, that the response is the better one, averaged over both presentation orders.

Templates are plain text with ``{charter}``, ``{prompt}``, ``{response}``, ``{low}``, ``{high}``
and ``{aspect}`` fields; only those names are substituted, so JSON braces in a template are
left alone. The charter is text or a file. The backend talks through the package's HTTP client
(:mod:`apertus_plugins.infra.client`: a per-request timeout, its retry policy with exponential backoff on
connection errors, timeouts, 429 and 5xx), and raises a :class:`JudgeUnavailableError` naming the
endpoint when the judge cannot be reached.

Judges register through the core's plugin hook ``apertus_judges`` (``"openai"`` here), so a
third party adds a backend without touching this file::

    from apertus_plugins.plugins import make_judge
    judge = make_judge("openai", base_url="http://127.0.0.1:8000/v1", model="judge")
"""

from __future__ import annotations

import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from apertus_plugins.plugins.hooks import hookimpl

__all__ = [
    "DEFAULT_FEEDBACK_TEMPLATE",
    "DEFAULT_PAIRWISE_TEMPLATE",
    "DEFAULT_RATING_TEMPLATE",
    "Judge",
    "JudgeConfigError",
    "JudgeError",
    "JudgeResponseError",
    "JudgeUnavailableError",
    "OpenAIJudge",
    "Rating",
    "RatingScale",
    "SAMPLE_CHARTER",
    "CHARTER_SECTION",
    "PROMPT_SECTION",
    "RESPONSE_SECTION",
    "expected_rating",
    "fill_template",
    "sample_charter",
]

#: The sections of a judge prompt: what it judges against, what was asked, what was answered.
CHARTER_SECTION = "<charter>\n{charter}\n</charter>"
PROMPT_SECTION = "<user_prompt>\n{prompt}\n</user_prompt>"
RESPONSE_SECTION = "<assistant_response>\n{response}\n</assistant_response>"

DEFAULT_FEEDBACK_TEMPLATE = "\n\n".join([
    "You review an assistant's response against the charter below.",
    CHARTER_SECTION, PROMPT_SECTION, RESPONSE_SECTION,
    "Write short, concrete feedback: where the response departs from the charter and how it should change.\n"
    "If it already follows the charter, say what it does well. Do not rewrite the response.",
])

DEFAULT_RATING_TEMPLATE = "\n\n".join([
    "Rate the assistant's response for {aspect} on a scale from {low} (worst) to {high} (best).",
    CHARTER_SECTION, PROMPT_SECTION, RESPONSE_SECTION,
    "Answer with a single digit from {low} to {high} and nothing else.",
])

DEFAULT_PAIRWISE_TEMPLATE = "\n\n".join([
    "Two assistant responses answer the same user prompt. Which one better follows the charter\nbelow ({aspect})?",
    CHARTER_SECTION, PROMPT_SECTION,
    "{response}",
    "Answer with a single digit, 1 or 2, and nothing else.",
])

_FIELDS = ("charter", "prompt", "response", "low", "high", "aspect")
_FIELD_RE = re.compile(r"\{(" + "|".join(_FIELDS) + r")\}")


class JudgeError(RuntimeError):
    """Base class of judge failures."""


class JudgeUnavailableError(JudgeError):
    """The judge endpoint could not be reached (after all retries)."""


class JudgeConfigError(JudgeError, ValueError):
    """A judge set up without what it needs (a charter, an endpoint)."""


class JudgeResponseError(JudgeError):
    """The judge answered, but not with something usable (HTTP 4xx, no log-probabilities...)."""


def sample_charter() -> str:
    """A short sample charter shipped for tests and examples (not the Apertus charter)."""
    return (resources.files("apertus_plugins") / "assets" / "sample_charter.txt").read_text(encoding="utf-8")


def fill_template(template: str, **values: Any) -> str:
    """Substitute ``{charter}``, ``{prompt}``, ``{response}``, ``{low}``, ``{high}``, ``{aspect}``.

    Other braces are kept verbatim; a field the template uses but ``values`` lacks is an error.
    """
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in values or values[name] is None:
            raise ValueError(f"judge template uses {{{name}}} but no value for {name!r} was given")
        return str(values[name])

    return _FIELD_RE.sub(sub, template)


@dataclass(frozen=True)
class RatingScale:
    """An integer rating scale whose values are single tokens (``low..high`` within 0..9)."""

    low: int = 1
    high: int = 5

    def __post_init__(self) -> None:
        if not (0 <= self.low < self.high <= 9):
            raise ValueError(f"rating scale {self.low}..{self.high}: need 0 <= low < high <= 9 (each value one "
                             "digit, one token)")

    @property
    def labels(self) -> dict[str, int]:
        return {str(v): v for v in range(self.low, self.high + 1)}


def expected_rating(top_logprobs: Sequence[Mapping[str, Any]] | Mapping[str, float],
                    scale: RatingScale) -> tuple[float, dict[int, float]]:
    """Expected rating under the judge's distribution restricted to the scale's tokens.

    Args:
        top_logprobs: the first generated position's alternatives, either OpenAI's list of
            ``{"token": str, "logprob": float}`` or a ``{token: logprob}`` mapping. Token text is
            compared after stripping whitespace (``" 4"`` counts as ``4``); several spellings of one
            value add up.
        scale: the rating scale.

    Returns:
        ``(expectation, {value: renormalized probability})``.

    Raises:
        JudgeResponseError: when none of the scale's tokens is among the alternatives.
    """
    items = top_logprobs.items() if isinstance(top_logprobs, Mapping) else (
        (d["token"], d["logprob"]) for d in top_logprobs)
    mass: dict[int, float] = {}
    seen = []
    for token, logprob in items:
        seen.append(token)
        value = scale.labels.get(str(token).strip())
        if value is not None and logprob is not None and math.isfinite(float(logprob)):
            mass[value] = mass.get(value, 0.0) + math.exp(float(logprob))
    total = sum(mass.values())
    if total <= 0.0:
        raise JudgeResponseError(f"no rating token of the scale {scale.low}..{scale.high} among the judge's "
                                 f"top log-probabilities (saw {seen[:20]!r}); raise top_logprobs or fix the "
                                 "rating template")
    probs = {v: p / total for v, p in sorted(mass.items())}
    return sum(v * p for v, p in probs.items()), probs


@dataclass(frozen=True)
class Rating:
    """One rating: the expectation, the renormalized distribution over the scale, and what the judge answered
    (its generated token and the log-probabilities of the scale's tokens among its alternatives)."""

    value: float
    probs: dict[int, float]
    token: str = ""
    digit_logprobs: dict[str, float] = field(default_factory=dict)
    model: str = ""


class Judge(ABC):
    """The contract of a judge backend: what SDPO, online DPO and the evaluations call.

    A backend (the ``apertus_judges`` hook's factories return one) implements :meth:`feedback`
    and :meth:`rate`; :meth:`check` and the batch methods have working defaults (no start-up
    check; one item after the other) that a backend overrides when it can do better.
    """

    @abstractmethod
    def feedback(self, prompt: str, response: str) -> str:
        """Textual feedback on ``response`` to ``prompt``."""

    @abstractmethod
    def rate(self, prompt: str, response: str) -> float:
        """The expected rating of ``response`` to ``prompt``."""

    def check(self) -> Any:
        """Fail early (raise :class:`JudgeError`) when the judge cannot serve; called once at start."""
        return None

    def feedback_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
        """:meth:`feedback` for many items, in order."""
        _same_length(prompts, responses)
        return [self.feedback(p, r) for p, r in zip(prompts, responses, strict=True)]

    def rate_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """:meth:`rate` for many items, in order."""
        _same_length(prompts, responses)
        return [float(self.rate(p, r)) for p, r in zip(prompts, responses, strict=True)]


def _same_length(prompts: Sequence[str], responses: Sequence[str]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")


#: The value that names the short sample charter shipped for tests and demos (not the Apertus charter).
SAMPLE_CHARTER = "@sample"


def _read_text(value: str | os.PathLike[str] | None, what: str) -> str | None:
    """``value`` itself, or, for ``@path``, the contents of that file (``@sample``: the sample charter).

    Only the ``@`` prefix makes a value a file name: a string that merely looks like a path is text.
    """
    if value is None:
        return None
    s = os.fspath(value)
    if s == SAMPLE_CHARTER:
        return sample_charter()
    if not s.startswith("@"):
        return s
    path = Path(s[1:]).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"judge {what} file {path} (given as {s!r}) does not exist")
    return path.read_text(encoding="utf-8")


@dataclass
class OpenAIJudge(Judge):
    """A judge behind an OpenAI-compatible chat-completions endpoint.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name.
        charter: the charter, as text or ``@path`` of a file; required when a template uses ``{charter}``
            (the default templates do; ``"@sample"`` is the short sample charter shipped for tests and demos,
            not the Apertus charter).
        feedback_template / rating_template / pairwise_template: prompt templates (text or ``@path``).
        scale: ``(low, high)`` of the rating scale, e.g. ``(1, 5)`` or ``(0, 9)``.
        aspect: what the rating is about (``{aspect}`` in the rating template).
        system_prompt: optional system message for both requests.
        feedback_max_tokens / feedback_temperature: generation settings of the feedback.
        top_logprobs: alternatives requested for the rating token (vLLM's default cap is 20).
        timeout: seconds per HTTP request.
        max_retries: retries after the first attempt on connection errors, timeouts, 429, 5xx.
        backoff: first retry delay in seconds (doubles each retry).
        api_key: bearer token; default: the ``OPENAI_API_KEY`` environment variable if set.
        max_workers: concurrent requests in the batch methods.
        extra_body: extra request fields (e.g. ``{"chat_template_kwargs": {"enable_thinking": False}}``).
    """

    base_url: str
    model: str
    charter: str | None = None
    feedback_template: str = DEFAULT_FEEDBACK_TEMPLATE
    rating_template: str = DEFAULT_RATING_TEMPLATE
    pairwise_template: str = DEFAULT_PAIRWISE_TEMPLATE
    scale: tuple[int, int] | RatingScale = (1, 5)
    aspect: str = "helpfulness"
    system_prompt: str | None = None
    feedback_max_tokens: int = 512
    feedback_temperature: float = 0.0
    top_logprobs: int = 20
    timeout: float = 60.0
    max_retries: int = 3
    backoff: float = 0.5
    api_key: str | None = None
    max_workers: int = 8
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url or not str(self.base_url).startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must be an http(s) URL, got {self.base_url!r}")
        self.base_url = str(self.base_url).rstrip("/")
        if not self.model:
            raise ValueError("judge model name is empty")
        self.scale = self.scale if isinstance(self.scale, RatingScale) else RatingScale(*self.scale)
        self.feedback_template = _read_text(self.feedback_template, "feedback template") or ""
        self.rating_template = _read_text(self.rating_template, "rating template") or ""
        self.pairwise_template = _read_text(self.pairwise_template, "pairwise template") or ""
        # the pairwise template (the charter eval's preference) is checked when it is used
        uses_charter = any("{charter}" in t for t in (self.feedback_template, self.rating_template))
        if uses_charter and (self.charter is None or not str(self.charter).strip()):
            raise JudgeConfigError("the judge has no charter: give the charter's text or '@path/to/charter.md' "
                                   "(apertus.judge.charter in the verl configs); '@sample' is the short sample "
                                   "charter shipped for tests and demos")
        self.charter = _read_text(self.charter, "charter")
        if self.api_key is None:
            self.api_key = os.environ.get("OPENAI_API_KEY")
        if self.max_retries < 0 or self.timeout <= 0:
            raise ValueError("judge max_retries must be >= 0 and timeout > 0")

    # ------------------------------------------------------------------ HTTP
    def _request(self, path: str, payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from apertus_plugins.infra.client import Client, ResponseError, RetryPolicy, Unreachable

        url = f"{self.base_url}{path}"
        retry = RetryPolicy(attempts=self.max_retries + 1, backoff=self.backoff)
        try:
            with Client(self.base_url, api_key=self.api_key or "", timeout=self.timeout, retry=retry) as client:
                return client.json("GET" if payload is None else "POST", path, payload)
        except Unreachable as exc:
            raise JudgeUnavailableError(
                f"judge at {url} is unreachable after {self.max_retries + 1} attempts "
                f"(timeout {self.timeout}s each): {exc}") from exc
        except ResponseError as exc:
            raise JudgeResponseError(f"judge at {url}: {exc}") from exc

    def check(self) -> list[str]:
        """Ask the endpoint for its models; fail early if it is down or does not serve ``model``."""
        models = [m.get("id") for m in self._request("/models").get("data", [])]
        if self.model not in models:
            raise JudgeResponseError(f"judge at {self.base_url} does not serve model {self.model!r} "
                                     f"(it serves {models})")
        return models

    def _messages(self, user: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": user}]

    def chat(self, user: str, **params: Any) -> dict[str, Any]:
        """One chat completion for a user message (``params`` go into the request body)."""
        payload = {"model": self.model, "messages": self._messages(user), **self.extra_body, **params}
        out = self._request("/chat/completions", payload)
        if not out.get("choices"):
            raise JudgeResponseError(f"judge at {self.base_url} returned no choices: {str(out)[:300]}")
        return out

    # ------------------------------------------------------------------ judging
    def feedback_prompt(self, prompt: str, response: str) -> str:
        return fill_template(self.feedback_template, charter=self.charter, prompt=prompt, response=response,
                             low=self.scale.low, high=self.scale.high, aspect=self.aspect)

    def rating_prompt(self, prompt: str, response: str) -> str:
        return fill_template(self.rating_template, charter=self.charter, prompt=prompt, response=response,
                             low=self.scale.low, high=self.scale.high, aspect=self.aspect)

    def feedback(self, prompt: str, response: str) -> str:
        """Feedback text: what a reader of the judge's output sees (:func:`apertus_plugins.core.chat.visible_answer`)."""
        from apertus_plugins.core.chat import visible_answer

        out = self.chat(self.feedback_prompt(prompt, response), max_tokens=self.feedback_max_tokens,
                        temperature=self.feedback_temperature)
        text = out["choices"][0].get("message", {}).get("content") or ""
        return visible_answer(text)

    def rate_message(self, user: str) -> Rating:
        """Rate with a filled-in user message: one greedy token, the scale's digits read from its log-probabilities.

        The returned :class:`Rating` keeps what the judge answered (its token and the log-probabilities of
        the scale's tokens among the alternatives) for audit.
        """
        out = self.chat(user, max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=self.top_logprobs)
        content = ((out["choices"][0].get("logprobs") or {}).get("content")) or []
        if not content:
            raise JudgeResponseError(f"judge at {self.base_url} returned no log-probabilities; it must support "
                                     "logprobs/top_logprobs in chat completions")
        alternatives = content[0].get("top_logprobs") or []
        value, probs = expected_rating(alternatives, self.scale)
        digits = {str(a["token"]): float(a["logprob"]) for a in alternatives
                  if str(a.get("token", "")).strip() in self.scale.labels}
        return Rating(value, probs, str(content[0].get("token", "")), digits, str(out.get("model", self.model)))

    def rating_distribution(self, prompt: str, response: str) -> tuple[float, dict[int, float]]:
        """``(expected rating, {value: probability})`` from the first token's log-probabilities."""
        rating = self.rate_message(self.rating_prompt(prompt, response))
        return rating.value, rating.probs

    def rate(self, prompt: str, response: str) -> float:
        return self.rating_distribution(prompt, response)[0]

    def _first_of_two(self, prompt: str, first: str, second: str) -> float:
        if "{charter}" in self.pairwise_template and (self.charter is None or not str(self.charter).strip()):
            raise JudgeConfigError("the judge's pairwise template uses {charter} and the judge has no charter: "
                                   "give the charter's text or '@path/to/charter.md'")
        pair = (f"<response_1>\n{first}\n</response_1>\n\n<response_2>\n{second}\n</response_2>")
        user = fill_template(self.pairwise_template, charter=self.charter, prompt=prompt, response=pair, low=1, high=2,
                             aspect=self.aspect)
        out = self.chat(user, max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=self.top_logprobs)
        content = ((out["choices"][0].get("logprobs") or {}).get("content")) or []
        if not content:
            raise JudgeResponseError(f"judge at {self.base_url} returned no log-probabilities; it must support "
                                     "logprobs/top_logprobs in chat completions")
        _, probs = expected_rating(content[0].get("top_logprobs") or [], RatingScale(1, 2))
        return probs.get(1, 0.0)

    def preference(self, prompt: str, response: str, baseline: str) -> float:
        """The judge's probability that ``response`` is better than ``baseline`` (both orders averaged,
        so a judge that favours one position does not favour one side)."""
        return 0.5 * (self._first_of_two(prompt, response, baseline) + 1.0 - self._first_of_two(prompt, baseline, response))

    def _map(self, fn: Callable[[str, str], Any], prompts: Sequence[str], responses: Sequence[str]) -> list[Any]:
        _same_length(prompts, responses)
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(prompts)))) as pool:
            return list(pool.map(fn, prompts, responses))

    def feedback_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
        """:meth:`feedback` for many items, ``max_workers`` requests at a time, in order."""
        return self._map(self.feedback, prompts, responses)

    def rate_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """:meth:`rate` for many items, ``max_workers`` requests at a time, in order."""
        return self._map(self.rate, prompts, responses)


@hookimpl
def apertus_judges() -> dict[str, Callable[..., Any]]:
    return {"openai": OpenAIJudge}
