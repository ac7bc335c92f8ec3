"""Tables and figures for qlbench: the paper tables with paired statistics, in Markdown, LaTeX and CSV, and seaborn
figures. Entry point: `write_report(frame, curves, out_dir)`.

    tables        results -> DataFrames of text: the run table, the paper tables, paired statistics, legends
    figures       matplotlib Figures (no pyplot state): curves, log-ratio heatmap, gradients, routing, signal, zoo
    cost_figures  quality against cost: the cost panels and the Pareto figure
    write         write_report: every table and figure of a results frame as files, one set per (arch, budget, init)
    suite         write_suite_report: the suite section (tables, stage x task heatmaps, continual-routing figures)

Every number says how many seeds it stands on, and a diverged seed counts as MSE = inf in every "best" mark and
test (see `qlbench.metrics.stats` for the conventions); numbers and Markdown tables come from `qlbench.text`.
"""

from qlbench.report.figures import (
    atom_usage_figure,
    atom_weight_figure,
    concentration_figure,
    curves_figure,
    function_zoo_figure,
    gradient_profile_figure,
    log_ratio_figure,
    route_map_figure,
    signal_figure,
)
from qlbench.report.suite import write_suite_report
from qlbench.report.tables import (
    STATS_LEGEND,
    collapse_note,
    comparison_table,
    concentration_legend,
    concentration_table,
    method_table,
    paper_markdown,
    table_data,
    wtl_table,
)
from qlbench.report.write import paper_latex, write_report
from qlbench.text import FORMATS

__all__ = [
    "FORMATS",
    "STATS_LEGEND",
    "atom_usage_figure",
    "atom_weight_figure",
    "collapse_note",
    "comparison_table",
    "concentration_figure",
    "concentration_legend",
    "concentration_table",
    "curves_figure",
    "function_zoo_figure",
    "gradient_profile_figure",
    "log_ratio_figure",
    "method_table",
    "paper_latex",
    "paper_markdown",
    "route_map_figure",
    "signal_figure",
    "table_data",
    "wtl_table",
    "write_report",
    "write_suite_report",
]
