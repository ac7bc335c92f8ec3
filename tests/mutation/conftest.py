"""tests/mutation holds a script (run_mutants.py), not tests: never collected."""

collect_ignore = ["run_mutants.py"]
