"""`qlbench bench` runs its real measurements (quick mode) and writes its report; speed itself is never asserted
(shared machines are noisy): the numbers are reported, and their consistency is what is checked here."""

from __future__ import annotations

import json

import pytest

from qlbench import cli


def test_quick_bench_writes_consistent_report(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--archs", "deep-narrow", "--methods", "lora,queryable,mean",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text() in capsys.readouterr().out
    assert report["peak_gflops"] > 0
    rows = {(r["method"], r["members"]): r for r in report["throughput"]}
    assert set(rows) == {("lora", 5), ("queryable", 5)}  # `mean` does not train
    for r in rows.values():
        assert r["stacked"] > 0 and r["naive"] > 0 and r["step_gflop"] > 0
        assert r["gflops"] == pytest.approx(r["step_gflop"] * r["stacked"] / 5)
        assert 0 < r["peak_share"] < 1
    inference = {r["method"]: r for r in report["inference"]}
    assert inference["lora"]["flop_overhead_pct"] == 0
    assert inference["queryable"]["flop_overhead_pct"] > 0  # routing costs FLOPs
    assert {"train_step_overhead_pct", "forward_overhead_pct"} <= set(report["overhead"][0])


@pytest.mark.parametrize("argv, word", [(["--archs", "cnn"], "cnn"), (["--methods", "lora,bogus"], "bogus")])
def test_bench_bad_input(argv, word, capsys):
    assert cli.main(["bench", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0]
