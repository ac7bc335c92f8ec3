"""Session settings for the whole suite.

One intra-op thread: the suite's tensors are tiny, and on a shared 2-core machine two OpenMP threads per process
made them about 10x slower in wall time. Flush-to-zero for denormals: a float32 deep-narrow step outside the
engine took 100x longer without it. Both are set before any tensor op so that worker threads inherit them.

QLBENCH_FAILURES_AT_ONCE=1 (docs/gpu/gpu-check.sh sets it) prints each failure's traceback as the test ends, not only
in pytest's summary at the session's end: a run stopped at a time limit (a GPU session's call) still says why its
tests failed. Under pytest-xdist the hook runs in the controller, which receives every worker's reports.
"""

import os
import sys

import torch

torch.set_num_threads(1)
torch.set_flush_denormal(True)


def pytest_runtest_logreport(report):
    at_once = os.environ.get("QLBENCH_FAILURES_AT_ONCE") == "1" and "PYTEST_XDIST_WORKER" not in os.environ
    if report.failed and at_once:  # in the controller only (a worker's stderr reaches the terminal too)
        print(
            f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-4000:]}", file=sys.stderr, flush=True
        )
