"""Evidence a reviewer can check: which comparisons are hypotheses (the Holm family), the test across functions
against an independent computation, and the per-seed CSV a committed report is rebuilt from."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from test_stats import make_frame

from qlbench import text
from qlbench.metrics import stats
from qlbench.records import per_seed, results
from qlbench.report import tables, write_report

from helpers import table_differences

# ----------------------------------------------------------------------------------------------------------------
# The Holm family holds the comparisons between trained methods


def test_reference_rows_keep_their_raw_p_but_are_not_in_the_holm_family():
    """target: d = (-0.5, -0.4, -0.7) against LoRA, raw t p = 1 - sqrt(128/135) = 0.0263 (test_stats). frozen and
    mean sit near LoRA (larger p). They are printed, not hypotheses: target is a family of one and a win. Planted bug:
    counting them makes target the smallest p of three, Holm 3 x 0.0263 = 0.079, a tie."""
    lora = [1.0, 2.0, 3.0]
    spec = {
        "target": {
            "lora": lora,
            "queryable": [0.5, 1.6, 2.3],
            "frozen": [1.1, 1.9, 3.2],
            "mean": [0.9, 2.2, 2.9],
        }
    }
    c = stats.compare(make_frame(spec), "best-train").set_index("method")
    raw = 1 - math.sqrt(128 / 135)
    assert c.loc["queryable", "p"] == pytest.approx(raw)
    assert c.loc["queryable", "p_holm"] == pytest.approx(raw)
    assert c.loc["queryable", "outcome"] == "win"
    for ref in ("frozen", "mean"):
        assert c.loc[ref, "p"] > raw and math.isnan(c.loc[ref, "p_holm"]) and c.loc[ref, "outcome"] == "reference"
    assert stats.win_tie_loss(c.reset_index())["method"].tolist() == ["queryable"]  # references: no W/T/L
    # the planted bug, computed: Holm over every row would make target a tie
    everything = stats.holm(c["p"].to_numpy())[list(c.index).index("queryable")]
    assert everything == pytest.approx(3 * raw) and everything > stats.ALPHA


# ----------------------------------------------------------------------------------------------------------------
# Across functions: an independent computation


def ratio_frame(ratios: dict[str, list[float]], base: list[float]) -> pd.DataFrame:
    """LoRA scores `base` per seed on every function; queryable scores base x ratio; frozen 10 x base."""
    spec = {
        f: {"lora": base, "queryable": [b * r for b, r in zip(base, rs)], "frozen": [10 * b for b in base]}
        for f, rs in ratios.items()
    }
    return make_frame(spec)


def test_across_functions_equals_a_plain_computation():
    """Three functions x four seeds. The geometric-mean ratio is exp(mean ln r) over the 12 pairs; p is scipy's
    one-sample t-test of ln r (computed here, not through qlbench's paired_test); frozen is not a hypothesis."""
    ratios = {"f1": [0.5, 0.6, 0.55, 0.7], "f2": [0.9, 0.8, 1.1, 0.95], "f3": [0.4, 0.45, 0.5, 0.42]}
    base = [1.0, 2.0, 0.5, 4.0]
    a = stats.across_functions(ratio_frame(ratios, base), "best-train")
    assert a["method"].tolist() == ["queryable"]
    r = np.log(np.concatenate(list(ratios.values())))
    q = a.iloc[0]
    assert q["functions"] == 3 and q["n"] == 12 and q["n_div"] == 0
    assert q["gm_ratio"] == pytest.approx(math.exp(r.mean()), rel=1e-12)
    assert q["p"] == pytest.approx(sps.ttest_1samp(r, 0.0).pvalue, rel=1e-9)
    assert q["p_holm"] == pytest.approx(q["p"])  # one trained method: a family of one
    assert q["ci_low"] < q["gm_ratio"] < q["ci_high"] < 1 and q["outcome"] == "win"


def test_the_interval_resamples_functions_not_only_seeds():
    """Planted bug: a bootstrap that keeps every function and resamples only seeds gives [1, 1] here, since each
    function's seeds share one ratio (e^-1, 1, e^1): the spread is all between functions. Resampling functions must
    show it (a mean over three draws of {-1, 0, 1} reaches -1 and +1 with probability 1/27 each)."""
    ratios = {"f1": [math.e**-1] * 4, "f2": [1.0] * 4, "f3": [math.e] * 4}
    q = stats.across_functions(ratio_frame(ratios, [1.0, 2.0, 0.5, 4.0]), "best-train").iloc[0]
    assert q["gm_ratio"] == pytest.approx(1.0)
    assert q["ci_low"] == pytest.approx(math.exp(-1)) and q["ci_high"] == pytest.approx(math.e)
    assert q["outcome"] == "tie"


def test_the_bootstrap_equals_a_loop_over_the_same_draws():
    """The vectorised resampling against a plain loop that consumes the generator's draws in the same order, with
    functions of unequal seed counts (one function's draws are limited to its own seeds)."""
    groups = [np.array([0.1, -0.2, 0.3]), np.array([1.0, 2.0]), np.array([-0.5, 0.0, 0.5, 0.25])]
    got = stats.hierarchical_bootstrap(groups, resamples=50, seed=7)
    rng = np.random.default_rng(7)
    f = rng.integers(3, size=(50, 3))
    u = rng.random((50, 3, 4))
    want = []
    for b in range(50):
        values = [groups[f[b, j]][int(u[b, j, k] * len(groups[f[b, j]]))] for j in range(3) for k in range(4)
                  if k < len(groups[f[b, j]])]  # fmt: skip
        want.append(np.mean(values))
    assert got == pytest.approx(np.array(want), rel=1e-12)


def test_a_diverged_seed_makes_the_ratio_inf_and_is_counted():
    """A diverged seed is ln r = +inf: the ratio is inf (never hidden from the mean), p comes from Wilcoxon, and the
    count of diverged seeds is reported."""
    from test_stats import Div

    spec = {
        "f1": {"lora": [1.0, 2.0, 3.0, 4.0], "queryable": [Div(0.1), 1.0, 1.5, 2.0]},
        "f2": {"lora": [1.0, 2.0, 3.0, 4.0], "queryable": [0.5, 1.0, 1.5, 2.0]},
    }
    q = stats.across_functions(make_frame(spec), "best-train").iloc[0]
    assert q["n_div"] == 1 and q["gm_ratio"] == math.inf
    d = np.array([math.inf] + [math.log(0.5)] * 7)
    assert q["p"] == pytest.approx(sps.wilcoxon(d).pvalue)


def test_the_table_prints_the_ratio_its_interval_and_the_holm_p():
    a = stats.across_functions(ratio_frame({"f1": [0.5] * 3, "f2": [0.5] * 3}, [1.0, 2.0, 3.0]), "best-train")
    t = tables.across_table(a).iloc[0]
    assert t["MSE ratio to LoRA [95% CI]"] == "0.500 [0.500, 0.500]" and t["pairs"] == 6
    md = tables.across_markdown(ratio_frame({"f1": [0.5, 0.6, 0.55], "f2": [0.5] * 3}, [1.0, 2.0, 3.0]), "best-train")
    assert md.startswith("#### Across functions vs LoRA") and tables.ACROSS_LEGEND in md
    assert tables.across_markdown(ratio_frame({"f1": [0.5, 0.6, 0.55]}, [1.0, 2.0, 3.0]), "best-train") == ""


# ----------------------------------------------------------------------------------------------------------------
# The per-seed CSV: what a committed report is rebuilt from


def full_frame() -> pd.DataFrame:
    """A `results.load`-shaped frame with every per_seed.COLUMNS column: a diverged seed, a failed cell, an all-digit
    commit (which a careless reader turns into a number)."""
    f = make_frame(
        {
            "f1": {"lora": [1.0, 2.0, 3.0], "queryable": [0.5, 1.5, 2.5], "mean": [4.0, 4.0, 4.0]},
            "f2": {"lora": [1.0, 2.0, 3.0], "queryable": [0.1, 2.0, "failed"]},
        }
    )
    f.loc[(f["function"] == "f2") & (f["method"] == "lora") & (f["seed"] == 1), "status"] = "diverged"
    f["backbone_init"] = "kaiming"
    for c in per_seed.COLUMNS:
        if c not in f:
            f[c] = math.nan
    f["record"] = [f"/somewhere/out/records/deep-narrow/{a}/{b}/quick-0.json" for a, b in zip(f.function, f.method)]
    f["commit"], f["dirty"], f["message"] = "1234567890" * 4, False, None
    f.loc[f["status"] == "diverged", list(results.DIVERGED_INF)] = math.inf
    return f


def test_the_per_seed_csv_round_trips_and_is_byte_stable(tmp_path):
    f = full_frame()
    path = per_seed.write(f, tmp_path / "a" / per_seed.FILE)
    back = per_seed.load(path)
    assert back["commit"].eq("1234567890" * 4).all() and back["record"].iloc[0].startswith("records/")
    key = ["function", "method", "seed"]
    a, b = f.sort_values(key).reset_index(drop=True), back.sort_values(key).reset_index(drop=True)
    for c in ("status", "seed", "method"):
        assert a[c].tolist() == b[c].tolist()
    for c in results.DIVERGED_INF:
        np.testing.assert_array_equal(a[c].to_numpy(float), b[c].to_numpy(float))  # inf and NaN as written
    again = per_seed.write(back, tmp_path / "b" / per_seed.FILE)
    assert path.read_bytes() == again.read_bytes()  # no name or time in the gzip header: a rebuild is identical


def test_a_damaged_per_seed_csv_is_one_line(tmp_path):
    bad = tmp_path / "per-seed.csv"
    bad.write_text("arch,budget\nx,y\n")
    with pytest.raises(results.DamagedFile, match="lacks column"):
        per_seed.load(bad)
    gz = tmp_path / "per-seed.csv.gz"
    gz.write_bytes(b"\x1f\x8b\x08not gzip")
    with pytest.raises(results.DamagedFile, match="does not read"):
        per_seed.load(gz)


def test_a_report_from_the_per_seed_csv_equals_the_report_from_the_frame(tmp_path):
    """Every table of a report, written from a frame and again from the per-seed CSV that report wrote: the same
    bytes (the CSV carries everything the tables read)."""
    f = full_frame()
    write_report(f, None, tmp_path / "one", formats=("md", "csv"), figures=False)
    back = per_seed.load(tmp_path / "one" / per_seed.FILE)
    write_report(back, None, tmp_path / "two", formats=("md", "csv"), figures=False)
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in (tmp_path / "two").rglob("*") if p.is_file()}
    assert one.keys() == two.keys() and len(one) > 5
    assert [k for k in one if one[k] != two[k]] == []


# ----------------------------------------------------------------------------------------------------------------
# The committed reports: rebuilt from their records, every provenance commit in the history

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
COMMITTED = sorted(RESULTS.rglob(per_seed.FILE))


def test_there_are_committed_reports_with_per_seed_records():
    names = {p.parent.relative_to(RESULTS).as_posix() for p in COMMITTED}
    assert {"zoo", "mechanism"} <= names  # README's tables and docs/why.md's come from these


def test_a_rebuilt_table_agrees_to_the_digits_it_states_and_no_further():
    """Two machines' floating-point paths differ in the last bits: a CSV's numbers agree to text.CSV_DIGITS
    significant digits, not to 17. Planted: a number off in its 4th digit, a word changed, a row dropped, and
    Markdown that differs anywhere are all found."""
    committed = "method,p,ratio,outcome\nlora,0.14422424754244628,inf,tie\ndora,,1.5,win\n"
    assert table_differences(committed.replace("628", "625"), committed, ".csv") == []  # 17th digit: agrees
    assert table_differences(committed.replace("0.1442", "0.1443"), committed, ".csv") == [
        "row 0 p: 0.14432424754244628 vs 0.14422424754244628"
    ]
    assert table_differences(committed.replace("win", "tie"), committed, ".csv") == ["row 1 outcome: 'tie' vs 'win'"]
    assert table_differences(committed.replace(",inf,", ",1e308,"), committed, ".csv") != []
    assert table_differences(committed.replace("dora,,", "dora,0.5,"), committed, ".csv") != []  # NaN is not a number
    assert table_differences("\n".join(committed.splitlines()[:2]), committed, ".csv") != []
    assert table_differences("| p |\n| 0.145 |\n", "| p |\n| 0.144 |\n", ".md") == ["text differs"]
    df = pd.DataFrame({"p": [0.14422424754244628, math.inf], "mixed": ["x", 1 / 3]})
    assert text.csv(df) == "p,mixed\n0.1442242475,x\ninf,0.3333333333\n"  # floats in mixed columns rounded too


@pytest.mark.parametrize("csv", COMMITTED, ids=lambda p: p.parent.relative_to(RESULTS).as_posix())
def test_a_committed_report_is_rebuilt_from_its_per_seed_csv(csv, tmp_path):
    """Every table of the report (means, ±, marks, paired statistics, win/tie/loss, the test across functions, costs)
    from the per-seed CSV beside it: the same as committed (Markdown byte for byte, CSV numbers to the digits they
    state: `table_differences`), and no committed table that the CSV does not make."""
    write_report(per_seed.load(csv), None, tmp_path, formats=("md", "csv"), figures=False)
    made = {p.relative_to(tmp_path).as_posix(): p for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(csv.parent).as_posix(): p for p in csv.parent.rglob("*") if p.is_file()}
    assert sorted(committed) == sorted(made)

    def differences(a: Path, b: Path) -> list[str]:
        if a.suffix not in (".md", ".csv", ".tex"):  # the per-seed CSV itself (gzip), written from the same rows
            return [] if a.read_bytes() == b.read_bytes() else ["bytes differ"]
        return table_differences(a.read_text(), b.read_text(), a.suffix)

    differ = {n: d for n in made if (d := differences(made[n], committed[n]))}
    assert differ == {}, f"{csv.parent}: tables differ from their records: {list(differ.items())[:5]}"


HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def provenance_lines() -> list[tuple[Path, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files = [p for p in files if "records" not in p.relative_to(ROOT).parts[2:3] and "-records" not in str(p)]
    return [(p, line) for p in files for line in p.read_text().splitlines() if line.startswith("Provenance:")]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def unknown_commits(lines: list[tuple[Path, str]]) -> set[str]:
    """The commits named in `lines` that are not in this repository's history (an ancestor of HEAD)."""
    missing = set()
    for p, line in lines:
        for commit in HEX.findall(line):
            full = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
            if full.returncode != 0 or git("merge-base", "--is-ancestor", full.stdout.strip(), "HEAD").returncode:
                missing.add(f"{p.name}: {commit}")
    return missing


def needs_history() -> None:
    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: commits cannot be looked up")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the history the provenance commits are in")


def test_every_provenance_line_names_commits_of_this_repository():
    """A provenance line names the commit(s) its records were written from, and each is in this repository's history
    (an ancestor of HEAD): a table cannot point at a commit nobody can check out."""
    needs_history()
    lines = provenance_lines()
    assert len(lines) >= 10
    unnamed = [f"{p.relative_to(ROOT)}: {line}" for p, line in lines if not HEX.search(line.split(";")[0])]
    assert unnamed == [], "provenance lines without a commit"
    assert unknown_commits(lines) == set()


def test_the_check_finds_a_commit_that_is_not_in_the_history():
    """Planted bug: a made-up commit, and a real one beside it that passes."""
    needs_history()
    head = git("rev-parse", "HEAD").stdout.strip()
    lines = [(Path("fake.md"), "Provenance: 2 commits (0123456789ab: 1 record, " + head[:12] + ": 1 record).")]
    assert unknown_commits(lines) == {"fake.md: 0123456789ab"}


# ----------------------------------------------------------------------------------------------------------------
# A table of constant predictors says so


def test_rows_that_score_what_mean_scores_are_named_under_the_table():
    """lora and queryable sit within 1 % of mean on every function and seed (a constant prediction); dora moves on
    one seed of f2 (2 % off), so it is named on f1 only. The default deep-narrow line names the cause and the option;
    the same numbers on the kaiming init name no cause. One function: the count of trained rows."""
    mean = [1.0, 2.0, 4.0]
    spec = {
        f: {
            "lora": [v * 1.005 for v in mean],
            "queryable": [v * 0.995 for v in mean],
            "dora": [v * (1.02 if (f, i) == ("f2", 1) else 1.0) for i, v in enumerate(mean)],
            "mean": mean,
            "frozen": [9.0, 9.0, 9.0],
        }
        for f in ("f1", "f2")
    }
    f = make_frame(spec)
    note = tables.collapse_note(f.assign(backbone_init="default"))
    assert note.startswith("Trained rows that score what `mean` scores on every seed (within 1%), so they predict a ")
    assert "f1 (lora, dora, queryable); f2 (lora, queryable)." in note  # dora moved on one seed of f2
    assert "--backbone-init kaiming" in note
    live = tables.collapse_note(f.assign(backbone_init="kaiming"))
    assert "f2 (lora, queryable)" in live and "kaiming" not in live
    one = tables.collapse_note(make_frame({"f2": spec["f2"]}).assign(backbone_init="default"))
    assert one.startswith("2 of 3 trained rows (lora, queryable) score what `mean` scores on every seed")
    moved = make_frame({"f1": {"lora": [0.5, 1.0, 2.0], "mean": mean}})
    assert tables.collapse_note(moved) == ""  # a row that learned something: no line
    assert tables.collapse_note(make_frame({"f1": {"lora": mean}})) == ""  # no mean row: nothing to compare with


SUITE_REPORTS = {"suites": "suite-records", "language": "language-records"}  # report folder: its records folder


def without_figures(md: str) -> str:
    """A report's Markdown without its figure lines (a rebuild draws none) and the blank lines they leave."""
    lines = [line for line in md.splitlines() if not line.startswith("![")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


@pytest.mark.parametrize("name", ["suites", pytest.param("language", marks=pytest.mark.slow)])  # language: ~30 s
def test_a_committed_suite_report_is_rebuilt_from_its_records(name, tmp_path, capsys):
    """The suite and held-out reports from their committed JSON records (no model weights): every table (.md, .csv)
    the same as committed, report.md the same but for its figure lines, and nothing committed that they do not make."""
    from qlbench import cli

    committed_dir = RESULTS / name
    assert cli.main(["report", str(RESULTS / SUITE_REPORTS[name]), "--format", "md,csv", "--no-figures",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    capsys.readouterr()
    made = {p.relative_to(tmp_path).as_posix(): p for p in tmp_path.rglob("*") if p.suffix in (".md", ".csv")}
    committed = {p.relative_to(committed_dir).as_posix(): p for p in committed_dir.rglob("*") if p.is_file()}
    committed = {n: p for n, p in committed.items() if not n.endswith(".png")}
    assert sorted(made) == sorted(committed)
    differ = {
        n: d
        for n in made
        if (d := table_differences(*(without_figures(p.read_text()) for p in (made[n], committed[n])), made[n].suffix))
    }
    assert differ == {}, f"{name}: tables differ from their records: {list(differ.items())[:5]}"
    assert not list((RESULTS / SUITE_REPORTS[name]).rglob("*.pt"))  # records only, no weights


# ----------------------------------------------------------------------------------------------------------------
# The tables the manuals quote: every number from a committed report

SOURCE = re.compile(r"<!-- records: (\S+) -->")
DECIMAL = re.compile(r"\d\.\d")  # a table with a decimal number in a body cell (its first column aside) is results
NUMBER = re.compile(r"(?<![\w.])(?:\d[\d,]*\.?\d*(?:e[-+]?\d+)?|inf)(?![\w.])")
MANUALS = [ROOT / "README.md", ROOT / "docs" / "why.md"]


def quoted_tables(path: Path) -> list[tuple[int, str | None, list[str]]]:
    """(line number, source or None, body rows) of every Markdown table of results in `path` (a decimal number in a
    body cell); its source is the `<!-- records: FILE -->` comment on one of the three lines above it."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            rows = lines[i + 2 : j]
            if any(DECIMAL.search(c) for r in rows for c in r.strip("|").split("|")[1:]):
                above = [m.group(1) for line in lines[max(0, i - 3) : i] if (m := SOURCE.search(line))]
                out.append((i + 1, above[-1] if above else None, rows))
            i = j
        else:
            i += 1
    return out


def numbers(text_: str) -> set[str]:
    return set(NUMBER.findall(text_.replace("*", "").replace("†", " ")))


def unsupported(rows: list[str], source: Path) -> list[str]:
    """The numbers of `rows` (every cell but the first) that the source file does not hold."""
    held = numbers(source.read_text())
    cells = [c for r in rows for c in r.strip("|").split("|")[1:]]
    return sorted({n for c in cells for n in numbers(c)} - held)


@pytest.mark.parametrize("manual", MANUALS, ids=lambda p: p.name)
def test_every_results_table_in_the_manuals_quotes_a_committed_report(manual):
    tables_ = quoted_tables(manual)
    assert [line for line, source, _ in tables_ if source is None] == [], "results tables without a records source"
    for line, source, rows in tables_:
        path = ROOT / source
        assert path.is_file() and path.is_relative_to(RESULTS), f"{manual.name}:{line}: {source} is not committed"
        assert unsupported(rows, path) == [], f"{manual.name}:{line}: numbers not in {source}"


def test_a_number_that_is_not_in_the_report_is_caught(tmp_path):
    """Planted bug: one digit changed in a quoted row."""
    source = tmp_path / "table.md"
    source.write_text("| f | lora |\n|---|---|\n| ackley | 0.486 ± 0.031 |\n")
    assert unsupported(["| ackley | 0.486 ± 0.031 |"], source) == []
    assert unsupported(["| ackley | 0.487 ± 0.031 |"], source) == ["0.487"]


def test_the_real_model_tables_are_rebuilt_from_their_records(tmp_path):
    """real.md / real.csv (MiniLM through peft) and real-lm.md (the tiny decoder) from the JSON records committed
    beside them."""
    pytest.importorskip("peft")
    from qlbench.experiments import real_lm
    from qlbench.report import real as real_report

    records = sorted((RESULTS / "real" / "records").glob("*.json"))
    assert records, "docs/results/real has no records"
    real_report.write(records, tmp_path)
    for name in ("real.md", "real.csv"):
        made, committed = (tmp_path / name).read_text(), (RESULTS / "real" / name).read_text()
        assert table_differences(made, committed, Path(name).suffix) == [], name
    records = sorted((RESULTS / "real-lm" / "records").glob("*.json"))
    assert records, "docs/results/real-lm has no records"
    assert real_lm.markdown(records) == (RESULTS / "real-lm" / "real-lm.md").read_text()


REBUILT_ELSEWHERE = ("suites/", "language/", "real/real.md", "real-lm/real-lm.md")  # the tests above rebuild these
REBUILT_ELSEWHERE += ("leaderboard.md", "validity/validity.md")  # from the zoo-v1 baselines: tests/test_compare.py
REBUILT_ELSEWHERE += ("leaderboard-zoo-v2/leaderboard.md", "validity-zoo-v2/validity.md")  # zoo-v2: test_compare.py
REBUILT_ELSEWHERE += ("items/items.md", "items/candidates/items.md")  # from the committed per-seed CSVs: test_board.py
SPEED = "bench/"  # `qlbench bench` reports: speed figures with their JSON beside them, not result tables


def test_every_committed_table_has_records_it_is_rebuilt_from():
    """A table under docs/results is one of a per-seed report's, a suite report's or a real-model table: one that a
    test above rebuilds from its committed records. Anything else is a table nobody can check."""
    covered = [p.parent for p in COMMITTED]
    orphans = []
    for md in sorted(RESULTS.rglob("*.md")):
        name = md.relative_to(RESULTS).as_posix()
        if (
            name == "README.md"
            or any(md.is_relative_to(c) for c in covered)
            or name.startswith((*REBUILT_ELSEWHERE, SPEED))
        ):
            continue
        orphans.append(name)
    assert orphans == [], "tables under docs/results without records"
