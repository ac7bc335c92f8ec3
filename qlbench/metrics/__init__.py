"""Metrics on plain arrays and records, apart from the experiments that make them: paired statistics (stats), the
continual metrics of a stage x task matrix (continual) and the suite table's per-seed metrics (suite_stats)."""
