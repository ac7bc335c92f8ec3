"""Suite cards: one TOML file per multi-task suite (data only; qlbench/suites.py reads them)."""
