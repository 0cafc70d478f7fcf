"""The synthetic long-context tasks (report section 3.3): answers, masks, buckets, lengths, mix, streaming.

Source documents are built here with known contents (each word's count fixed by construction), so
the answers are checked against the construction, not against the generator's own counting.
"""

from __future__ import annotations

import json
import re
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.cli import main as cli_main
from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.core.longcontext import (
    CWE_FORMATS,
    DOCORDER_FORMATS,
    EASY,
    HARD,
    REPORT_TASK_TOKENS,
    STEPS,
    Example,
    LongContextTasks,
    Skip,
    report_mix,
)
from apertus_plugins.core.targets import sft_mask
from apertus_plugins.data.indexed import IndexedDataset
from apertus_plugins.data.longcontext import write_long_context

T = 4096
WORDS = ["river", "mountain", "forest", "valley", "meadow", "glacier", "harbor", "island", "canyon", "desert",
         "prairie", "lagoon", "tundra", "summit", "plateau", "delta", "marsh", "ridge", "cliff", "grove"]


@pytest.fixture(scope="module")
def chat(apertus_tokenizer_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(apertus_tokenizer_dir)


def make_doc(rng: np.random.Generator, n_words: int) -> tuple[str, dict[str, int]]:
    """A document of ``n_words`` from :data:`WORDS` and filler ("the", digits), with its true counts."""
    counts = rng.multinomial(n_words, np.full(len(WORDS), 1 / len(WORDS)))
    tokens = [w.capitalize() if rng.random() < 0.1 else w for w, c in zip(WORDS, counts, strict=True)
              for _ in range(c)]
    tokens += ["the"] * (n_words // 10) + ["42"] * (n_words // 20)
    rng.shuffle(tokens)
    return " ".join(tokens) + ".", {w: int(c) for w, c in zip(WORDS, counts, strict=True)}


def documents(seed: int, n: int, chat: ChatTokenizer, length: int = T) -> list[tuple[str, str, dict[str, int]]]:
    """``n`` documents alternating between the hard and the easy bucket of ``length``."""
    rng = np.random.default_rng(seed)
    per_word = len(chat.text_ids(make_doc(rng, 400)[0])) / 400
    out = []
    for k in range(n):
        share = rng.uniform(0.3, 0.45) if k % 2 else rng.uniform(0.55, 0.8)
        text, counts = make_doc(rng, int(share * length / per_word))
        out.append((f"doc{k}", text, counts))
    return out


def run(chat: ChatTokenizer, docs: list[tuple[str, str, dict[str, int]]], seed: int = 7, length: int = T,
        mix: dict[str, float] | None = None, **kw: int) -> list[Example | Skip]:
    gen = LongContextTasks(chat, length, mix or report_mix("8b", "32k"), seed)
    return list(gen.run(((name, text) for name, text, _ in docs), **kw))


@pytest.fixture(scope="module")
def corpus(chat: ChatTokenizer) -> list[tuple[str, str, dict[str, int]]]:
    return documents(3, 24, chat)


@pytest.fixture(scope="module")
def examples(chat: ChatTokenizer, corpus: list[tuple[str, str, dict[str, int]]]) -> list[Example]:
    out = run(chat, corpus)
    assert not [s for s in out if isinstance(s, Skip)]
    return [e for e in out if isinstance(e, Example)]


def turns(ex: Example, chat: ChatTokenizer) -> list[tuple[int, int]]:
    """Start and stop of each assistant answer (the text between its start and end markers)."""
    ids = ex.ids.tolist()
    a, e = chat.spec.id("assistant_start"), chat.spec.id("assistant_end")
    starts = [k + 1 for k, t in enumerate(ids) if t == a]
    ends = [k for k, t in enumerate(ids) if t == e]
    return list(zip(starts, ends, strict=True))


def test_report_mix_is_table_f1_f2_and_8() -> None:
    mix = report_mix("8b", "32k")
    assert mix["cwe"] == pytest.approx(2.86 / (2.86 + 1.79 + 0.9501))  # Table F.1: 5.60B SFT tokens at 32k
    assert sum(REPORT_TASK_TOKENS["70b"]["256k"]) == pytest.approx(4.2632e9)  # Table F.2 (Table 5: 4.26B)
    assert report_mix("70b", "sft")["needles"] == pytest.approx(85.3 / (236.8 + 119.4 + 85.3))  # Table 8
    assert STEPS["256k"] == STEPS["sft"] == 2 ** 18 and STEPS["32k"] == 2 ** 15
    with pytest.raises(ValueError, match="step '16k'"):
        report_mix("8b", "16k")
    assert (HARD.cwe_questions, HARD.docorder_sections, EASY.cwe_questions, EASY.docorder_sections) == (10, 8, 5, 4)


def test_deterministic_from_the_seed(chat: ChatTokenizer, corpus: list, examples: list[Example]) -> None:
    again = [e for e in run(chat, corpus) if isinstance(e, Example)]
    assert [e.record() for e in again] == [e.record() for e in examples]
    assert all(np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask) for a, b in zip(again, examples,
                                                                                                strict=True))
    other = [e for e in run(chat, corpus, seed=8) if isinstance(e, Example)]
    assert [e.answers for e in other] != [e.answers for e in examples]


def test_lengths_buckets_and_item_counts(examples: list[Example]) -> None:
    assert {e.task for e in examples} == {"cwe", "docorder", "needles"}
    assert {e.bucket for e in examples if e.task != "needles"} == {"hard", "easy"}
    for e in examples:
        assert T // 4 <= e.ids.size <= T, (e.task, e.ids.size)
        if e.task == "cwe":
            assert len(e.answers) == (10 if e.bucket == "hard" else 5)
        elif e.task == "docorder":
            assert e.facts["sections"] == (8 if e.bucket == "hard" else 4) and len(e.answers) == 1


def test_cwe_counts_are_the_documents(chat: ChatTokenizer, corpus: list, examples: list[Example]) -> None:
    truth = {name: counts for name, _, counts in corpus}
    cwe = [e for e in examples if e.task == "cwe"]
    assert cwe
    for e in cwe:
        counts = truth[e.source]
        assert len(e.facts["counts"]) == len(e.answers)  # distinct words
        for (word, n), answer, question in zip(e.facts["counts"].items(), e.answers, e.questions, strict=True):
            assert n == counts[word]  # capitalized occurrences count too
            assert f'"{word}"' in question
            assert re.findall(r"\d+", answer) == [str(n)]
            assert n >= sorted(counts.values(), reverse=True)[14]  # among the 15 most frequent (ties either way)
    formats = {f(w, 3)[1].replace(w, "W") for f in CWE_FORMATS for w in ["ridge"]}
    assert len(formats) == 10


def test_docorder_answer_restores_the_document(chat: ChatTokenizer, corpus: list, examples: list[Example]) -> None:
    texts = {name: text for name, text, _ in corpus}
    gen = LongContextTasks(chat, T, {"cwe": 1})
    dos = [e for e in examples if e.task == "docorder"]
    assert dos
    for e in dos:
        original = gen.document_ids(texts[e.source], T)
        user = chat.decode(e.ids[:turns(e, chat)[0][0]])
        shown = re.split(r"\[Section (\d+)\]\n", user.split("<|user_start|>", 1)[1].rsplit("\n\n", 1)[0])
        sections = {int(k): body.removesuffix("\n\n") for k, body in zip(shown[1::2], shown[2::2], strict=True)}
        assert sorted(sections) == list(range(1, e.facts["sections"] + 1))
        order = [int(x) for x in re.findall(r"\d+", e.answers[0])]
        assert order == e.facts["order"] and order != sorted(order)
        assert "".join(sections[k] for k in order) == chat.decode(original)
    assert len({q for q, _ in DOCORDER_FORMATS}) == 10


def test_needle_is_unique_and_answered(chat: ChatTokenizer) -> None:
    gen = LongContextTasks(chat, T, {"needles": 1}, seed=5)
    for e in gen.run([], max_examples=6):
        assert isinstance(e, Example) and T // 4 <= e.ids.size <= T
        text = chat.decode(e.ids)
        listings = dict(re.findall(r"\nListing \[(\d+)\] \{([^}]*)\}", text))
        assert len(listings) == e.facts["listings"] > 3
        key, value = e.facts["key"], e.facts["value"]
        holders = [int(n) for n, body in listings.items() if re.search(rf"(^|, ){key}: ", body)]
        assert holders == [e.facts["listing"]]
        assert f"{key}: {value}" in listings[str(e.facts["listing"])]
        assert e.answers == [f"The value of key {key} is {value} and it is in Listing [{e.facts['listing']}]."]


def test_only_the_answers_are_trained(chat: ChatTokenizer, examples: list[Example]) -> None:
    end = chat.spec.id("assistant_end")
    for e in examples:
        spans = turns(e, chat)
        assert len(spans) == len(e.answers)
        trained = np.flatnonzero(e.mask)
        allowed = np.zeros(e.ids.size, bool)
        for a, b in spans:
            allowed[a:b + 1] = True  # the answer and its end-of-turn marker
        assert allowed[trained].all()
        assert e.mask[0] == 0 and np.array_equal(e.mask[1:], sft_mask(e.ids, chat.spec))
        # the trained text is the answers, nothing of the document, the shuffled sections or the listings
        text = [t for t in e.ids[trained].tolist() if t != end]
        assert chat.decode(text) == "".join(e.answers)
        assert e.mask[: spans[0][0]].sum() == 0  # the body and the first question
        assert int(e.mask.sum()) < 0.1 * e.ids.size


def test_mix_followed(examples: list[Example]) -> None:
    tokens = {t: sum(e.ids.size for e in examples if e.task == t) for t in ("cwe", "docorder", "needles")}
    total = sum(tokens.values())
    for task, share in report_mix("8b", "32k").items():
        assert tokens[task] / total == pytest.approx(share, abs=0.05), tokens


def test_bad_documents_skipped_named_counted(chat: ChatTokenizer, tmp_path: Path, corpus: list) -> None:
    src = tmp_path / "docs.jsonl"
    long_text = " ".join(WORDS * 400)
    lines = [json.dumps({"text": corpus[0][1]}), "{not json", json.dumps({"text": ""}), json.dumps({"text": "short"}),
             json.dumps(["a list"]), json.dumps({"body": "x"}), json.dumps({"text": long_text}),
             json.dumps({"text": " ".join(["the"] * 1200)}), json.dumps({"text": corpus[1][1]})]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = write_long_context([src], tmp_path / "out" / "lc", chat, length=T, mix={"cwe": 1}, seed=1)
    assert report["examples"]["cwe"] == 2
    assert report["skipped"] == {"bad-record": 3, "empty": 1, "too-short": 1, "too-long": 1, "too-few-words": 1}
    named = report["skipped_names"]
    assert named["bad-record"][0].startswith(f"{src}:2: not JSON")
    assert named["too-long"][0].startswith(f"{src}:7:") and named["too-few-words"][0].startswith(f"{src}:8:")


def test_cli_writes_indexed_datasets(chat: ChatTokenizer, apertus_tokenizer_dir: Path, tmp_path: Path,
                                     corpus: list, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": text}) + "\n" for _, text, _ in corpus[:8]), encoding="utf-8")
    out = tmp_path / "lc"
    rc = cli_main(["tokenize", "longcontext", str(src), "--out", str(out), "--tokenizer", str(apertus_tokenizer_dir),
                   "--length", str(T), "--text-key", "body", "--seed", "3", "--model", "70b", "--step", "64k"])
    assert rc in (0, None)
    summary = json.loads(capsys.readouterr().out)
    ds, masks = IndexedDataset(out), IndexedDataset(f"{out}.mask")
    records = [json.loads(x) for x in Path(f"{out}.examples.jsonl").read_text().splitlines()]
    assert len(ds) == len(masks) == len(records) == sum(summary["examples"].values()) > 8
    for k, rec in enumerate(records):
        ids, mask = np.asarray(ds[k], np.int64), np.asarray(masks[k])
        assert ids.size == rec["tokens"] and int(mask.sum()) == rec["trained"]
        assert np.array_equal(mask[1:].astype(bool), sft_mask(ids, chat.spec))
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["mix"] == pytest.approx(report_mix("70b", "64k")) and report["describe"]["step"] == "64k"
    assert json.loads(Path(f"{out}.manifest.json").read_text())["datasets"][0]["metadata"]["synthetic"] == "long-context"


def test_streams_documents_and_memory_flat_in_examples(chat: ChatTokenizer, corpus: list) -> None:
    consumed = []

    def lazy() -> Iterator[tuple[str, str]]:
        for name, text, _ in corpus * 4:
            consumed.append(name)
            yield name, text

    gen = LongContextTasks(chat, T, report_mix("8b", "32k"), seed=1)
    stream = gen.run(lazy())
    first = [next(stream) for _ in range(5)]
    assert len(consumed) <= sum(isinstance(e, Skip) or e.task != "needles" for e in first)  # no read-ahead

    def peak(n: int) -> int:
        tracemalloc.start()
        for _ in LongContextTasks(chat, T, report_mix("8b", "32k"), seed=1).run(lazy(), max_examples=n):
            pass
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    small, large = peak(6), peak(40)
    assert large < 1.5 * small + 200_000, (small, large)  # 40 examples held no more than 6


def test_hostile_arguments(chat: ChatTokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such JSONL file"):
        write_long_context([tmp_path / "missing.jsonl"], tmp_path / "o", chat, length=T, mix={"cwe": 1})
    with pytest.raises(ValueError, match="need source documents"):
        write_long_context([], tmp_path / "o", chat, length=T, mix=report_mix("8b", "32k"), max_examples=2)
    with pytest.raises(ValueError, match="needs max_tokens or max_examples"):
        write_long_context([], tmp_path / "o", chat, length=T, mix={"needles": 1})
    for bad in ({"cwe": -1}, {"haystack": 1}, {"cwe": 0}):
        with pytest.raises(ValueError, match="mix"):
            LongContextTasks(chat, T, bad)
    with pytest.raises(ValueError, match="at least 256"):
        LongContextTasks(chat, 100, {"cwe": 1})
    assert not list(tmp_path.glob("o*"))  # nothing half-written
    report = write_long_context([], tmp_path / "n", chat, length=T, mix={"needles": 1}, max_examples=3)
    assert report["examples"] == {"cwe": 0, "docorder": 0, "needles": 3} and report["skipped"] == {}
