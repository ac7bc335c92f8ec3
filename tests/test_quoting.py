"""User text in an error message (a name, a path, a value, argparse's own "unrecognized arguments") reaches the
terminal as one printable line: escape sequences and newlines are shown escaped (commands.printable, through which
cli.main prints every error)."""

from __future__ import annotations

import pytest

from qlbench import cli, commands

ESC = "\x1b]0;owned\x07\x1b[2J"  # a window title and a clear screen
NL = "two\nlines\u2028"

CASES = [
    ["run", "--function", f"dropwave{ESC}"],
    ["sweep", "--functions", f"levy,{NL}"],
    ["run", "--function", "levy", "--methods", f"lora,{ESC}"],
    ["report", f"/nonexistent/{NL}/{ESC}"],
    ["report", "docs/results/zoo/per-seed.csv.gz", "--format", f"md{ESC}"],
    ["bench", "--only", f"plain,{ESC}"],
    ["run", "--function", "levy", "--hp", f"r{ESC}=4", "--hp", f"r{ESC}=8"],
    ["functions", f"--bogus{ESC}"],
    ["compare", f"/nonexistent/{ESC}"],
]


def error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: a[0] + ":" + a[-2].lstrip("-"))
def test_user_text_in_an_error_is_one_printable_line(argv, capsys):
    line = error_line(capsys, argv)
    assert line.isprintable(), repr(line)
    assert "\\x1b" in line or "\\n" in line, line  # the text is shown, escaped, not dropped


def test_a_planted_identity_quoting_fails_the_check(capsys, monkeypatch):
    monkeypatch.setattr(cli, "printable", lambda message: message)  # planted: user text printed raw
    raw = []
    for argv in CASES:
        assert cli.main(argv) == 2
        raw.append(not capsys.readouterr().err.strip().isprintable())
    assert sum(raw) >= 4, raw  # the messages that join user text with str() (those that use repr() are safe anyway)


def test_printable_keeps_what_a_terminal_shows_and_escapes_the_rest():
    assert commands.printable("× µ é ok") == "× µ é ok"
    assert commands.printable("a\x1b[2Jb\nc\td\x9b\u2028") == "a\\x1b[2Jb\\nc\\td\\x9b\\u2028"
    assert commands.printable("bad \udcff byte") == "bad \\udcff byte"


def test_a_repeated_hp_key_is_refused_not_the_last_kept(capsys):
    line = error_line(capsys, ["run", "--function", "levy", "--hp", "r=4", "--hp", "r=8", "--budget", "smoke"])
    assert line == "qlbench run: error: --hp r is given twice; give each key once"
