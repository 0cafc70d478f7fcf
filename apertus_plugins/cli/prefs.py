"""``apertus prefs POOL OUT``: offline DPO pairs from a response pool scored by a served judge."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from apertus_plugins.posttrain.prefs import ASPECTS

    p = sub.add_parser(
        "prefs", help="score a response pool with a judge and build MaxMin preference pairs for offline DPO",
        description="Rate every response of POOL on the report's four aspects (truthfulness, helpfulness, honesty, "
                    "instruction following; one request per aspect, one digit 1-5, the expected value of the "
                    "judge's distribution over the digits), average them, and write OUT/pairs.jsonl: per prompt "
                    "the best response as chosen and the worst as rejected (what apertus_offline_dpo reads). Every "
                    "judgement is kept in OUT/judgements.jsonl as it arrives: run the same command again after an "
                    "interruption and only the missing ones are requested. OUT/summary.json counts everything.")
    p.add_argument("pool", help="JSON lines {id, prompt, responses: [text or {model, response}]}, a dataset saved "
                                "with datasets' save_to_disk, or a Hub dataset id (read from the cache)")
    p.add_argument("out", help="output folder (created; reused to resume)")
    p.add_argument("--judge-url", required=True, help="the judge's OpenAI-compatible API root, e.g. "
                                                      "http://127.0.0.1:8000/v1")
    p.add_argument("--judge-model", required=True, help="the served model name of the judge")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--aspects", default=",".join(ASPECTS),
                   help=f"comma-separated aspects to average (default: all of {','.join(ASPECTS)})")
    p.add_argument("--concurrency", type=int, default=8, help="requests to the judge at once (default 8)")
    p.add_argument("--top-logprobs", type=int, default=20,
                   help="alternatives asked for the rating token; the digits 1-5 must be among them (default 20)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    p.add_argument("--max-retries", type=int, default=3, help="retries per request (default 3)")
    p.add_argument("--judge-extra-body", default='{"chat_template_kwargs": {"enable_thinking": false}}',
                   help="JSON merged into every request (default: thinking off, as the report annotates)")
    p.add_argument("--min-margin", type=float, default=0.0,
                   help="no pair when the best and worst scores differ by no more than this (default 0: ties)")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--responses-field", default="responses")
    p.add_argument("--id-field", default="id")
    p.add_argument("--split", default="train", help="split of a dataset pool (default train)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.posttrain.judges import JudgeError, OpenAIJudge
    from apertus_plugins.posttrain.prefs import ASPECTS, SYSTEM_PROMPT, build_preference_pairs, read_pool

    try:
        extra = json.loads(args.judge_extra_body) if args.judge_extra_body else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--judge-extra-body is not JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise ValueError("--judge-extra-body must be a JSON object")
    aspects = [a.strip() for a in args.aspects.split(",") if a.strip()]
    items = read_pool(args.pool, prompt_field=args.prompt_field, responses_field=args.responses_field,
                      id_field=args.id_field, split=args.split, limit=args.limit)
    unknown = [a for a in aspects if a not in ASPECTS]
    if unknown:
        raise ValueError(f"unknown aspects {unknown}; known: {', '.join(ASPECTS)}")
    try:
        # the aspect prompts are filled in by build_preference_pairs; the judge's own templates go unused
        judge = OpenAIJudge(base_url=args.judge_url, model=args.judge_model, system_prompt=SYSTEM_PROMPT,
                            rating_template=ASPECTS[aspects[0]], feedback_template=ASPECTS[aspects[0]],
                            scale=(1, 5), top_logprobs=args.top_logprobs, timeout=args.timeout,
                            max_retries=args.max_retries, api_key=args.api_key, max_workers=args.concurrency,
                            extra_body=extra)
        judge.check()
        summary = build_preference_pairs(items, judge, args.out, aspects=aspects, concurrency=args.concurrency,
                                         min_margin=args.min_margin, progress=not args.no_progress)
    except JudgeError as exc:
        raise ValueError(f"{exc} (what was judged is kept in {args.out}/judgements.jsonl: run again to "
                         "resume)") from exc
    print(f"{summary.pairs} pairs from {summary.prompts} prompts -> {args.out}/pairs.jsonl "
          f"({summary.judgements_made} judgements made, {summary.judgements_reused} reused, "
          f"{summary.judgements_failed} failed; {summary.prompts_tied} prompts tied, "
          f"{summary.prompts_too_few_scored} with fewer than two scored responses)")
    if summary.judgements_failed:
        print(f"apertus prefs: {summary.judgements_failed} judgements failed (see the error lines in "
              f"{args.out}/judgements.jsonl); run the command again to retry them", file=sys.stderr)
        return 3
    return 0
