"""Runs inside the sandbox (its source is prepended to a call case's program): call the solution's function.

The solution's source is executed as a module named ``__solution__`` (so an ``if __name__ == "__main__"``
block does not run), in a namespace that already holds the names LeetCode-style solutions use without
importing them (``List``, ``Optional``, ``collections``, ``heapq``, ...), as APPS's and TACO's testers
provide. The function is the module-level ``fn_name``, else the method of a fresh ``Solution()``. The
arguments are one JSON list on stdin; the result is written to stdout as JSON (tuples as lists), and
anything the solution prints goes to stderr. Standard library only: it runs on the sandbox's interpreter.
"""

import json
import os
import sys

_PRELUDE = (
    "import bisect, collections, copy, functools, heapq, itertools, math, operator, random, re, string, sys\n"
    "from collections import *\nfrom functools import *\nfrom heapq import *\nfrom itertools import *\n"
    "from math import *\nfrom typing import *\n"
)


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=repr)
    raise TypeError(f"the function returned a {type(value).__name__}, which has no JSON form")


def run_call(source, fn_name):
    result_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout = sys.stderr
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    exec(compile(_PRELUDE, "<prelude>", "exec"), namespace)
    exec(compile(source, "solution.py", "exec"), namespace)
    target = namespace.get(fn_name)
    if not callable(target) and callable(namespace.get("Solution")):
        target = getattr(namespace["Solution"](), fn_name, None)
    if not callable(target):
        raise NameError(f"the program defines no function {fn_name!r} (nor a Solution method of that name)")
    args = json.loads(sys.stdin.read() or "[]")
    result = target(*args)
    result_out.write(json.dumps(_jsonable(result)))
    result_out.flush()
