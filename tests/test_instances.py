"""A protocol ships its backbones (qlbench/instances.py): a run under it loads them and never pretrains, its records
hold each seed's backbone digest, and `compare` refuses a record trained on another network. Oracles: the committed
baselines' source MSEs (made on the machine that pretrained them) and hashlib over the raw bytes."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from qlbench import cli, compare, instances, protocols
from qlbench.engine import cache
from qlbench.records import per_seed

from helpers import one_line_error

ZOO_V1 = protocols.ZOO_V1


def test_a_digest_is_of_the_weights_not_of_their_order_or_file():
    state = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(3)}
    h = hashlib.sha256()
    for name in ("a", "b"):
        h.update(f"{name}|torch.float32|{tuple(state[name].shape)}|".encode() + state[name].numpy().tobytes())
    assert instances.digest(state) == h.hexdigest()[:16]
    assert instances.digest(dict(reversed(state.items()))) == instances.digest(state)
    flipped = {"b": state["b"].clone(), "a": state["a"]}
    flipped["b"].view(torch.int32)[0, 0] ^= 1  # one bit of one weight
    assert instances.digest(flipped) != instances.digest(state)


def test_zoo_v1_ships_the_backbones_its_baselines_were_made_on():
    """Every (function, seed) of the protocol is shipped, listed by digest under the manifest the protocol names, and
    holds the source MSEs that the committed baselines recorded for it (exactly: they are the same networks)."""
    shipped = instances.manifest(ZOO_V1.name, ZOO_V1.backbones)
    assert set(shipped) == {(f, s) for f in ZOO_V1.functions for s in ZOO_V1.seeds}
    rows = json.loads((instances.folder(ZOO_V1.name) / "backbones.json").read_text())
    base = per_seed.load(compare.baselines_file(ZOO_V1.name))
    lora = base[base["method"] == "lora"].set_index(["function", "seed"])
    for r in rows:
        want = lora.loc[(r["function"], r["seed"])]
        assert (r["source_train_mse"], r["source_test_mse"]) == (want["source_train_mse"], want["source_test_mse"])
    loaded = instances.load(ZOO_V1.name, ZOO_V1.backbones, [("matyas", 0), ("levy", 9)])
    for member, one in loaded.items():
        assert instances.digest(one["state"]) == shipped[member]


def test_a_changed_manifest_or_artifact_is_one_line(tmp_path, monkeypatch):
    copy = tmp_path / ZOO_V1.name
    shutil.copytree(instances.folder(ZOO_V1.name), copy)
    monkeypatch.setattr(instances, "folder", lambda name: tmp_path / name)
    good = (copy / "backbones.json").read_text()
    rows = json.loads(good)
    rows[0]["digest"] = "0" * 16  # planted: a manifest edited in place
    (copy / "backbones.json").write_text(json.dumps(rows))
    with pytest.raises(instances.DamagedFile, match="is not protocol zoo-v1's manifest"):
        instances.manifest(ZOO_V1.name, ZOO_V1.backbones)
    (copy / "backbones.json").write_text(good)
    with pytest.raises(instances.DamagedFile, match="ships no backbone for nowhere seed 0"):
        instances.load(ZOO_V1.name, ZOO_V1.backbones, [("nowhere", 0)])
    (copy / instances.ARTIFACT).write_bytes(b"not xz")  # planted: a damaged artifact
    with pytest.raises(instances.DamagedFile, match="is damaged"):
        instances.load(ZOO_V1.name, ZOO_V1.backbones, [("ackley", 0)])


def test_a_run_under_the_protocol_never_pretrains_and_records_the_digests(tmp_path, capsys, monkeypatch):
    """`sweep --protocol zoo-v1 --functions matyas --seeds 2 --methods lora`: no pretraining step runs (planted: the
    cache's training loop raises), each record seed holds the shipped backbone's digest and the committed baselines'
    source MSEs, and `compare` pairs it with the baselines; a record whose digest is planted otherwise is refused in
    one line naming the pair."""

    def no_pretraining(*args, **kwargs):
        raise AssertionError("pretrained under a protocol")

    monkeypatch.setattr(cache, "fit", no_pretraining)
    out = tmp_path / "results"
    argv = ["sweep", "--protocol", "zoo-v1", "--functions", "matyas", "--seeds", "2", "--methods", "lora"]
    assert cli.main([*argv, "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "under protocol zoo-v1" in printed and "1 of its 9 functions, 2 of its 10 seeds" in printed
    (path,) = (out / "records/deep-narrow/matyas/lora").glob("*.json")
    rec = json.loads(path.read_text())
    shipped = instances.manifest(ZOO_V1.name, ZOO_V1.backbones)
    base = per_seed.load(compare.baselines_file(ZOO_V1.name)).set_index(["function", "method", "seed"])
    for s in rec["train_info"]["per_seed"]:
        assert s["backbone_digest"] == shipped[("matyas", s["seed"])]
        assert s["source_train_mse"] == base.loc[("matyas", "lora", s["seed"]), "source_train_mse"]
    env = rec["run_info"]["settings"]["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] == 1 and "cpu_capability" in env
    assert cli.main(["compare", str(out)]) == 0
    capsys.readouterr()
    rec["train_info"]["per_seed"][1]["backbone_digest"] = "0123456789abcdef"  # planted: another network
    path.write_text(json.dumps(rec))
    line = one_line_error(capsys, ["compare", str(out)])
    assert "matyas seed 1 was trained on backbone 0123456789abcdef, not the protocol's" in line


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        (["--arch", "transformer"], "--arch 'transformer' contradicts protocol zoo-v1 ('deep-narrow')"),
        (["--budget", "smoke"], "--budget 'smoke' contradicts protocol zoo-v1 ('quick')"),
        (["--backbone-init", "default"], "--backbone-init 'default' contradicts protocol zoo-v1 ('kaiming')"),
        (["--seeds", "11"], "--seeds 11: protocol zoo-v1 has seeds 0-9"),
        (["--protocol", "zoo-v0"], "unknown protocol 'zoo-v0'; valid: zoo-v1"),
    ],
)
def test_an_option_that_contradicts_the_protocol_is_refused_before_any_work(extra, phrase, tmp_path, capsys):
    argv = ["run", "--protocol", "zoo-v1", "--function", "matyas", "--methods", "lora", "--out", str(tmp_path / "o")]
    line = one_line_error(capsys, [*argv, *extra])
    assert phrase in line
    assert not (tmp_path / "o").exists()


def test_a_function_outside_the_protocol_is_refused(tmp_path, capsys):
    argv = ["sweep", "--protocol", "zoo-v1", "--functions", "matyas,rosenbrock", "--out", str(tmp_path / "o")]
    line = one_line_error(capsys, argv)
    assert "rosenbrock" in line and not (tmp_path / "o").exists()


def test_a_backbone_this_machine_pretrained_otherwise_is_said_and_set_aside(tmp_path):
    """A results folder whose cache already holds another network for a member (pretrained by other code, or on a
    machine whose floating-point paths differ): one line says so, the file is set aside, the shipped one is used."""
    from qlbench.commands.run import install_backbones
    from qlbench.experiments import experiment
    from qlbench.settings import Execution, Protocol

    settings = Protocol(**ZOO_V1.run_settings(), seeds=2)
    p = experiment.plan(["matyas"], ["lora"], protocol=settings, execution=Execution(out_dir=tmp_path))
    said = []
    install_backbones(ZOO_V1, p, said.append)
    assert said == [] and not p.pretrain_needed([("matyas", 0), ("matyas", 1)])
    (path,) = [q for q in p.store.backbone_dir.glob("*seed1-*.pt")]
    saved = torch.load(path, weights_only=False)
    saved["state"] = {k: v * (1 + 1e-6) for k, v in saved["state"].items()}  # planted: another machine's network
    torch.save(saved, path)
    install_backbones(ZOO_V1, p, said.append)
    assert len(said) == 1 and "1 backbone(s)" in said[0] and "matyas seed 1" in said[0] and "set aside" in said[0]
    shipped = instances.manifest(ZOO_V1.name, ZOO_V1.backbones)[("matyas", 1)]
    assert instances.digest(torch.load(path, weights_only=False)["state"]) == shipped
