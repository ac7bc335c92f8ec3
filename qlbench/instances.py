"""A benchmark protocol's instances: the pretrained backbones its baselines were made on, shipped by digest.

A method is paired with a protocol's baselines by (function, seed), and that pair means something only if both
adapted the same pretrained network. Pretraining 100 epochs on another machine (another SIMD path, another libm)
makes another network, so a protocol ships its backbones, as BBOB ships its instances and MLPerf its reference
checkpoints, and a run under the protocol loads them instead of pretraining.

    docs/protocols/<name>/backbones.pt.xz   a torch file, xz-compressed: {"members": {"<function>/<seed>":
                                            {"state", "source_train_mse", "source_test_mse", "cards"}}}
    docs/protocols/<name>/backbones.json    [{"function", "seed", "digest", "source_train_mse", "source_test_mse"}]

`digest` is a content digest of one member's weights (names, dtypes, shapes and bytes; `digest`), the manifest
lists every member's, and the protocol holds the digest of the manifest (`manifest_digest`, Benchmark.backbones), so
neither the weights nor the list can change without the protocol saying so. Every record holds its backbones'
digests (train_info.per_seed[].backbone_digest), and `compare` pairs two records only on the same digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import pickle
from pathlib import Path

import torch

from qlbench.records.store import DamagedFile, atomic_write, write_text

REPOSITORY = Path(__file__).resolve().parents[1]


ARTIFACT = "backbones.pt.xz"


def folder(protocol: str) -> Path:
    return REPOSITORY / "docs" / "protocols" / protocol


def digest(state: dict[str, torch.Tensor]) -> str:
    """The content digest of one member's weights: sha256 over each tensor's name, dtype, shape and bytes (CPU,
    contiguous, in name order), first 16 hex digits. The same weights give the same digest on any machine."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def manifest_digest(rows: list[dict]) -> str:
    """The digest of a manifest: sha256 over its sorted "function/seed:digest" lines, first 16 hex digits."""
    lines = sorted(f"{r['function']}/{r['seed']}:{r['digest']}" for r in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def export(name: str, members: dict[tuple[str, int], dict], out: Path | None = None) -> str:
    """Write a protocol's artifact and manifest from backbone-cache contents {(function, seed): saved member (the
    cache file's dict: state, source MSEs, cards)}; returns the manifest's digest (the protocol's `backbones`)."""
    out = out or folder(name)
    rows, weights = [], {}
    for (function, seed), saved in sorted(members.items()):
        state = {k: v.detach().to("cpu").contiguous() for k, v in saved["state"].items()}
        rows.append(
            {
                "function": function,
                "seed": int(seed),
                "digest": digest(state),
                "source_train_mse": float(saved["source_train_mse"]),
                "source_test_mse": float(saved["source_test_mse"]),
            }
        )
        weights[f"{function}/{seed}"] = {
            "state": state,
            "source_train_mse": float(saved["source_train_mse"]),
            "source_test_mse": float(saved["source_test_mse"]),
            "cards": saved.get("cards"),
        }
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"members": weights}, buffer)
    atomic_write(out / ARTIFACT, lambda tmp: Path(tmp).write_bytes(lzma.compress(buffer.getvalue())))
    write_text(json.dumps(rows, indent=1) + "\n", out / "backbones.json")
    return manifest_digest(rows)


def manifest(name: str, expected: str) -> dict[tuple[str, int], str]:
    """{(function, seed): digest} of a protocol's committed manifest; DamagedFile (one line) when it is missing,
    does not read, or is not the manifest the protocol names (`expected`, Benchmark.backbones)."""
    path = folder(name) / "backbones.json"
    try:
        rows = json.loads(path.read_text())
        got = manifest_digest(rows)
    except FileNotFoundError:
        raise DamagedFile(f"protocol {name} ships no backbones at {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedFile(f"{path} is damaged ({type(err).__name__}: {err})") from None
    if got != expected:
        raise DamagedFile(f"{path} is not protocol {name}'s manifest (digest {got}, the protocol's {expected})")
    return {(r["function"], int(r["seed"])): r["digest"] for r in rows}


def load(name: str, expected: str, members: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """The shipped backbones of `members` ({(function, seed): {state, source MSEs, cards, digest}}), each checked
    against the manifest's digest; DamagedFile (one line) for a member the protocol does not ship or whose weights
    are not the ones it lists."""
    digests = manifest(name, expected)
    if missing := [m for m in members if m not in digests]:
        raise DamagedFile(f"protocol {name} ships no backbone for {missing[0][0]} seed {missing[0][1]}")
    path = folder(name) / ARTIFACT
    try:
        saved = torch.load(io.BytesIO(lzma.decompress(path.read_bytes())), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DamagedFile(f"protocol {name} ships no backbones at {path}") from None
    except (OSError, lzma.LZMAError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        raise DamagedFile(f"{path} is damaged ({type(err).__name__})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("members"), dict):
        raise DamagedFile(f"{path} is damaged (not a protocol's backbones)")
    out = {}
    for f, s in members:
        one = saved["members"].get(f"{f}/{s}")
        if not isinstance(one, dict) or not isinstance(one.get("state"), dict):
            raise DamagedFile(f"{path} is damaged (no weights for {f} seed {s})")
        if (got := digest(one["state"])) != digests[(f, s)]:
            raise DamagedFile(f"{path}: {f} seed {s} has digest {got}, the manifest lists {digests[(f, s)]}")
        out[(f, s)] = one | {"digest": got}
    return out
