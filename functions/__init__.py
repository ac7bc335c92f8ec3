"""Function cards: one TOML file per test function (data only; the formulas live in qlbench/zoo.py)."""
