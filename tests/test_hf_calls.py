"""One forward's routes belong to that forward, whoever calls it (qlbench/hf/routing.py: the calls in progress live in
a context variable, per thread and nested call, never on the tuner or its modules). Beside peft's LoRA on the tiny
Llama, Qwen2, Mistral and GPT-2 decoders of tests/test_hf_cache.py:

- an inner module called directly gives its output, whatever was called before it;
- forwards from four threads at once give each thread what its forward gives alone;
- a forward of the model started inside another (a hook) leaves the outer one's output as it is alone;
- an attention mask given by position routes as the keyword does.

Each check fails a planted bug (`CHECKS`): the state put back on the tuner (`OWNED`), or keywords read alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_hf_cache import KINDS, METHODS, close, ids, logits, wrapped  # noqa: E402

from qlbench.hf import routing as hf_routing  # noqa: E402

THREADS = 4


def inner(model):
    """The decoder without its head: an inner module of the model the tuner wraps (its hooks are not run)."""
    top = model.base_model.model
    return getattr(top, "model", None) or top.transformer


def first_layer(model):
    decoder = inner(model)
    return (getattr(decoder, "layers", None) or decoder.h)[0]


def _owned_begin(self, state, recomputing=False, key=None):
    call = hf_routing.Call(state, recomputing, key=key)
    self.__dict__["owned"] = call
    return call


def _owned_finish(self, call):
    self.__dict__["owned"] = None


@contextlib.contextmanager
def _owned_alone(self):
    if self.__dict__.get("owned") is None:
        self.__dict__["owned"] = hf_routing.Call(hf_routing.ForwardState())
    yield  # left in place for the next call


# Planted bug: the call in progress kept on the Routing object (the tuner's), shared by every thread and never
# restored after a nested call: the state before per-call routing.
OWNED = {
    "begin": _owned_begin,
    "finish": _owned_finish,
    "alone": _owned_alone,
    "call": property(lambda self: self.__dict__.get("owned")),
}


def plant(monkeypatch):
    for name, value in OWNED.items():
        monkeypatch.setattr(hf_routing.Routing, name, value)


@torch.no_grad()
def direct_calls(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder called directly on x: first thing, and after a direct call on other tokens (same weights)."""
    x, other = ids(), ids(seed=5)
    first = inner(wrapped(kind, method))(input_ids=x).last_hidden_state
    decoder = inner(wrapped(kind, method))
    decoder(input_ids=other)
    return first, decoder(input_ids=x).last_hidden_state


def threaded(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """Each thread's logits alone (one after another) and at once: every thread waits at the first decoder layer
    until all four are inside their forwards."""
    model = wrapped(kind, method)
    inputs = [ids(seed=20 + i) for i in range(THREADS)]
    alone = [logits(model, x) for x in inputs]
    barrier = threading.Barrier(THREADS, timeout=60)

    def wait(*_):
        barrier.wait()

    hook = first_layer(model).register_forward_hook(wait)
    together: list[torch.Tensor | BaseException | None] = [None] * THREADS

    def work(i):
        try:
            together[i] = logits(model, inputs[i])
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            together[i] = err
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook.remove()
    for got in together:
        if isinstance(got, BaseException):
            raise got
    return torch.stack(alone), torch.stack(together)  # (threads, batch, T, vocab)


def nested(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a forward alone, and of the same forward while a hook on its first decoder layer runs a whole
    forward of the model on other tokens."""
    model, x = wrapped(kind, method), ids()
    alone = logits(model, x)
    running = []

    def another(*_):
        if not running:  # once: the nested forward passes this layer too
            running.append(True)
            logits(model, ids(seed=30))

    hook = first_layer(model).register_forward_hook(another)
    try:
        return alone, logits(model, x)
    finally:
        hook.remove()


def positional(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrapped transformers model called with its attention mask as a keyword and by position (left padding:
    the mask matters to the token average)."""
    model, x = wrapped(kind, method), ids()
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    top = model.base_model.model
    positions = (x, None, mask) if kind == "gpt2" else (x, mask)  # GPT-2's second argument is its cache
    with torch.no_grad():
        return top(input_ids=x, attention_mask=mask).logits, top(*positions).logits


def keywords_only(monkeypatch):
    """Planted bug: the wrapped model's arguments read from its keywords alone (a positional mask unseen)."""
    from qlbench.hf import model as hf_model

    monkeypatch.setattr(hf_model, "inputs_of", lambda module, args, kwargs: kwargs)


class Check(NamedTuple):
    pair: Callable  # (kind, method) -> (what the call gives alone, what it gives here)
    tol: float  # how close the two must be
    plant: Callable  # (monkeypatch) -> None: a bug the check must catch
    planted_tol: float  # how far apart the two are under that bug, at the least


CHECKS = {
    "direct inner call": Check(direct_calls, 1e-6, plant, 1e-4),
    "four threads": Check(threaded, 1e-5, plant, 1e-5),
    "nested forward": Check(nested, 1e-5, plant, 1e-4),
    "positional mask": Check(positional, 1e-5, keywords_only, 1e-4),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", CHECKS)
def test_a_call_routes_as_it_does_alone(check, kind, method):
    alone, here = CHECKS[check].pair(kind, method)
    assert close(alone, here, tol=CHECKS[check].tol)


@pytest.mark.parametrize("check", CHECKS)
def test_each_check_fails_its_planted_bug(check, monkeypatch):
    """Each check fails with its bug planted: a wrong output, or, where threads race on the state the bug shares, a
    forward that reads another thread's state after that thread ended it (an error: the check fails too)."""
    CHECKS[check].plant(monkeypatch)
    try:
        alone, here = CHECKS[check].pair("llama", "queryable")
    except AttributeError as err:  # a thread read the shared state as another one ended it
        assert check == "four threads" and "NoneType" in str(err), err
        return
    assert not close(alone, here, tol=CHECKS[check].planted_tol)
