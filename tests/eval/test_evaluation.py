"""The evaluation protocol pieces of the core on hand-written generations."""

from __future__ import annotations

import pytest

from apertus_plugins.core.chat.parse import CALL_CLOSE, CALL_OPEN, EOS, TURN_END
from apertus_plugins.posttrain.evaluation import (
    AUDIO_DEFAULT_MAX_TOKENS,
    DEFAULT_DECODING,
    MEAN_AT_K,
    THINKING_DECODING,
    audio_max_tokens,
    bfcl_tools,
    degeneration,
    extract_boxed,
    extract_choice,
    extract_number,
    is_refusal,
    length_controlled_win_rate,
    mean_over_repeats,
    parse_calls,
    score_calls,
    split_thinking,
    stop_strings,
    strip_thinking,
)

# ------------------------------------------------------------------ thinking


@pytest.mark.parametrize("text, answer", [
    ("<|inner_prefix|>let me think<|inner_suffix|>The answer is B.", "The answer is B."),
    ("<think>let me think</think>The answer is B.", "The answer is B."),
    ("<|inner_prefix|>mixed forms</think> Paris", "Paris"),
    ("<think>first</think>draft</think> final", "final"),  # the last closing delimiter wins
    ("only thinking</think>42", "42"),  # the opener was part of the prompt
    ("<think>never closed, the budget ran out", ""),
    ("<|inner_prefix|>never closed", ""),
    ("<think>a</think>b<think>reopened and never closed", ""),
    ("plain answer", "plain answer"),
    (f"done{TURN_END}garbage after the turn", "done"),
    (f"done{EOS}more", "done"),
])
def test_strip_thinking_both_forms_last_closer_and_unclosed(text: str, answer: str) -> None:
    assert strip_thinking(text) == answer


def test_split_thinking_returns_the_thinking_text() -> None:
    assert split_thinking("<think>why</think>because") == ("why", "because")
    assert split_thinking("no span") == (None, "no span")
    thinking, answer = split_thinking("<think>cut off")
    assert (thinking, answer) == ("cut off", "")


def test_tool_calls_are_not_part_of_the_answer() -> None:
    text = f'<think>call it {CALL_OPEN}[{{"f": {{}}}}]{CALL_CLOSE}</think>Done. {CALL_OPEN}[{{"g": {{"x": 1}}}}]{CALL_CLOSE}'
    assert strip_thinking(text) == "Done."
    assert [c.name for c in parse_calls(text)] == ["f", "g"]


# ------------------------------------------------------------------ answers


OPTS = ["Zurich", "Bern", "Geneva", "Basel"]


@pytest.mark.parametrize("text, letter", [
    ("B", "B"),
    ("(C)", "C"),
    ("B. Bern", "B"),
    ("D: Basel is the answer", "D"),
    ("The answer is (B).", "B"),
    ("After weighing everything, the answer is C", "C"),
    ("Answer: D", "D"),
    ("**A**", "A"),
    ("\\boxed{B}", "B"),
    ("A is tempting, but the answer is (B).", "B"),  # the explicit statement wins over a leading letter
    ("The capital of Switzerland is Bern.", "B"),  # prose naming the option
    ("I would say geneva, definitely.", "C"),
    ("<think>Maybe A? No.</think>The answer is (D)", "D"),
    ("<|inner_prefix|>The answer is (A)<|inner_suffix|>Bern", "B"),  # thinking never counts
    ("<think>unclosed, the answer is (A)", None),
    ("A cat sat on the mat.", None),  # an article, not a choice
    ("Zurich or Geneva, hard to say.", None),  # two options named: no choice
    ("", None),
])
def test_extract_choice_survives_prose_and_the_apertus_format(text: str, letter: str | None) -> None:
    assert extract_choice(text, options=OPTS) == letter


def test_extract_choice_keeps_the_longest_of_nested_option_names() -> None:
    assert extract_choice("It is in New York.", options=["York", "New York", "Boston"]) == "B"


def test_extract_choice_respects_the_number_of_options() -> None:
    assert extract_choice("The answer is (E)", num_choices=4) is None
    assert extract_choice("The answer is (E)", num_choices=5) == "E"


@pytest.mark.parametrize("text, number", [
    ("3 + 4 = 7\n#### 7", "7"),
    ("The total is 1,234 apples. The answer is 1,234.", "1234"),
    ("So we get \\boxed{42}.", "42"),
    ("so \\boxed{\\frac{1}{2}} at the end, then 5", "\\frac{1}{2}"),
    ("It costs $18.00 in total.", "18"),
    ("Half of it: 0.5", "0.5"),
    ("<think>maybe 3</think>The answer is 4.", "4"),
    ("<think>it is 3, and no answer follows", None),
    ("no digits here", None),
])
def test_extract_number(text: str, number: str | None) -> None:
    assert extract_number(text) == number


def test_extract_boxed_handles_nesting() -> None:
    assert extract_boxed("a \\boxed{x} b \\boxed{\\sqrt{\\frac{a}{b}}}") == "\\sqrt{\\frac{a}{b}}"
    assert extract_boxed("\\boxed{unbalanced") is None
    assert extract_boxed("nothing") is None


# ------------------------------------------------------------------ degeneration


def test_degeneration_flags_loops_at_every_scale() -> None:
    assert degeneration("the the the the the the the the the the").degenerate
    loop = " ".join(["I will now repeat this sentence again and again."] * 40)
    result = degeneration(loop)
    assert result.degenerate and result.ratio > 0.8
    # a long loop of a 30-word paragraph is caught by the longer n-grams too
    paragraph = " ".join(f"w{i}" for i in range(30))
    long_loop = degeneration(" ".join([paragraph] * 20))
    assert long_loop.degenerate and long_loop.ratios[25] > 0.8 and long_loop.ratios[50] > 0.8


def test_degeneration_spares_ordinary_text_and_short_answers() -> None:
    prose = ("Bern is the de facto capital of Switzerland. The federal parliament meets there, and the old town "
             "is a UNESCO world heritage site. The river Aare loops around it, and the city is known for its "
             "arcades, fountains and the clock tower that draws visitors every hour.")
    assert not degeneration(prose).degenerate
    assert not degeneration("B").degenerate
    assert degeneration("").n is None and not degeneration("").degenerate


def test_degeneration_works_in_chunks_of_1024_words() -> None:
    # 2,000 distinct words then a loop of 600: the loop lives in the second chunk only
    text = " ".join(f"u{i}" for i in range(2000)) + " " + " ".join(["again"] * 600)
    assert degeneration(text).degenerate
    assert not degeneration(text, chunk=4096).degenerate  # diluted over one big chunk: 1 - 2001/2600 < 0.8


def test_degeneration_counts_the_thinking_span() -> None:
    text = "<think>" + "hmm " * 300 + "</think>B"
    assert strip_thinking(text) == "B" and degeneration(text).degenerate


# ------------------------------------------------------------------ tool calls (BFCL)


WEATHER = {"name": "get_weather", "description": "Weather.",
           "parameters": {"type": "dict", "properties": {"city": {"type": "string"},
                                                         "days": {"type": "integer"},
                                                         "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "dict", "properties": {"a": {"type": "float"}, "b": {"type": "float"}},
                                     "required": ["a", "b"]}}
TRUTH = [{"get_weather": {"city": ["Bern", "Bern, Switzerland"], "days": [3], "unit": ["c", ""]}}]


def _call(payload: str, terminated: bool = True) -> str:
    return CALL_OPEN + payload + (CALL_CLOSE if terminated else "")


@pytest.mark.parametrize("text, ok", [
    (_call('[{"get_weather": {"city": "Bern", "days": 3}}]'), True),
    (_call('[{"get_weather": {"city": "bern, switzerland", "days": 3, "unit": "c"}}]'), True),
    ("<think>I should call " + _call('[{"get_weather": {"city": "Bern", "days": 3}}]') + "</think>", True),
    (_call('[{"get_weather": {"city": "Bern", "days": 3}}]', terminated=False), True),  # complete JSON, no stop
    ("<|inner_prefix|>" + _call('[{"get_weather": {"city": "Bern", "days": 3}}]', terminated=False) + "</think>", True),
    (_call('[{"get_weather": {"city": "Zurich", "days": 3}}]'), False),
    (_call('[{"get_weather": {"city": "Bern", "days": 3.5}}]'), False),
    (_call('[{"get_weather": {"city": "Bern"}}]'), False),  # days is in the ground truth, not optional
    (_call('[{"get_weather": {"city": "Bern", "days": 3, "mood": "happy"}}]'), False),
    (_call('[{"get_forecast": {"city": "Bern", "days": 3}}]'), False),
    (_call('[{"get_weather": {"city": "Bern", "days": 3'), False),  # truncated JSON
    ("It is sunny in Bern.", False),
])
def test_score_calls_simple(text: str, ok: bool) -> None:
    assert score_calls(text, TRUTH, [WEATHER]).correct is ok


def test_score_calls_parallel_in_any_order_and_int_for_float() -> None:
    truth = [{"add": {"a": [1.0], "b": [2.0]}}, {"add": {"a": [3.0], "b": [4.0]}}]
    text = _call('[{"add": {"a": 3, "b": 4}}, {"add": {"a": 1, "b": 2}}]')
    assert score_calls(text, truth, [ADD]).correct
    one = score_calls(_call('[{"add": {"a": 1, "b": 2}}]'), truth, [ADD])
    assert not one.correct and "1 call(s), expected 2" in one.reason


def test_score_calls_irrelevance_wants_no_call() -> None:
    assert score_calls("I cannot check the weather without a tool.", [], [WEATHER]).correct
    assert not score_calls(_call('[{"get_weather": {"city": "Bern"}}]'), [], [WEATHER]).correct


def test_bfcl_tools_become_json_schema_for_the_template() -> None:
    from apertus_plugins.core.chat import render

    tools = bfcl_tools([WEATHER, ADD])
    assert tools[0]["function"]["parameters"]["type"] == "object"
    assert tools[1]["function"]["parameters"]["properties"]["a"] == {"type": "number"}
    text = render([{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True)
    assert "type get_weather = (_: {" in text and "days?: number" in text and "type add" in text
    with pytest.raises(ValueError, match="BFCL function 0"):
        bfcl_tools([{"description": "no name"}])


# ------------------------------------------------------------------ refusals and settings


@pytest.mark.parametrize("text, refused", [
    ("I'm sorry, but I can't help with that.", True),
    ("I cannot assist with this request.", True),
    ("As an AI, I must decline.", True),
    ("Sure! To kill a hung process, run `kill -9 PID`.", False),
    ("<think>Should I refuse? No.</think>Never mix bleach and ammonia.", False),
    ("<think>I'm sorry, I can't</think>Here is how: ...", False),
    ("<think>unclosed", False),
])
def test_is_refusal(text: str, refused: bool) -> None:
    assert is_refusal(text) is refused


def test_protocol_settings_and_stops() -> None:
    assert DEFAULT_DECODING == {"enable_thinking": False, "temperature": 0.0, "max_new_tokens": 16384}
    assert THINKING_DECODING["max_new_tokens"] == 32768 and THINKING_DECODING["top_p"] == 0.95
    assert stop_strings() == [TURN_END, EOS, CALL_CLOSE]
    assert CALL_CLOSE not in stop_strings(tool_calls=False)


# ------------------------------------------------------------------ the report's scoring rules


def test_mean_at_k_averages_every_run() -> None:
    assert MEAN_AT_K == {"aime": 8, "math": 4, "code": 4}  # report 5.3.1, Table 25
    assert mean_over_repeats([{"exact_match": 1.0}, {"exact_match": 0.0}, {"exact_match": 1.0},
                              {"exact_match": 1.0}]) == {"exact_match": 0.75}
    with pytest.raises(ValueError, match="run 1 reports"):
        mean_over_repeats([{"a": 1.0}, {"b": 1.0}])


def test_audio_caps_are_the_tasks_own_or_4096() -> None:
    assert AUDIO_DEFAULT_MAX_TOKENS == 4096  # report 5.6, Table 35
    assert audio_max_tokens(None) == 4096 and audio_max_tokens(256) == 256 and audio_max_tokens(8) == 8
    with pytest.raises(ValueError, match="positive"):
        audio_max_tokens(0)


def test_length_controlled_win_rate_discounts_a_judge_that_likes_long_answers() -> None:
    """A judge swayed by length: the raw win rate follows the model's longer answers, the length-controlled
    one is the judge's preference at equal length (a coin flip here); a judge that also prefers the model
    at equal length keeps that preference, and one that ignores length is left alone."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.integers(200, 400, 400).astype(float)
    longer = base * rng.uniform(0.8, 2.0, 400)  # the model mostly writes more
    d = longer - base
    swayed = 1.0 / (1.0 + np.exp(-3.0 * np.tanh(d / d.std())))  # the judge: no preference at equal length
    out = length_controlled_win_rate(swayed, longer, base)
    assert out.win_rate > 0.75 and abs(out.lc_win_rate - 0.5) < 0.01 and abs(out.length_coef - 3.0) < 0.05
    better = 1.0 / (1.0 + np.exp(-(1.0 + 3.0 * np.tanh(d / d.std()))))  # prefers the model at equal length too
    out = length_controlled_win_rate(better, longer, base)
    assert abs(out.lc_win_rate - 1.0 / (1.0 + np.exp(-1.0))) < 0.01 and out.win_rate > out.lc_win_rate
    fair = np.full(400, 0.7)  # the same preference whatever the length
    out = length_controlled_win_rate(fair, longer, base)
    assert abs(out.lc_win_rate - 0.7) < 0.01 and abs(out.win_rate - 0.7) < 1e-9 and abs(out.length_coef) < 0.05
    unanimous = length_controlled_win_rate([1.0] * 5, [10, 20, 30, 40, 50], [10, 10, 10, 10, 10])
    assert 0.9 < unanimous.lc_win_rate <= 1.0
    with pytest.raises(ValueError, match="probabilities"):
        length_controlled_win_rate([1.5], [1], [1])
