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


@pytest.mark.parametrize(
    "environ, plain",
    [
        ({"LANG": "C", "LC_CTYPE": "C.UTF-8"}, True),  # LANG=C, as Python coerced it (PEP 538)
        ({"LC_CTYPE": "C.UTF-8"}, True),  # no locale at all, coerced
        ({"LC_ALL": "C", "LANG": "en_US.UTF-8"}, True),
        ({"LANG": "POSIX", "LC_CTYPE": "C.UTF-8"}, True),
        ({"LANG": "C.UTF-8"}, False),
        ({"LANG": "en_US.UTF-8", "LC_CTYPE": "C.UTF-8"}, False),
        ({"LC_ALL": "de_DE.UTF-8", "LANG": "C"}, False),
    ],
)
def test_a_c_locale_is_seen_through_pythons_coercion(environ, plain):
    assert cli.plain_locale(environ) is plain


def test_a_terminal_under_the_c_locale_gets_ascii_a_pipe_keeps_utf8(monkeypatch):
    import io

    class Stream(io.TextIOWrapper):
        def __init__(self, tty: bool):
            super().__init__(io.BytesIO(), encoding="utf-8")
            self.tty = tty

        def isatty(self):
            return self.tty

    monkeypatch.setattr(cli, "plain_locale", lambda environ=None: True)
    tty, pipe = Stream(True), Stream(False)
    monkeypatch.setattr(cli.sys, "stdout", tty)
    monkeypatch.setattr(cli.sys, "stderr", pipe)
    cli.plain_output()
    for stream in (tty, pipe):
        stream.write("1.2 × LoRA, 3 µs ± 1")
        stream.flush()
    assert tty.buffer.getvalue() == b"1.2 x LoRA, 3 us +/- 1"
    assert pipe.buffer.getvalue() == "1.2 × LoRA, 3 µs ± 1".encode()
