"""Small modules: a library module over MAX_LINES lines says why in its docstring (a paragraph that names its size:
"over 500 lines", "about 500 lines", "longer than 500 lines")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import qlbench

ROOT = Path(qlbench.__file__).parent
MAX_LINES = 500
REASON = re.compile(r"(over|about|longer than) 500 lines:", re.IGNORECASE)


def oversized_without_reason(sources: dict[str, str]) -> list[str]:
    """The modules (path -> text) longer than MAX_LINES whose docstring gives no reason for it."""
    return sorted(
        name
        for name, text in sources.items()
        if len(text.splitlines()) > MAX_LINES and not REASON.search(ast.get_docstring(ast.parse(text)) or "")
    )


def test_every_long_module_says_why():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")}
    assert oversized_without_reason(sources) == []


def test_the_size_check_finds_a_long_module_without_a_reason():
    body = "\n".join(f"x{i} = {i}" for i in range(MAX_LINES + 1))
    sources = {
        "long.py": f'"""A module."""\n{body}',
        "long_ok.py": f'"""A module.\n\nOver 500 lines: a table."""\n{body}',
        "short.py": '"""A module."""\nx = 1\n',
    }
    assert oversized_without_reason(sources) == ["long.py"]
