#!/usr/bin/env python3
"""Generate chat rendering vectors: seeded conversations rendered by a reference chat template.

    python3 tools/dev.py run core python tools/chat_vectors.py --oracle CANONICAL.jinja \\
        --out tests/core/data/chat_canonical.json [--seed 15] [--count 360]

The conversations are generated here (every message shape of the Apertus 1.5 format: string and
``parts`` contents with every part type, system messages, tools with nested objects, arrays of
objects and of arrays, unions, ``oneOf``, enums, nullable types, defaults of every JSON type and
multi-line descriptions, assistant messages as strings, with tool calls and in blocks form in
every order, parallel calls and outputs, ``reasoning_content``, thinking on and off, generation
prompts and continued assistant messages, and inputs the format rejects). Each is rendered by the
template given with ``--oracle`` through ``transformers``' own ``apply_chat_template``; the file
records the inputs and what the oracle gave: the rendered string, or that it raised. The oracle is
read from outside the repository and never copied into it; only its renders are kept.

Training-variant vectors are the oracle's render with the default system block replaced by an
empty one (the released template has one variant; the training variant differs only there).

The generated text holds no structure literal, so ``tokenizer.encode(rendered)`` is also the
injection-safe encoding (the core suite checks both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from apertus_plugins.plugins import registry  # noqa: E402
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer  # noqa: E402

DEFAULT_SYSTEM = ("<|system_start|>You are Apertus 1.5 Omni, a multimodal assistant developed by the Swiss AI "
                  "Initiative. Extended from Apertus 1 via continued pretraining, you understand images and "
                  "audio and respond in text.<|system_end|>")
EMPTY_SYSTEM = "<|system_start|><|system_end|>"

WORDS = ("the", "weather", "in", "Bern", "is", "cold", "Zürich", "naïve", "café", "3.5", "42", "x", "über",
         "日本語", "emoji 🙂", "tab\there", "quote \"q\"", "back\\slash", "{json: 1}", "a, b", "[1, 2]", "%d",
         "line\nbreak", "  spaced  ", "semi;colon", "C++", "α-β", "UPPER", "under_score", "$5", "#tag")
#: The part types of the built-in modalities (those the released template renders)
IMAGE_PARTS = registry().modalities["image"].part_types
AUDIO_PARTS = registry().modalities["audio"].part_types
NAMES = ("get_weather", "search", "lookup_user", "run_code", "calc", "translate", "send_mail", "list_files")
PARAMS = ("city", "query", "limit", "unit", "tags", "options", "mode", "user_id", "verbose", "items", "filter",
          "date", "coords", "values", "payload")


class Gen:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def pick(self, seq):
        return self.r.choice(seq)

    def text(self, lo: int = 1, hi: int = 6) -> str:
        n = self.r.randint(lo, hi)
        return " ".join(self.pick(WORDS) for _ in range(n))

    def maybe(self, p: float = 0.5) -> bool:
        return self.r.random() < p

    # ------------------------------------------------------------------ JSON schemas
    def json_value(self, depth: int = 0) -> Any:
        kind = self.pick(("str", "int", "float", "bool", "null", "list", "dict") if depth < 2 else
                         ("str", "int", "float", "bool", "null"))
        if kind == "str":
            return self.text(1, 2)
        if kind == "int":
            return self.r.randint(-5, 100)
        if kind == "float":
            return round(self.r.uniform(-3, 3), 2)
        if kind == "bool":
            return self.maybe()
        if kind == "null":
            return None
        if kind == "list":
            return [self.json_value(depth + 1) for _ in range(self.r.randint(0, 3))]
        return {self.pick(PARAMS): self.json_value(depth + 1) for _ in range(self.r.randint(0, 2))}

    def schema(self, depth: int = 0) -> dict[str, Any]:
        kinds = ["string", "enum", "number", "integer", "boolean", "untyped", "null", "unknown", "union"]
        if depth < 3:
            kinds += ["array", "array", "object", "object", "oneOf", "object_empty"]
        kind = self.pick(kinds)
        s: dict[str, Any]
        if kind == "enum":
            s = {"type": "string", "enum": [self.pick(("a", "b", "celsius", "fahrenheit", "on", "off", "x y"))
                                            for _ in range(self.r.randint(1, 3))]}
        elif kind in ("string", "number", "integer", "boolean"):
            s = {"type": kind}
        elif kind == "untyped":
            s = {}
        elif kind == "null":
            s = {"type": "null"}
        elif kind == "unknown":
            s = {"type": self.pick(("file", "any", "date"))}
        elif kind == "union":
            s = {"type": self.r.sample(["string", "number", "integer", "boolean", "null", "object", "array"],
                                       self.r.randint(1, 3))}
            if self.maybe(0.15):
                s = {"type": ["object", "object"]}
        elif kind == "array":
            s = {"type": "array"}
            if self.maybe(0.85):
                s["items"] = self.schema(depth + 1)
        elif kind == "object":
            props = {}
            for _ in range(self.r.randint(1, 3)):
                props[self.pick(PARAMS)] = self.schema(depth + 1)
            s = {"type": "object", "properties": props}
            if self.maybe(0.7):
                s["required"] = self.r.sample(sorted(props), self.r.randint(0, len(props)))
        elif kind == "object_empty":
            s = {"type": "object"} if self.maybe() else {"type": "object", "properties": {}}
        else:  # oneOf
            alts = []
            for _ in range(self.r.randint(1, 3)):
                a = self.schema(depth + 1)
                if self.maybe(0.3):
                    a["description"] = self.text(1, 3)
                if self.maybe(0.25):
                    a["default"] = self.json_value(1)
                alts.append(a)
            s = {"oneOf": alts}
        if self.maybe(0.15):
            s["nullable"] = True
        return s

    def parameter(self) -> dict[str, Any]:
        s = self.schema()
        if self.maybe(0.4):
            s["description"] = self.text(1, 5) + ("\nsecond line" if self.maybe(0.3) else "")
        if self.maybe(0.35):
            if s.get("enum") or s.get("oneOf"):
                s["default"] = self.text(1, 1)  # the released template needs a string there
            else:
                s["default"] = self.json_value()
        return s

    def tool(self) -> dict[str, Any]:
        name = self.pick(NAMES) + ("" if self.maybe(0.7) else f"_{self.r.randint(1, 9)}")
        fn: dict[str, Any] = {"name": name, "description": self.text(2, 8) + ("\nMore detail." if self.maybe(0.2) else "")}
        shape = self.r.random()
        if shape < 0.1:
            pass  # no parameters at all
        elif shape < 0.18:
            fn["parameters"] = self.pick(({}, {"type": "object"}, {"type": "object", "properties": {}}))
        else:
            props = {}
            for _ in range(self.r.randint(1, 4)):
                props[self.pick(PARAMS)] = self.parameter()
            fn["parameters"] = {"type": "object", "properties": props}
            if self.maybe(0.8):
                fn["parameters"]["required"] = self.r.sample(sorted(props), self.r.randint(0, len(props)))
        return {"type": "function", "function": fn} if self.maybe(0.75) else fn

    # ------------------------------------------------------------------ messages
    def args(self) -> str:
        return json.dumps({self.pick(PARAMS): self.json_value(1) for _ in range(self.r.randint(0, 3))},
                          ensure_ascii=self.maybe(0.2))

    def call(self, openai: bool) -> dict[str, Any]:
        name = self.pick(NAMES)
        if openai:
            return {"type": "function", "function": {"name": name, "arguments": self.args()}}
        return {"name": name, "arguments": self.args()}

    def user(self) -> dict[str, Any]:
        if self.maybe(0.55):
            return {"role": "user", "content": self.text(1, 10)}
        parts = []
        for _ in range(self.r.randint(1, 5)):
            k = self.r.random()
            if k < 0.5:
                parts.append({"type": "text", "text": self.text(1, 4)})
            elif k < 0.75:
                parts.append({"type": self.pick(IMAGE_PARTS)})
            else:
                parts.append({"type": self.pick(AUDIO_PARTS)})
        return {"role": "user", "content": {"parts": parts}}

    def blocks(self) -> dict[str, Any]:
        kinds = ["thoughts", "response", "tool_calls", "tool_outputs"]
        seq = [self.pick(kinds) for _ in range(self.r.randint(1, 6))]
        if self.maybe(0.25):
            seq = self.r.sample(kinds, 4)  # every block type once, in a random order
        out = []
        for k in seq:
            if k in ("thoughts", "response"):
                out.append({"type": k, "text": self.text(1, 6)})
            elif k == "tool_calls":
                n = self.r.randint(1, 3)
                calls = [self.call(openai=self.maybe(0.2)) for _ in range(n)]
                if n == 1 and self.maybe(0.35):
                    calls = [{"name": "display_answers", "arguments": json.dumps({"answers": [self.text(1, 2)]})}]
                out.append({"type": "tool_calls", "calls": calls})
            else:
                out.append({"type": "tool_outputs",
                            "outputs": [{"output": self.text(1, 4)} for _ in range(self.r.randint(1, 3))]})
        return {"role": "assistant", "content": {"blocks": out}}

    def assistant_string(self) -> list[dict[str, Any]]:
        m: dict[str, Any] = {"role": "assistant", "content": self.text(0, 8) if self.maybe(0.8) else ""}
        if self.maybe(0.2):
            m["reasoning_content"] = self.text(2, 6)
        out = [m]
        if self.maybe(0.45):
            m["tool_calls"] = [self.call(openai=self.maybe(0.85)) for _ in range(self.r.randint(1, 3))]
            if self.maybe(0.8):
                out += [{"role": "tool", "content": self.text(1, 5)} for _ in range(self.r.randint(1, 3))]
                if self.maybe(0.6):
                    out.append({"role": "assistant", "content": self.text(1, 6)})
        return out

    def conversation(self) -> dict[str, Any]:
        msgs: list[dict[str, Any]] = []
        if self.maybe(0.35):
            msgs.append({"role": "system", "content": self.text(2, 8) if self.maybe(0.8) else {"text": self.text(2, 5)}})
        blocks_form = self.maybe(0.4)
        for _ in range(self.r.randint(1, 3)):
            msgs.append(self.user())
            if self.maybe(0.85):
                if blocks_form:
                    msgs.append(self.blocks())
                    if self.maybe(0.2):
                        msgs.append({"role": "tool", "content": self.text(1, 3)})
                else:
                    msgs += self.assistant_string()
        if msgs and msgs[-1]["role"] == "assistant" and self.maybe(0.3):
            msgs.pop()
        if self.maybe(0.15) and msgs[-1]["role"] != "user":
            msgs.append(self.user())
        inp: dict[str, Any] = {"messages": msgs}
        if self.maybe(0.45):
            inp["tools"] = [self.tool() for _ in range(self.r.randint(1, 3))]
        if self.maybe(0.5):
            inp["add_generation_prompt"] = True
        if self.maybe(0.4):
            inp["enable_thinking"] = self.maybe()
        if msgs[-1]["role"] == "assistant" and self.maybe(0.3):
            inp["continue_assistant_message"] = True
        return inp


#: Inputs the format rejects, each with the reason it is rejected (the oracle must raise on them).
def rejected() -> list[tuple[str, dict[str, Any]]]:
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"], "default": 3}}}}}
    return [
        ("unknown_role", {"messages": [{"role": "critic", "content": "x"}]}),
        ("developer_role", {"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]}),
        ("late_system", {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}),
        ("system_without_content", {"messages": [{"role": "system"}, {"role": "user", "content": "y"}]}),
        ("system_list_content", {"messages": [{"role": "system", "content": [1, 2]}, {"role": "user", "content": "y"}]}),
        ("tool_first", {"messages": [{"role": "tool", "content": "x"}]}),
        ("tool_after_user", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}),
        ("unknown_part", {"messages": [{"role": "user", "content": {"parts": [{"type": "video"}]}}]}),
        ("user_content_none", {"messages": [{"role": "user", "content": None}]}),
        ("assistant_without_content", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}),
        ("assistant_content_none", {"messages": [{"role": "user", "content": "x"},
                                                 {"role": "assistant", "content": None}]}),
        ("unknown_block", {"messages": [{"role": "user", "content": "x"},
                                        {"role": "assistant", "content": {"blocks": [{"type": "image"}]}}]}),
        ("mixed_forms", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "y"},
                                      {"role": "assistant", "content": {"blocks": [{"type": "response", "text": "b"}]}}]}),
        ("outputs_after_tool_messages", {"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": {"blocks": [{"type": "tool_calls", "calls": [{"name": "f", "arguments": "{}"}]}]}},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": {"blocks": [{"type": "tool_outputs", "outputs": [{"output": "o"}]}]}}]}),
        ("call_without_arguments", {"messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ""}}]}]}),
        ("call_of_unknown_type", {"messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": "", "tool_calls": [{"type": "retrieval", "function": {"name": "f", "arguments": "{}"}}]}]}),
        ("tool_without_description", {"messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("enum_default_not_a_string", {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}),
    ]


def oracle_tokenizer(template: str, workdir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_test_tokenizer(workdir / "tok"))
    tok.chat_template = template
    return tok


def render(tok: Any, inp: dict[str, Any]) -> str:
    kwargs = {k: v for k, v in inp.items() if k != "messages"}
    return tok.apply_chat_template(inp["messages"], tokenize=False, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle", required=True, type=Path, help="the reference chat template (a .jinja file)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--count", type=int, default=360, help="generated conversations (rejected inputs come on top)")
    ap.add_argument("--training-every", type=int, default=5, help="every Nth vector is a training-variant vector")
    a = ap.parse_args(argv)

    source = a.oracle.read_text(encoding="utf-8")
    gen = Gen(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tok = oracle_tokenizer(source, Path(tmp))
        vectors: list[dict[str, Any]] = []
        attempts = 0
        while len(vectors) < a.count:
            attempts += 1
            inp = gen.conversation()
            try:
                rendered = render(tok, inp)
            except Exception as exc:  # noqa: BLE001 - a generated input the oracle rejects is not kept
                raise SystemExit(f"the oracle rejected generated conversation {attempts}: {exc}\n"
                                 f"{json.dumps(inp)}") from exc
            vec: dict[str, Any] = {"name": f"gen_{len(vectors):04d}", "input": inp}
            if len(vectors) % a.training_every == a.training_every - 1:
                vec["variant"] = "training"
                if inp["messages"][0]["role"] != "system":
                    assert rendered.count(DEFAULT_SYSTEM) == 1
                    rendered = rendered.replace(DEFAULT_SYSTEM, EMPTY_SYSTEM, 1)
            vec["rendered"] = rendered
            vectors.append(vec)
        for name, inp in rejected():
            try:
                got = render(tok, inp)
            except Exception as exc:  # noqa: BLE001 - that the oracle raises is the point
                vectors.append({"name": f"rejected_{name}", "input": inp, "raises": f"{type(exc).__name__}: {exc}"})
            else:
                raise SystemExit(f"the oracle accepted the rejected input {name!r}: {got!r}")
    doc = {
        "about": "Apertus 1.5 chat renders of the released chat template, generated by tools/chat_vectors.py",
        "oracle_md5": hashlib.md5(source.encode()).hexdigest(),
        "seed": a.seed,
        "count": len(vectors),
        "vectors": vectors,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = a.out.with_suffix(".tmp")
    head = json.dumps({k: v for k, v in doc.items() if k != "vectors"}, ensure_ascii=False)[:-1]
    body = ",\n".join(json.dumps(v, ensure_ascii=False) for v in vectors)
    tmp_out.write_text(f'{head}, "vectors": [\n{body}\n]}}\n', encoding="utf-8")
    tmp_out.replace(a.out)
    print(f"wrote {len(vectors)} vectors to {a.out} (seed {a.seed}, oracle md5 {doc['oracle_md5']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
