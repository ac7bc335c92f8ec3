"""`qlbench verify`: a smoke-trained queryable cell satisfies every norm and Lipschitz bound; bad input is one line
and exit code 2; a violated bound is reported on stderr with exit code 1."""

from __future__ import annotations

import json

import pytest
import torch

from qlbench import cli, verify
from qlbench.theory.bounds import Bound

from helpers import one_line_error


def fake_results(tmp_path, arch="deep-narrow", function="dropwave"):
    path = tmp_path / "records" / arch / function / "queryable" / "smoke-0123456789abcdef.json"
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    return path


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["verify", "--arch", "cnn"], ["'cnn'", "deep-narrow", "transformer"]),
        (["verify", "--function", "nope"], ["'nope'", "dropwave"]),
        (["verify", "--results", "/nonexistent/qlbench"], ["does not exist"]),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, expect):
    line = one_line_error(capsys, argv)
    for word in expect:
        assert word in line, line


def test_no_queryable_record_is_exit_2(capsys, tmp_path):
    fake_results(tmp_path, function="matyas")
    line = one_line_error(capsys, ["verify", "--results", str(tmp_path), "--function", "dropwave"])
    assert "no queryable record" in line and "records/deep-narrow/matyas/queryable/smoke-0123456789abcdef.json" in line
    fake_results(tmp_path, function="levy")
    line = one_line_error(capsys, ["verify", "--results", str(tmp_path)])
    assert "several queryable cells" in line and "--function levy" in line


def test_violated_bound_is_loud_and_exit_1(capsys, tmp_path, monkeypatch):
    record = fake_results(tmp_path)
    bad = Bound(
        "prop:app_convex_hull_bound",
        "||S_b|| <= max_m ||C_m|| = R_C",
        torch.tensor([1.0, 3.0]),
        torch.tensor([2.0, 2.0]),
    )
    assert not bad.holds()

    def fake_verify(path, device):
        assert path == record
        return {
            "method": "queryable",
            "function": "dropwave",
            "arch": "deep-narrow",
            "budget": "smoke",
            "members": 1,
            "test_samples": 2,
            "statements": [verify.finite_row(bad.summary())],
            "violated": 1,
        }

    monkeypatch.setattr(verify, "verify_record", fake_verify)
    assert cli.main(["verify", "--results", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "VIOLATED" in out and "1.5" in out  # the worst ratio 3 / 2
    assert err.count("VIOLATED prop:app_convex_hull_bound") == 1
    report = json.loads((tmp_path / "verify.json").read_text())
    assert report["violated"] == 1 and report["statements"][0]["ratio"] == 1.5


def test_smoke_trained_model_satisfies_every_bound(capsys, tmp_path):
    out_json = tmp_path / "v" / "verify.json"
    code = cli.main(["verify", "--function", "matyas", "--out", str(out_json), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert len(list((tmp_path / "v" / "records" / "deep-narrow" / "matyas" / "queryable").glob("smoke-*.json"))) == 1
    labels = {r["label"] for r in report["statements"]}
    assert labels >= {
        "prop:app_convex_hull_bound",
        "cor:app_update_norm_bound",
        "prop:app_depth_summary_bounded",
        "cor:app_query_norm_bound",
        "lem:app_rmsnorm_jacobian",
        "lem:app_softmax_jacobian",
        "prop:app_summary_lipschitz",
        "prop:app_router_operator_lipschitz",
    }
    assert report["violated"] == 0 and all(r["status"] == "holds" for r in report["statements"])
    assert report["test_samples"] == 800 and report["members"] == 2
    for r in report["statements"]:
        assert r["items"] > 0 and r["ratio"] <= 1 + 1e-9
        assert r["label"] in out
    # the second call reuses the trained cell (same folder, same config)
    assert cli.main(["verify", "--results", str(tmp_path / "v"), "--out", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert [r["ratio"] for r in again["statements"]] == [r["ratio"] for r in report["statements"]]
