"""The doctor's results: one line of evidence per check, as a table or as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PASS", "WARN", "FAIL", "STATUSES", "Result", "Report"]

PASS, WARN, FAIL = "pass", "warn", "fail"
STATUSES = (PASS, WARN, FAIL)


@dataclass
class Result:
    """The outcome of one check: its id, group, status, one line of evidence and optional details."""

    id: str
    group: str
    title: str
    status: str
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Report:
    """All results of one doctor run."""

    checkpoint: str
    results: list[Result]
    compare: str | None = None
    serve: str | None = None
    datasets: list[str] = field(default_factory=list)
    layout: str = ""

    def by_id(self) -> dict[str, Result]:
        return {r.id: r for r in self.results}

    def ids(self, status: str) -> set[str]:
        """The ids of the checks with ``status``."""
        return {r.id for r in self.results if r.status == status}

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def ok(self, strict: bool = False) -> bool:
        """No failure (and, with ``strict``, no warning)."""
        bad = {FAIL, WARN} if strict else {FAIL}
        return not any(r.status in bad for r in self.results)

    def exit_code(self, strict: bool = False) -> int:
        return 0 if self.ok(strict) else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "layout": self.layout,
            "compare": self.compare,
            "serve": self.serve,
            "datasets": list(self.datasets),
            "summary": self.counts(),
            "ok": self.ok(),
            "checks": [asdict(r) for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def table(self) -> str:
        """A plain-text table: status, check id, evidence; then the counts."""
        width = max([len(r.id) for r in self.results] + [5])
        lines = [f"apertus doctor {self.checkpoint}" + (f" ({self.layout})" if self.layout else "")]
        if self.compare:
            lines.append(f"  compared with {self.compare}")
        if self.serve:
            lines.append(f"  served at {self.serve}")
        lines.append("")
        lines.append(f"{'STATUS':6s}  {'CHECK':{width}s}  EVIDENCE")
        for r in self.results:
            lines.append(f"{r.status.upper():6s}  {r.id:{width}s}  {r.evidence}")
        c = self.counts()
        lines.append("")
        lines.append(f"{len(self.results)} checks: {c[PASS]} pass, {c[WARN]} warn, {c[FAIL]} fail")
        return "\n".join(lines)
