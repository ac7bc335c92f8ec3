"""peft's own generic tests on Queryable LoRA (`make test-peft-matrix`, in CI): the custom-model tests of the
installed peft's sdist, run unmodified, with Queryable LoRA's cases added by tests/peft_matrix/plugin.py beside
peft's LoRA cases on the same models.

The sdist comes from PyPI (`pip download`); its tests import diffusers and datasets, which the make target installs.
Passes when no Queryable LoRA test fails, every one it skips is skipped by peft itself or is a merging test (skipped
by name with the reason: the update depends on the input), its pass rate on the tests that run equals LoRA's, and
each of its cases passed enough tests that a collection problem cannot pass for a result.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

peft = pytest.importorskip("peft")
pytest.importorskip("diffusers", reason="peft's tests import diffusers: `make test-peft-matrix` installs it")
pytest.importorskip("datasets", reason="peft's tests import datasets: `make test-peft-matrix` installs it")

pytestmark = pytest.mark.peft_matrix

PLUGIN = Path(__file__).parent / "peft_matrix"
sys.path.insert(0, str(PLUGIN))
from plugin import LORA_CASES, MERGE_REASON, QUERYABLE_CASES  # noqa: E402

CASES = [*(name for name, *_ in QUERYABLE_CASES), *LORA_CASES]

MIN_PASSED_PER_CASE = 20  # each case passes about 40 of peft's tests; below this something was not collected


def peft_tests(folder: Path) -> Path:
    """The tests folder of the installed peft's sdist, downloaded from PyPI and unpacked under `folder`."""
    spec = f"peft=={peft.__version__}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--no-binary", ":all:", "-d", str(folder), "-q"],
        check=True,
    )
    (sdist,) = folder.glob("peft-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(folder, filter="data")
    tests = folder / f"peft-{peft.__version__}" / "tests"
    (tests / "__init__.py").touch()  # the sdist leaves it out; its tests import each other relatively
    return tests


def outcomes(report: Path) -> dict[str, collections.Counter]:
    """method ("queryable" or "lora") -> Counter of outcomes; skip reasons under ("skipped", reason)."""
    counts = {"queryable": collections.Counter(), "lora": collections.Counter()}
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name")
        who = "queryable" if "Queryable LoRA" in name else "lora"
        tags = {child.tag: child for child in case}
        if "failure" in tags or "error" in tags:
            counts[who]["failed"] += 1
            counts[who]["failed", name] += 1
        elif "skipped" in tags:
            counts[who]["skipped"] += 1
            counts[who]["skipped", tags["skipped"].get("message", "")] += 1
        else:
            counts[who]["passed"] += 1
            counts[who]["passed", next((c for c in CASES if f"{c}-" in name), None)] += 1
    return counts


def test_peft_generic_tests_pass_for_queryable_lora_as_for_lora(tmp_path):
    tests = peft_tests(tmp_path)
    report = tmp_path / "matrix.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "plugin", "-p", "no:cacheprovider", "-o", "addopts=",
               "-W", "ignore", f"--junitxml={report}", str(tests / "test_custom_models.py")]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(PLUGIN)}
    done = subprocess.run(command, cwd=tests.parent, env=env, capture_output=True, text=True, timeout=1800)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    counts = outcomes(report)
    q, lora = counts["queryable"], counts["lora"]
    failed = sorted(k[1] for k in q if isinstance(k, tuple) and k[0] == "failed")
    assert failed == [], f"{len(failed)} of peft's tests fail on Queryable LoRA: {failed[:10]}"
    assert lora["failed"] == 0
    rate = lambda c: c["passed"] / (c["passed"] + c["failed"])
    assert rate(q) == rate(lora) == 1.0
    for name, *_ in QUERYABLE_CASES:
        assert q["passed", name] >= MIN_PASSED_PER_CASE, (name, q["passed", name])
    ours = q["skipped", MERGE_REASON]
    assert ours > 0 and q["skipped"] >= ours  # the rest are peft's own skips (tests for one tuner only)
