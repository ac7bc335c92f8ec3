"""Hypothesis profiles for the theorem checks (tests/properties).

    pytest tests/properties                          # `ci`: derandomised, modest number of examples
    HYPOTHESIS_PROFILE=dev pytest tests/properties   # `dev`: many more examples, random seeds

Every test draws float64 inputs (tests/properties/strategies.py) or a small real model (models.py) and checks one
statement of the paper on qlbench's own router and adapter code; tolerances are multiples of float64 eps.
"""

import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=50, database=None, **_common)
settings.register_profile("dev", max_examples=400, **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_report_header(config):
    import qlbench

    return [f"qlbench under test: {os.path.dirname(qlbench.__file__)}", f"hypothesis profile: {PROFILE}"]
