"""One forward's routes belong to that forward, whoever calls it (qlbench/hf/routing.py: the calls in progress live in
a context variable, per thread and nested call, never on the tuner or its modules). Beside peft's LoRA on the tiny
Llama, Qwen2, Mistral and GPT-2 decoders of tests/test_hf_cache.py:

- an inner module called directly gives its output, whatever was called before it;
- forwards from four threads at once give each thread what its forward gives alone;
- a forward of the model started inside another (a hook) leaves the outer one's output as it is alone.

Each check fails a planted bug that puts the state back on the tuner (`OWNED`)."""

from __future__ import annotations

import contextlib
import threading

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


def _owned_begin(self, state, recomputing=False):
    call = hf_routing.Call(state, recomputing)
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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_inner_module_called_directly_gives_its_own_output_whatever_ran_before(kind, method):
    first, after = direct_calls(kind, method)
    assert close(first, after, tol=1e-6)


def test_the_direct_call_check_fails_when_the_state_is_the_tuners(monkeypatch):
    plant(monkeypatch)
    first, after = direct_calls("llama", "queryable")
    assert not close(first, after, tol=1e-4)


def threaded(kind, method) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each thread's logits alone (one after another) and at once: every thread waits at the first decoder layer
    until all four are inside their forwards."""
    model = wrapped(kind, method)
    inputs = [ids(seed=20 + i) for i in range(THREADS)]
    alone = [logits(model, x) for x in inputs]
    barrier = threading.Barrier(THREADS, timeout=60)
    layers = getattr(inner(model), "layers", None) or inner(model).h

    def wait(*_):
        barrier.wait()

    hook = layers[0].register_forward_hook(wait)
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
    return alone, together


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_forwards_from_four_threads_at_once_each_give_their_own(kind, method):
    alone, together = threaded(kind, method)
    assert all(close(a, b) for a, b in zip(alone, together))


def test_the_thread_check_fails_when_the_state_is_the_tuners(monkeypatch):
    plant(monkeypatch)
    alone, together = threaded("llama", "queryable")
    assert not all(close(a, b) for a, b in zip(alone, together))


def nested(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a forward alone, and of the same forward while a hook on its first decoder layer runs a whole
    forward of the model on other tokens."""
    model, x = wrapped(kind, method), ids()
    alone = logits(model, x)
    layers = getattr(inner(model), "layers", None) or inner(model).h
    running = []

    def another(*_):
        if not running:  # once: the nested forward passes this layer too
            running.append(True)
            logits(model, ids(seed=30))

    hook = layers[0].register_forward_hook(another)
    try:
        return alone, logits(model, x)
    finally:
        hook.remove()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_started_inside_another_leaves_the_outer_one_as_alone(kind, method):
    alone, outer = nested(kind, method)
    assert close(alone, outer)


def test_the_nested_call_check_fails_when_the_state_is_the_tuners(monkeypatch):
    plant(monkeypatch)
    alone, outer = nested("llama", "queryable")
    assert not close(alone, outer, tol=1e-4)


def positional(kind, method) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrapped transformers model called with its attention mask as a keyword and by position (left padding:
    the mask matters to the token average)."""
    model, x = wrapped(kind, method), ids()
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    top = model.base_model.model
    with torch.no_grad():
        return top(input_ids=x, attention_mask=mask).logits, top(x, None, mask).logits if kind == "gpt2" else top(
            x, mask
        ).logits


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_attention_mask_given_by_position_routes_as_the_keyword_does(kind, method):
    keyword, by_position = positional(kind, method)
    assert close(keyword, by_position)


def test_the_positional_mask_check_fails_when_only_keywords_are_read(monkeypatch):
    from qlbench.hf import model as hf_model

    monkeypatch.setattr(hf_model, "inputs_of", lambda module, args, kwargs: kwargs)
    keyword, by_position = positional("llama", "queryable")
    assert not close(keyword, by_position, tol=1e-4)
