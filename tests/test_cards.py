"""A card edited in place is found out (zoo.card_digest, suites.cards): a finished record made from another version
of its card is refused in one line before any training (experiments/runner.py), a cached backbone pretrained on another
version is set aside and retrained (engine/cache.py), and `compare` refuses a record made from another version than
the protocol's (protocols.py)."""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.resources import files

import pytest

from qlbench import cli, engine, protocols, suites, zoo
from qlbench.engine.budgets import budget
from qlbench.records.store import Store

from helpers import one_line_error

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

pytestmark = pytest.mark.xdist_group("cards")


def shipped(name: str) -> str:
    return (files("qlbench.functions") / f"{name}.toml").read_text(encoding="utf-8")


@pytest.fixture
def edit_card(monkeypatch):
    """edit_card(name, old, new): the installed card `name` with its text `old` replaced by `new`, for this test."""
    texts = dict(zoo._texts())

    def edit(name: str, old: str, new: str) -> None:
        assert old in texts[name]
        texts[name] = texts[name].replace(old, new)
        monkeypatch.setattr(zoo, "_texts", lambda: texts)
        zoo._cards.cache_clear()

    yield edit
    zoo._cards.cache_clear()


def plain_digest(name: str) -> str:
    """The digest from the paper's side of it: sha256 over the canonical JSON of the card's data tables."""
    table = tomllib.loads(zoo._texts()[name])
    data = {k: table.get(k) for k in ("family", "instruction", "adversarial_instruction", "domain", "coefficients",
                                      "target")}  # fmt: skip
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_the_digest_follows_the_data_fields_and_nothing_else(edit_card):
    before = {n: zoo.card_digest(n) for n in zoo.names()}
    assert before == {n: plain_digest(n) for n in zoo.names()}
    assert len(set(before.values())) == len(before)
    edit_card("matyas", 'display_name = "Matyas"', 'display_name = "Matyas (renamed)"')
    edit_card("matyas", "[coefficients]", "# a comment\n[coefficients]")
    assert zoo.card_digest("matyas") == before["matyas"]  # descriptive fields and layout change no number
    edit_card("matyas", "rotation_deg = 15.0", "rotation_deg = 16.0")
    assert zoo.card_digest("matyas") != before["matyas"]


def test_a_suite_names_its_own_card_and_the_function_cards_it_uses(edit_card):
    before = suites.cards("zoo-4")
    assert set(before) == {"suite zoo-4", "ackley", "dropwave", "matyas", "sin-cos", "styblinski-tang"}
    edit_card("matyas", "rotation_deg = 15.0", "rotation_deg = 16.0")
    after = suites.cards("zoo-4")
    assert [n for n in before if before[n] != after[n]] == ["matyas"]


def test_zoo_v1_pins_the_cards_as_shipped():
    """zoo-v1's baselines were made from these cards: a card edited without a new protocol fails here."""
    assert dict(protocols.ZOO_V1.cards) == {n: plain_digest(n) for n in zoo.names()}


def test_an_edited_instruction_refuses_the_record_made_before(tmp_path, capsys, edit_card):
    out = tmp_path / "results"
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "lora", "--seeds", "1", "--threads", "1",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    (record,) = (out / "records/deep-narrow/matyas/lora").glob("*.json")
    assert json.loads(record.read_text())["run_info"]["settings"]["cards"] == {"matyas": zoo.card_digest("matyas")}
    assert cli.main(argv) == 0  # the same card: skipped
    assert "already have a finished record" in capsys.readouterr().err
    before = record.read_bytes()
    edit_card("matyas", 'instruction = "', 'instruction = "Edited: ')
    line = one_line_error(capsys, argv)
    assert f"{record} was made from another version of card matyas than the installed one" in line
    assert "--force" in line and record.read_bytes() == before  # refused before any work: nothing replaced
    assert cli.main([*argv, "--force"]) == 0
    capsys.readouterr()
    after = json.loads(record.read_text())
    assert after["run_info"]["settings"]["cards"] == {"matyas": zoo.card_digest("matyas")}
    assert zoo.card_digest("matyas") != json.loads(before)["run_info"]["settings"]["cards"]["matyas"]


def test_a_backbone_of_another_card_version_is_retrained(tmp_path, edit_card):
    spec = engine.Backbones("deep-narrow", budget("smoke", "deep-narrow").pretrain)
    store, members, said = Store(tmp_path), [("matyas", 0)], []
    first = engine.pretrain(spec, members, device="cpu", store=store, log=said.append)
    (path,) = store.backbone_dir.glob("*.pt")
    engine.pretrain(spec, members, device="cpu", store=store, log=said.append)
    assert said == []  # the same card: loaded
    edit_card("matyas", "rotation_deg = 15.0", "rotation_deg = 16.0")
    again = engine.pretrain(spec, members, device="cpu", store=store, log=said.append)
    (line,) = said
    assert line.startswith(f"{path} is out of date (pretrained on another version of card matyas)")
    assert "retraining that backbone" in line and path.exists()
    assert all((first.state[k] == again.state[k]).all() for k in first.state)  # the source is the same here


def test_compare_refuses_a_record_of_another_card_version():
    p = protocols.ZOO_V1
    config = {"backbone_init": "kaiming", "noise": "relative", "function": "levy", "arch": "deep-narrow",
              "budget": p.budget_fields() | {"seeds": 10}, "seeds": [0], "dtype": "float32"}  # fmt: skip
    assert p.differences(config, None) == []  # a record written before records held their cards
    assert p.differences(config, {"levy": zoo.card_digest("levy")}) == []
    assert p.differences(config, {"levy": "0" * 16}) == ["another version of card levy than the protocol's"]
    assert protocols.of_config(config, {"levy": "0" * 16}) is None
