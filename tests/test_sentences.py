"""The manuals' sentences hold: a paragraph of README.md or docs/*.md that links a results table under docs/results
quotes only numbers that table holds, and a method it says beats, ties or loses to another has that outcome in the
table's result column.

qlbench interpretation of "a sentence that cites a table": every sentence of a paragraph (the lines between blank
lines, headings, tables and code fences) with a Markdown link to a `.md` file under docs/results cites the paragraph's
linked tables together. A quoted number is a decimal (0.487, 4.6e-5, 2.2); whole numbers (seeds, epochs, ranks) and
bare powers of ten (1e-10, a tolerance) are settings and are not looked up. A number is held when some number of the
tables, rounded to the quoted number's significant digits, equals it (0.059 quotes 0.0593). A comparison is a verb
(beats / wins, ties, loses) and the table rows named before it in its clause (since the previous verb; a name in its
possessive, "instruct-queryable's size", is not a subject; "never beats" is not a claim); each named row must have that
outcome (win / tie / loss) in one of its cells.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANUALS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*/README.md"))]
MANUALS += [ROOT / "docs" / "results" / "README.md"]
RESULTS = ROOT / "docs" / "results"

LINK = re.compile(r"\]\(([^)#\s]*results/[^)#\s]+\.md)(?:#[^)]*)?\)")
QUOTED = re.compile(r"(?<![\w.\-/])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.]|\.\d)")
SETTING = re.compile(r"1e[-+]?\d+")  # a bare power of ten: a tolerance or epsilon, not a measurement
IN_TABLE = re.compile(r"(?<![\w.])-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?")
CLAUSE = re.compile(r"(?<=[.;:])\s+|,\s+(?:and|but)\s+|\s+but\s+")
VERBS = {
    "win": re.compile(r"\b(?:beats?|beating|wins?)\b"),
    "tie": re.compile(r"\b(?:ties?|tying)\b"),
    "loss": re.compile(r"\b(?:loses?|losing)\b"),
}
NEGATED = re.compile(r"\b(?:never|not|no|nor)\s+(?:\w+\s+)?$")
OUTCOME = re.compile(r"\b(win|tie|loss)\b")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, the paragraph's lines joined) of every prose paragraph."""
    out, lines, start, fenced = [], [], 0, False
    for i, line in enumerate(text.splitlines(), 1):
        fenced ^= line.startswith("```")
        if fenced or not line.strip() or line.startswith(("|", "#", "<!--", "```")):
            if lines:
                out.append((start, " ".join(lines)))
            lines = []
            continue
        start = start if lines else i
        lines.append(line)
    if lines:
        out.append((start, " ".join(lines)))
    return out


def cited_tables(manual: Path, paragraph: str) -> list[Path]:
    paths = [(manual.parent / link).resolve() for link in LINK.findall(paragraph)]
    return [p for p in paths if p.is_file() and p.is_relative_to(RESULTS)]


def significant(quoted: str) -> int:
    digits = quoted.split("e")[0].replace(".", "").lstrip("0")
    return max(1, len(digits))


def held(quoted: str, values: set[float]) -> bool:
    """Some table value, rounded to the quoted number's significant digits, is the quoted number (sign aside)."""
    x, digits = float(quoted), significant(quoted)
    return any(math.isclose(float(f"{abs(v):.{digits}g}"), x, rel_tol=1e-9) for v in values if v)


def table_values(paths: list[Path]) -> set[float]:
    return {float(t.replace(",", "")) for p in paths for t in IN_TABLE.findall(p.read_text()) if t not in ("-", ",")}


def unheld(paragraph: str, paths: list[Path]) -> list[str]:
    """The decimals the paragraph quotes that none of its tables holds."""
    values = table_values(paths)
    return [q for q in QUOTED.findall(paragraph) if not SETTING.fullmatch(q) and not held(q, values)]


def outcomes(paths: list[Path]) -> dict[str, set[str]]:
    """Row name (first cell, backticks and bold stripped) -> the outcomes (win / tie / loss) its cells hold."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("|"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if found := set(OUTCOME.findall(" ".join(cells[1:]))):
                    out.setdefault(cells[0].strip("`* "), set()).update(found)
    return out


def claims(paragraph: str, rows: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(row, outcome) for every comparison the paragraph makes of a row its tables test."""
    out = []
    for clause in CLAUSE.split(paragraph):
        verbs = sorted((m.start(), m.end(), kind) for kind, rx in VERBS.items() for m in rx.finditer(clause))
        previous = 0
        for start, end, kind in verbs:
            subject, previous = clause[previous:start], end
            if NEGATED.search(subject):
                continue
            for row in rows:
                if re.search(rf"(?<![\w-]){re.escape(row)}(?![\w-]|'s)", subject, re.IGNORECASE):
                    out.append((row, kind))
    return out


def wrong_claims(paragraph: str, paths: list[Path]) -> list[str]:
    rows, said = outcomes(paths), {"win": "beats", "tie": "ties", "loss": "loses"}
    return [
        f"{row} {said[kind]} (table: {sorted(rows[row])})"
        for row, kind in claims(paragraph, rows)
        if kind not in rows[row]
    ]


def cited_paragraphs():
    for manual in MANUALS:
        for line, paragraph in paragraphs(manual.read_text()):
            if paths := cited_tables(manual, paragraph):
                yield manual, line, paragraph, paths


def test_the_manuals_cite_results_tables():
    """The check below has something to check: the cited paragraphs, their quoted numbers and their comparisons."""
    found = list(cited_paragraphs())
    assert len(found) >= 10
    assert sum(len(QUOTED.findall(p)) for _, _, p, _ in found) >= 50
    assert sum(len(claims(p, outcomes(paths))) for _, _, p, paths in found) >= 10


def problems(manual: Path, check) -> list[str]:
    """`check(paragraph, tables)` (a list of what is wrong) over every paragraph of `manual` that cites a table."""
    cited = lambda paths: ", ".join(p.relative_to(RESULTS).as_posix() for p in paths)
    return [
        f"{manual.relative_to(ROOT)}:{line}: {'; '.join(wrong)} ({cited(paths)})"
        for m, line, paragraph, paths in cited_paragraphs()
        if m == manual and (wrong := check(paragraph, paths))
    ]


@pytest.mark.parametrize("manual", MANUALS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_number_a_sentence_quotes_is_in_the_table_it_cites(manual):
    assert problems(manual, unheld) == []


@pytest.mark.parametrize("manual", MANUALS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_comparison_a_sentence_names_agrees_with_the_table(manual):
    assert problems(manual, wrong_claims) == []


TABLE = """| method | MSE | vs LoRA |
|---|---|---|
| lora | 0.0383 ± 0.018 | - |
| `queryable` | 0.0447 ± 0.033 | tie (p 0.561, Holm 0.561) |
| lora-prompt | 0.347 ± 0.11 | win (p 1.5e-05, Holm 4.6e-05) |
"""


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "results.md"
    path.write_text(TABLE)
    return [path]


def test_a_rounded_quote_is_held_and_a_wrong_digit_is_not(table):
    assert unheld("LoRA reaches 0.038, lora-prompt 0.347 (Holm p 4.6e-5), to 1e-10.", table) == []
    assert unheld("LoRA reaches 0.039 and lora-prompt 0.347.", table) == ["0.039"]  # planted: one digit off
    assert unheld("lora-prompt 0.35 (p 1.5e-5)", table) == []  # 0.347 to two digits
    assert unheld("lora-prompt 0.34", table) == ["0.34"]  # truncated, not rounded


def test_a_comparison_that_the_table_contradicts_is_caught(table):
    assert wrong_claims("`queryable` ties LoRA (0.045); `lora-prompt` beats it.", table) == []
    assert wrong_claims("`queryable` beats LoRA (0.045).", table) == ["queryable beats (table: ['tie'])"]
    assert wrong_claims("lora-prompt ties LoRA, and queryable ties it too.", table) == [
        "lora-prompt ties (table: ['win'])"
    ]
    assert wrong_claims("LoRA of lora-prompt's size ties it; queryable never beats LoRA.", table) == []


def test_a_planted_wrong_sentence_in_the_readme_fails(tmp_path):
    """The README's real-lm paragraph with `queryable`'s tie turned into a win, and one of its numbers changed."""
    text = (ROOT / "README.md").read_text()
    assert "`queryable` ties it (0.045)" in text
    found = [(line, p, paths) for m, line, p, paths in cited_paragraphs() if "`queryable` ties it (0.045)" in p]
    assert len(found) == 1
    _, paragraph, paths = found[0]
    assert wrong_claims(paragraph, paths) == [] and unheld(paragraph, paths) == []
    planted = paragraph.replace("`queryable` ties it (0.045)", "`queryable` beats it (0.051)")
    assert wrong_claims(planted, paths) == ["queryable beats (table: ['tie'])"]
    assert unheld(planted, paths) == ["0.051"]
