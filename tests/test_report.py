"""qlbench.report on synthetic results with known values: a diverged seed that would otherwise look best is never
marked, every number says its seed count, tables never mix (arch, budget), LaTeX is booktabs and compiles."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from test_stats import Div, make_frame

from qlbench import cli, report, text
from qlbench.metrics import stats

from helpers import one_line_error

# seaborn 0.13's heatmap calls Colormap.set_bad, which matplotlib >= 3.11 marks pending deprecation (not ours)
pytestmark = [
    pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning"),
    pytest.mark.xdist_group("report"),  # its module fixture trains once: its tests, one worker
]

LORA = [1.0, 1.2, 0.9, 1.1, 1.05]


def spec(shift: float = 0.0) -> dict:
    """Two functions, five seeds. On six_hump: full-soap is best overall, queryable is the best adapter and
    consistently below LoRA (†); dora's finite values are the lowest of all but one seed diverged; mean is lower
    still but a reference row; replora failed. On dropwave doran has 3 seeds."""
    lora = [v + shift for v in LORA]
    return {
        "six_hump": {
            "full-soap": [0.5, 0.6, 0.55, 0.52, 0.58],
            "lora": lora,
            "dora": [Div(0.01), 0.02, 0.015, 0.012, 0.017],
            "hyra": [v + d for v, d in zip(lora, [0.2, -0.2, 0.1, -0.15, 0.05])],
            "queryable": [v - 0.3 + 0.001 * i for i, v in enumerate(lora)],
            "replora": ["failed"] * 5,
            "frozen": [2.0] * 5,
            "mean": [0.001] * 5,
        },
        "dropwave": {"lora": lora, "doran": [0.8, 0.9, 0.7], "queryable": [v + 0.01 for v in lora]},
    }


def make_curves(frame: pd.DataFrame) -> pd.DataFrame:
    """`results.load_curves`-shaped curves for every (cell, seed) of a frame: trained methods evaluated at epochs
    0, 10, ..., 40 decaying to the seed's value; a diverged seed is NaN from epoch 30; frozen and mean at epoch 0."""
    rows = []
    for r in frame.itertuples():
        if r.status == "failed":
            continue
        epochs = [0] if r.method in ("frozen", "mean") else range(0, 50, 10)
        for e in epochs:
            v = math.nan if r.status == "diverged" and e >= 30 else r.best_train_mse * (1 + 4 * math.exp(-e / 10))
            rows.append(
                {
                    "function": r.function,
                    "arch": r.arch,
                    "method": r.method,
                    "budget": r.budget,
                    "seed": r.seed,
                    "status": r.status,
                    "epoch": e,
                    "train_mse": v,
                    "test_mse": 2 * v,
                }
            )
    return pd.DataFrame(rows)


@pytest.fixture
def frame() -> pd.DataFrame:
    return make_frame(spec())


def row(data: pd.DataFrame, function: str, method: str) -> pd.Series:
    return data[(data.function == function) & (data.method == method)].iloc[0]


def md_cells(md: str, function: str) -> dict:
    """{method: cell text} of one function's row in a Markdown paper table."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == function:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {function}")


# ----------------------------------------------------------------------------------------------------------------
# Marks


def test_a_diverged_seed_that_would_look_best_is_not_marked(frame):
    data = report.table_data(frame, "best-train")
    dora = row(data, "six_hump", "dora")
    assert dora["mean_ok"] < row(data, "six_hump", "full-soap")["mean_ok"]  # survivors alone would win
    assert dora["value"] == math.inf and not dora["best_overall"] and not dora["best_adapter"]
    assert row(data, "six_hump", "full-soap")["best_overall"]
    assert row(data, "six_hump", "queryable")["best_adapter"]
    cells = md_cells(report.paper_markdown(data), "six_hump")
    assert cells["dora"] == "inf (1/5 div.; 4 ok: 0.0160 ± 0.0034)"  # the survivors 0.02, 0.015, 0.012, 0.017
    assert cells["full-soap"] == "**0.550 ± 0.041†**"  # below LoRA on every seed
    assert cells["queryable"].startswith("*0.") and cells["queryable"].endswith("†*")
    assert not cells["queryable"].startswith("**")


def test_reference_columns_and_failed_cells_are_never_marked(frame):
    data = report.table_data(frame, "best-train")
    assert row(data, "six_hump", "mean")["value"] < row(data, "six_hump", "full-soap")["value"]
    for method in ("mean", "frozen", "replora"):
        r = row(data, "six_hump", method)
        assert not (r["best_overall"] or r["best_adapter"] or r["sig_vs_lora"])
    cells = md_cells(report.paper_markdown(data), "six_hump")
    assert cells["mean"] == "0.00100 ± 0" and cells["replora"] == "failed" and cells["frozen"] == "2.00 ± 0"


def test_significance_mark_only_where_paired_test_says_so(frame):
    data = report.table_data(frame, "test-at-best-train")
    assert row(data, "six_hump", "queryable")["vs_lora"] == "win"
    assert row(data, "six_hump", "hyra")["vs_lora"] == "tie" and not row(data, "six_hump", "hyra")["sig_vs_lora"]
    assert row(data, "dropwave", "queryable")["vs_lora"] == "loss"  # +0.01 on every seed
    cells = md_cells(report.paper_markdown(data), "six_hump")
    assert "†" not in cells["hyra"] and "†" not in cells["lora"]


def test_the_legend_and_the_statistics_table_state_the_holm_family(frame):
    """The best-train table's family: four comparisons of trained methods with LoRA on six_hump (replora failed: no
    pairs; frozen and mean are reference rows, not hypotheses) and two on dropwave. doran's raw p (0.0198) is below
    0.05, its Holm p (3 x 0.0198, see test_seed_counts_are_shown) is not; the CSV and the statistics table keep
    both. The reference rows keep their raw p, with no Holm p and no outcome but "reference"."""
    data = report.table_data(frame, "best-train")
    md = report.paper_markdown(data)
    assert "Holm-adjusted p < 0.05 over the table's 6 comparisons of trained methods with LoRA" in md
    for method in ("frozen", "mean"):
        ref = row(data, "six_hump", method)
        assert ref["p_vs_lora"] < 1e-4 and math.isnan(ref["p_holm_vs_lora"]) and ref["vs_lora"] == "reference"
    doran = row(data, "dropwave", "doran")
    assert doran["p_vs_lora"] < 0.05 < doran["p_holm_vs_lora"] and doran["vs_lora"] == "tie"
    assert not doran["sig_vs_lora"]
    table = report.comparison_table(stats.compare(frame, "best-train")).set_index(["function", "method"])
    assert table.loc[("dropwave", "doran"), ["t p", "Holm p", "result"]].tolist() == ["0.0198", "0.0594", "tie"]
    assert "Holm p" in report.STATS_LEGEND


def test_seed_counts_are_shown(frame):
    md = report.paper_markdown(report.table_data(frame, "best-train"))
    assert "n = 5 seeds" in md and "inf (k/n div.; m ok: mean ± std)" in md
    # 3 pairs, raw t p = 0.0198, but the 4th smallest of the table's 6 comparisons of trained methods with LoRA
    # (three others are below 4e-4): Holm 3 x 0.0198 = 0.059, so no †
    assert md_cells(md, "dropwave")["doran"] == "***0.800 ± 0.10 (n=3)***"
    assert md_cells(md, "dropwave")["dora"] == "-"  # not run


def test_a_paper_table_refuses_mixed_slices():
    mixed = pd.concat([make_frame(spec()), make_frame(spec(), arch="transformer")])
    with pytest.raises(ValueError, match="one \\(arch, budget\\)"):
        report.paper_markdown(report.table_data(mixed, "best-train"))


# ----------------------------------------------------------------------------------------------------------------
# The run table


def test_method_table_shows_seeds_divergence_and_failure(frame):
    t = report.method_table(frame[frame.function == "six_hump"]).set_index("method")
    assert list(t.columns[:3]) == ["status", "n", "diverged"]
    assert t.loc["dora", "status"] == "diverged" and t.loc["dora", "diverged"] == "1/5"
    assert t.loc["dora", "best train MSE"] == "inf (4 ok: 0.0160 ± 0.0034)"
    assert t.loc["replora", "status"] == "failed" and t.loc["replora", "best train MSE"] == "failed"
    assert t.loc["lora", "best train MSE"] == "1.05 ± 0.11" and t.loc["lora", "n"] == 5
    assert t.loc["lora", "× LoRA"] == "1.000" and t.loc["frozen", "× LoRA"] == "-"
    assert text.markdown(t.reset_index()).splitlines()[0].startswith("| method ")


def test_method_table_shows_the_source_mse_after_adaptation(frame):
    six = frame[frame.function == "six_hump"]
    assert set(report.method_table(six)["source test MSE after"]) == {"-"}  # records written before the field
    after = six.assign(source_test_mse_after=np.where(six["method"] == "lora", six["seed"] + 1.0, np.nan))
    t = report.method_table(after).set_index("method")
    n = int((six["method"] == "lora").sum())
    expected = np.arange(1.0, n + 1)
    assert t.loc["lora", "source test MSE after"] == text.mean_std(expected.mean(), expected.std(ddof=1), n)
    assert t.loc["dora", "source test MSE after"] == "-"


def test_method_table_keeps_budgets_apart():
    both = pd.concat([make_frame(spec()), make_frame(spec(), budget="paper")])
    t = report.method_table(both)
    assert "budget" in t.columns and set(t["budget"]) == {"quick", "paper"}


# ----------------------------------------------------------------------------------------------------------------
# LaTeX


def test_latex_is_booktabs_escaped_and_ascii(frame):
    tex = report.paper_latex(report.table_data(frame, "best-train"), label="tab:x")
    for piece in (r"\begin{table}", r"\toprule", r"\midrule", r"\bottomrule", r"\end{tabular}", r"\label{tab:x}"):
        assert piece in tex
    assert tex.isascii()  # ± and † written as LaTeX, nothing pdflatex could choke on
    assert r"six\_hump &" in tex and "six_hump" not in tex
    body = tex.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines()
    header = tex.split(r"\toprule")[1].split(r"\midrule")[0].strip()
    assert len(body) == 2 and all(line.count("&") == header.count("&") == 9 for line in body)
    six = next(line for line in body if line.startswith("six"))
    assert r"\textbf{0.550 $\pm$ 0.041\textsuperscript{$\dagger$}}" in six
    assert r"inf (1/5 div.; 4 ok: 0.0160 $\pm$ 0.0034)" in six
    assert six.count(r"\textbf") == 1 and six.count(r"\textit") == 1
    assert tex.count("{") == tex.count("}") and tex.count("$") % 2 == 0


def _compile(tmp_path, tex_files) -> subprocess.CompletedProcess:
    doc = tmp_path / "doc.tex"
    inputs = "\n".join(rf"\input{{{p.as_posix()}}}" for p in tex_files)
    doc.write_text(
        "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n" + inputs + "\n\\end{document}\n"
    )
    return subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(
    shutil.which("pdflatex") is None,
    reason="pdflatex not on PATH (Debian: texlive-latex-base texlive-latex-recommended)",
)
def test_latex_compiles_with_only_booktabs(frame, tmp_path):
    out = report.write_report(frame, None, tmp_path / "r", formats=("latex",), figures=False)
    tex = [p for p in out["files"] if p.suffix == ".tex"]
    assert len(tex) == 7  # 2 paper tables + 2 x (per function, across functions) statistics + the cost table
    proc = _compile(tmp_path, tex)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (tmp_path / "doc.pdf").stat().st_size > 0


# ----------------------------------------------------------------------------------------------------------------
# write_report and figures


def test_write_report_one_set_per_arch_and_budget(tmp_path):
    mixed = pd.concat(
        [
            make_frame(spec()),
            make_frame(spec(shift=10.0), arch="transformer"),
            make_frame(spec(shift=100.0), budget="paper"),
        ],
        ignore_index=True,
    )
    out = report.write_report(mixed, make_curves(mixed), tmp_path, metric="best-test")
    md = out["markdown"]
    for heading in ("## deep-narrow, budget paper", "## deep-narrow, budget quick", "## transformer, budget quick"):
        assert heading in md
    assert (tmp_path / "report.md").read_text() == md
    files = set(out["files"])
    assert all(p.exists() and p.stat().st_size > 0 for p in files)
    for arch, budget, shift in (
        ("deep-narrow", "quick", 0.0),
        ("transformer", "quick", 10.0),
        ("deep-narrow", "paper", 100.0),
    ):
        folder = tmp_path / arch / budget
        for stem in ("table-best-train", "table-best-test", "stats-vs-lora-best-test", "wtl-vs-best-static-best-test"):
            assert {folder / f"{stem}.{ext}" for ext in ("md", "tex", "csv")} <= files
        for stem in ("curves-train", "curves-test", "log-ratio-best-test"):
            assert {folder / f"{stem}.png", folder / f"{stem}.pdf"} <= files
        csv = pd.read_csv(folder / "table-best-train.csv")
        assert set(csv["arch"]) == {arch} and set(csv["budget"]) == {budget}  # never mixed
        lora = csv[(csv.function == "six_hump") & (csv.method == "lora")].iloc[0]
        assert lora["mean_ok"] == pytest.approx(np.mean(LORA) + shift) and lora["n"] == 5
        dora = csv[(csv.function == "six_hump") & (csv.method == "dora")].iloc[0]
        assert dora["value"] == math.inf and not dora["best_overall"]


def test_write_report_statistics_content(frame, tmp_path):
    out = report.write_report(frame, None, tmp_path, formats=("md", "csv"), figures=False)
    stats_csv = pd.read_csv(tmp_path / "deep-narrow" / "quick" / "stats-vs-lora-test-at-best-train.csv")
    q = stats_csv[(stats_csv.function == "six_hump") & (stats_csv.method == "queryable")].iloc[0]
    assert q["outcome"] == "win" and q["mean_diff"] == pytest.approx(-0.6 + 0.002 * 2)
    dora = stats_csv[(stats_csv.function == "six_hump") & (stats_csv.method == "dora")].iloc[0]
    assert np.isnan(dora["t_p"]) and dora["n_div"] == 1
    assert "| six_hump | dora " in out["markdown"] and "Across functions" in out["markdown"]
    wtl = pd.read_csv(tmp_path / "deep-narrow" / "quick" / "wtl-vs-lora-test-at-best-train.csv").set_index("method")
    assert wtl.loc["queryable", ["wins", "ties", "losses"]].tolist() == [1, 0, 1]
    assert not any(p.suffix in (".tex", ".png") for p in out["files"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"metric": "test"}, "unknown metric 'test'"),
        ({"formats": ("md", "html")}, "unknown format 'html'"),
    ],
)
def test_write_report_rejects_bad_arguments(frame, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        report.write_report(frame, None, tmp_path, **kwargs)


def test_write_report_rejects_an_empty_frame(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        report.write_report(pd.DataFrame(), None, tmp_path)
    assert not any(tmp_path.iterdir())


def test_curves_figure_has_a_log_panel_per_function(frame):
    fig = report.curves_figure(make_curves(frame), "train")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    assert isinstance(fig, Figure) and len(panels) == 2
    assert all(ax.get_yscale() == "log" for ax in panels)
    assert {ax.get_title() for ax in panels} == {"dropwave", "six_hump (diverged: dora 1/5)"}


def test_log_ratio_heatmap_marks_diverged_cells():
    f = make_frame(
        {
            "f": {"lora": [1.0, 10.0], "queryable": [0.1, 1.0], "dora": [Div(1.0), 10.0]},
            "g": {"lora": [1.0, 1.0], "queryable": [10.0, 10.0]},
        }
    )
    fig = report.log_ratio_figure(f, "best-train")
    ax = fig.axes[0]
    texts = {t.get_text() for t in ax.texts}
    assert {"-1", "+1", "+inf"} <= texts  # queryable on f / g, dora on f
    assert len(ax.patches) == 1  # the hatched ±inf cell


# ----------------------------------------------------------------------------------------------------------------
# `qlbench report` on a real smoke sweep, and its bad input


@pytest.fixture(scope="module")
def sweep_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    argv = ["sweep", "--functions", "matyas,levy", "--budget", "smoke", "--seeds", "3", "--out", str(out)]
    assert cli.main([*argv, "--methods", "lora,dora,queryable,frozen,mean", "--no-progress"]) == 0
    return out


def test_report_command_writes_tables_statistics_and_figures(sweep_folder, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", str(sweep_folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    folder = out / "deep-narrow" / "smoke"
    for name in ("table-best-train", "table-test-at-best-train", "stats-vs-lora-test-at-best-train"):
        for ext in (".md", ".tex", ".csv"):
            assert (folder / f"{name}{ext}").stat().st_size > 0, name + ext
    for name in ("curves-train", "curves-test", "log-ratio-test-at-best-train"):
        assert (folder / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (folder / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
    table = pd.read_csv(folder / "table-best-train.csv")
    assert set(table["function"]) == {"matyas", "levy"} and set(table["n"]) == {3}
    assert set(table["method"]) == {"lora", "dora", "queryable", "frozen", "mean"}
    assert "| function" in printed and "## deep-narrow, budget smoke" in printed
    assert (out / "report.md").read_text().strip() in printed


def test_report_names_older_configs_and_never_mixes_them(sweep_folder, tmp_path, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(sweep_folder, folder)
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--seeds", "3", "--out", str(folder)]
    assert cli.main([*argv, "--methods", "lora", "--hp", "r=4", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["report", str(folder), "--no-figures", "--format", "csv"]) == 0
    err = capsys.readouterr().err
    assert err.count("older config(s) not shown") == 1 and "deep-narrow/smoke/matyas/lora" in err
    table = pd.read_csv(folder / "report" / "deep-narrow" / "smoke" / "table-best-train.csv")
    lora = table[(table["function"] == "matyas") & (table["method"] == "lora")]
    assert len(lora) == 1 and lora["n"].item() == 3  # 3 seeds of one config, not 6 of two


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--metric", "best"], ["'best'", "test-at-best-train"]),
        (["--format", "docx"], ["docx", "latex", "csv"]),
        (["--format", ","], ["format", "md"]),
        (["--arch", "cnn"], ["'cnn'", "deep-narrow"]),
        (["--budget", "paper"], ["'paper'", "smoke"]),
    ],
)
def test_report_bad_arguments_are_one_line_exit_2(sweep_folder, capsys, extra, expect):
    line = one_line_error(capsys, ["report", str(sweep_folder), *extra])
    for word in expect:
        assert word in line, line


def test_report_on_an_empty_or_missing_folder_is_one_line(tmp_path, capsys):
    assert "does not exist" in one_line_error(capsys, ["report", str(tmp_path / "nope")])
    assert "no records" in one_line_error(capsys, ["report", str(tmp_path)])


# --------------------------------------------------------------------------------------------------------------
# The real-model table (qlbench/report/real.py; needs no hf extra, so it is tested here and not in test_real.py).


def real_frame(mean_over_tasks: dict[str, list[float]]) -> pd.DataFrame:
    """The frame of `report.real.frame`: one row per (method, seed), every task's MSE equal to the mean."""
    from qlbench.experiments.real import TASKS

    return pd.DataFrame(
        {"method": m, "seed": s, "test_mse": v, "trainable_params": 100} | {t: v for t in TASKS}
        for m, values in mean_over_tasks.items()
        for s, v in enumerate(values)
    )


def test_real_table_decides_vs_lora_on_holm_over_its_methods():
    """instruct-queryable is below LoRA on every seed: differences -0.5, -0.4, -0.7, paired t p = 0.0263. Compared
    alone it is a win. Beside queryable (differences 0.1, -0.2, 0.15, p = 0.89) the table makes 2 comparisons with
    LoRA: Holm p = 2 x 0.0263 = 0.0525 >= 0.05, a tie, though its raw p is below 0.05."""
    from qlbench.report import real as real_report

    lora, lower, null = [1.0, 2.0, 3.0], [0.5, 1.6, 2.3], [1.1, 1.8, 3.15]
    alone = real_report.table(real_frame({"lora": lora, "instruct-queryable": lower})).set_index("method")
    assert alone.loc["instruct-queryable", "vs LoRA"] == "win (p 0.0263, Holm 0.0263)"
    f = real_frame({"lora": lora, "queryable": null, "instruct-queryable": lower})
    table = real_report.table(f).set_index("method")
    assert table.loc["instruct-queryable", "vs LoRA"] == "tie (p 0.0263, Holm 0.0525)"
    assert table.loc["queryable", "vs LoRA"] == "tie (p 0.893, Holm 0.893)" and table.loc["lora", "vs LoRA"] == "-"
    iq = real_report.comparisons(f).set_index("method").loc["instruct-queryable"]
    assert iq["p_holm"] == pytest.approx(2 * iq["p"]) and iq["outcome"] == "tie"
    legend = real_report.legend(real_report.comparisons(f))
    assert "Holm-adjusted over the table's 2 comparisons with LoRA" in legend and "on the Holm p" in legend


def test_gpu_per_seed_csv_holds_every_records_seeds(sweep_folder, tmp_path):
    """docs/gpu/per-seed.py (what a GPU call brings back of a paper table): one row per record and seed, each
    value as the record's JSON holds it (read here directly, not through the loader the script uses)."""
    import importlib.util

    script = Path(__file__).parents[1] / "docs" / "gpu" / "per-seed.py"
    spec = importlib.util.spec_from_file_location("per_seed", script)
    per_seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(per_seed)
    out = tmp_path / "per-seed.csv"
    assert per_seed.main(sweep_folder, out) == 0
    frame = pd.read_csv(out, dtype={"config_hash": str})
    assert list(frame.columns) == per_seed.COLUMNS
    expected = {}
    for path in (sweep_folder / "records").rglob("*.json"):
        rec = json.loads(path.read_text())
        config = rec["run_info"]["config"]
        for s in rec["train_info"]["per_seed"]:
            key = (config["function"], config["method"], s["seed"])
            expected[key] = (s["best_test_mse"], s["test_at_best_train"], rec["run_info"]["config_hash"])
    assert len(expected) == 2 * 5 * 3 and len(frame) == len(expected)
    for row in frame.itertuples():
        best, at_train, config_hash = expected[(row.function, row.method, row.seed)]
        assert (row.best_test_mse, row.test_at_best_train, row.config_hash) == (best, at_train, config_hash)
    assert per_seed.main(tmp_path / "nothing", tmp_path / "none.csv") == 1  # an empty folder: said, exit 1


def test_a_report_of_unfinished_cells_says_which_and_tests_across_functions_only_with_two(tmp_path, capsys):
    """A folder with cells still missing (a sweep stopped part way): the report names the holes and the cells short
    of seeds, and runs no across-functions test on a single function."""
    import pandas as pd

    from qlbench import cli

    full = pd.read_csv("docs/results/zoo/per-seed.csv.gz", dtype=str, keep_default_na=False)
    full = full[(full["arch"] == "deep-narrow") & (full["backbone_init"] == "default")]
    full = full[full["method"].isin(["lora", "dora", "frozen", "mean"])]
    part = full[~((full["function"] == "levy") & (full["method"] == "dora"))]  # a hole
    part = part[~((part["function"] == "matyas") & (part["method"] == "lora") & (part["seed"] == "9"))]  # a seed short
    part.to_csv(tmp_path / "part.csv", index=False)
    assert cli.main(["report", str(tmp_path / "part.csv"), "--out", str(tmp_path / "r"), "--format", "md"]) == 0
    out = capsys.readouterr().out
    (line,) = {line for line in out.splitlines() if line.startswith("Incomplete: ")}
    assert "1 of 36 (function, method) cells have no record: dora on levy;" in line
    assert (
        "1 cell(s) have fewer seeds than their method's others: lora on matyas (9 of 10)" in line
        and "Across functions vs LoRA" in out
    )
    one = full[full["function"] == "levy"]
    one.to_csv(tmp_path / "one.csv", index=False)
    assert cli.main(["report", str(tmp_path / "one.csv"), "--out", str(tmp_path / "o"), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "Incomplete" not in out and "Across functions vs LoRA" not in out  # one function: its table says it all
