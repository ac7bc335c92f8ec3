"""Why does routing help? Diagnostics on problems small enough to see whole (`qlbench diagnose`, `qlbench signal`,
the gradient section of `qlbench report`, notebooks/03_routing.ipynb).

Three families, all returning data (figures: qlbench.report; printing and files: qlbench.commands):

1. Gradient concentration (recorded during training, qlbench/gradients.py): per (cell, seed) the concentration
   index max / mean of the per-layer adapter gradient norms, averaged over the recorded epochs, and its paired
   comparison with LoRA (`concentration_per_seed`, `compare_concentration`).
2. Routing of a trained queryable / instruct-queryable cell (`load_cell`, `capture_routes`): the routing weights
   alpha (E, B, N, M) of every block over the target test set or a grid over the input plane, read from the
   model's own forward (ctx.scratch["queryable"].routes[block].alpha), and what they show: atom usage per block,
   route entropy, usage entropy, per-atom usage entropy across blocks, input dependence, dominant-atom maps.
3. Signal propagation (`signal_profile`): the spread across inputs of each hidden feature, layer by layer, of a
   backbone at initialisation and after pretraining.

qlbench interpretations:
- Atom usage of block b = the mean routing weight of each atom over the inputs, usage_b = mean_n alpha_{b,n}
  (sums to 1); its selection rate is the share of inputs whose top-k contains the atom (sums to k).
- Route entropy = mean over inputs of H(alpha_{b,n}) (<= log k: how evenly a route mixes its k atoms); usage
  entropy = H(usage_b) (<= log M; exp of it is the effective number of atoms a block uses).
- Input dependence of block b = mean over inputs of the total-variation distance between the input's route and the
  block's mean route, mean_n ||alpha_{b,n} - usage_b||_1 / 2, in [0, 1): 0 when every input gets the same route
  (a static adapter's situation).
- Per-atom usage entropy: the paper measures it across tasks that share one memory. In qlbench every (function,
  seed) member owns its memory, so atom m of one function's model is not atom m of another's and an entropy
  across functions has no object; qlbench measures each atom's usage entropy across the B blocks of its own model
  (H(usage_{., m} / sum_b usage_{b, m}) <= log B: high = reused across depth, low = specialised to one block), the
  reuse across depth that the paper's shared memory is for. NaN for an atom no block uses.
- Spread of a layer = mean over the layer's features of the standard deviation (population) of the feature across
  the inputs (the target test set); a constant network has spread 0 from some layer on.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from qlbench import adapters, engine, inputs, zoo
from qlbench.adapters import queryable
from qlbench.backbones import build_backbone, check_init
from qlbench.experiments import adapted
from qlbench.metrics import stats
from qlbench.records import results
from qlbench.records.store import Store
from qlbench.settings import Protocol
from qlbench.stacked import ForwardContext

ROUTED = adapters.of_family("queryable")  # methods routed over shared atoms (the route maps read their atoms)
GRADIENT_METHODS = (adapters.BASELINE, *ROUTED)  # the paper's gradient comparison: LoRA against the routed adapters

# --------------------------------------------------------------------------------------------------------------
# 1. Gradient concentration.


def concentration_per_seed(grads: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, seed) of `results.load_gradients`: concentration (the index averaged over the recorded
    epochs where it is finite), final_concentration (at the last recorded epoch), epochs (how many it averages),
    mean_norm (per-layer norm averaged over layers and epochs) and status (the seed's)."""
    keys = [*results.CELL_COLUMNS, "seed"]
    summary = results.gradients_summary(grads)
    status = grads.drop_duplicates(keys).set_index(keys)["status"]
    rows = []
    for key, g in summary.groupby(keys, sort=False):
        g = g.sort_values("epoch")
        finite = g[np.isfinite(g["concentration"])]
        rows.append(
            {
                **dict(zip(keys, key)),
                "status": status.loc[key],
                "concentration": finite["concentration"].mean() if len(finite) else math.nan,
                "final_concentration": g["concentration"].iloc[-1],
                "epochs": len(finite),
                "mean_norm": g["mean_norm"].mean(),
            }
        )
    columns = [*keys, "status", "concentration", "final_concentration", "epochs", "mean_norm"]
    return pd.DataFrame(rows, columns=columns)


def compare_concentration(per_seed: pd.DataFrame, baseline: str = adapters.BASELINE, column: str = "concentration"):
    """Per (arch, budget, backbone_init, function, method): mean ± std of `column` over seeds and the paired test
    against `baseline` on the same seeds (stats.paired_test; "win" = a lower index, i.e. less concentrated).
    A seed missing on either side drops out of the pair. One (arch, budget, backbone_init) is one table, whose
    comparisons (every function x method against the baseline) are one family, as in `stats.compare`: p_holm is p
    Holm-adjusted over it (`stats.holm`), and `outcome` is decided on p_holm (a raw win or loss whose p_holm is not
    below stats.ALPHA is a tie). Columns: the cell keys, method, n, mean, std, baseline_mean, mean_diff, ci_low,
    ci_high, t_p, wilcoxon_p, p, p_holm, outcome (NaN from mean_diff on for the baseline's own rows)."""
    keys = ["arch", "budget", "backbone_init", "function"]
    rows = []
    for key, cell in per_seed.groupby(keys, sort=True):
        base = cell[cell["method"] == baseline].set_index("seed")[column]
        for method in stats.method_order(cell["method"]):
            values = cell[cell["method"] == method].set_index("seed")[column].dropna()
            row = {**dict(zip(keys, key)), "method": method, "n": len(values), "mean": values.mean()}
            row["std"] = values.std(ddof=1) if len(values) > 1 else math.nan
            row["baseline_mean"] = base.mean() if len(base) else math.nan
            seeds = sorted(set(values.index) & set(base.dropna().index))
            if method != baseline and seeds:
                test = stats.paired_test(values.loc[seeds].to_numpy(), base.loc[seeds].to_numpy())
                row |= {k: test[k] for k in ("mean_diff", "ci_low", "ci_high", "t_p", "wilcoxon_p", "p", "outcome")}
            rows.append(row)
    columns = [*keys, "method", "n", "mean", "std", "baseline_mean"]
    columns += ["mean_diff", "ci_low", "ci_high", "t_p", "wilcoxon_p", "p", "p_holm", "outcome"]
    out = pd.DataFrame(rows, columns=columns)
    out["p_holm"] = out.groupby(keys[:3])["p"].transform(stats.holm)  # one table: NaN (no test) stays out
    claims = out["outcome"].isin(["win", "loss"]) & ~(out["p_holm"] < stats.ALPHA)  # p_holm >= p: fewer claims
    out["outcome"] = out["outcome"].mask(claims, "tie")
    return out


# --------------------------------------------------------------------------------------------------------------
# 2. Routing of a trained cell.


def find_cell(
    root: Path,
    function: str,
    method: str,
    *,
    arch: str | None = None,
    budget: str | None = None,
    backbone_init: str | None = None,
) -> Path:
    """The newest finished record of (function, method) under a results folder; arch, budget and backbone init may
    be left out when only one cell matches. ValueError (one line, with the choices) otherwise."""
    zoo.card(function)  # ValueError naming the valid functions
    inputs.folder(root, "results folder")
    index = results.index(root, on_damaged=lambda message: None)
    if len(index):
        index = index[(index["function"] == function) & (index["method"] == method) & (index["status"] != "failed")]
    for column, value in (("arch", arch), ("budget", budget), ("backbone_init", backbone_init)):
        if value is not None and len(index):
            index = index[index[column] == value]
    if index.empty:
        have = sorted(set(results.index(root, on_damaged=lambda m: None).get("method", [])))
        raise ValueError(
            f"no finished {method} record for {function} (arch={arch or 'any'}, budget={budget or 'any'}, "
            f"backbone init={backbone_init or 'any'}) under {Path(root) / 'records'}"
            + (f"; methods there: {', '.join(have)}" if have else "")
        )
    cells = index[["arch", "budget", "backbone_init"]].drop_duplicates()
    if len(cells) > 1:
        choices = "; ".join(f"--arch {a} --budget {b} --backbone-init {i}" for a, b, i in cells.itertuples(index=False))
        raise ValueError(f"several {method} cells for {function} under {root}: choose one of {choices}")
    return Path(max(index["record"], key=lambda r: Path(r).stat().st_mtime_ns))


def load_cell(record: Path, device: str = "cpu"):
    """(model, target data, record) of a trained routed cell (adapted.load_adapted), model in eval mode;
    ValueError when the record is not a queryable / instruct-queryable cell or cannot be rebuilt."""
    rec = results.read_record(record)
    method = rec["run_info"]["config"]["method"]
    if method not in ROUTED:
        raise ValueError(f"{record} is a {method} record; routing diagnostics need one of {', '.join(ROUTED)}")
    try:
        model, data, rec = adapted.load_adapted(record, device=device)
    except (FileNotFoundError, KeyError) as err:
        raise ValueError(f"cannot rebuild the trained cell from {record}: {err}") from None
    return model.eval(), data, rec


@torch.no_grad()
def capture_routes(model: torch.nn.Module, x: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model's own forward on x (E, N, 2) in chunks and read every block's routing weights from
    ctx.scratch["queryable"].routes. Returns alpha (E, B, N, M) and the predictions (E, N). A member routes with
    its bound instruction (instruct-queryable)."""
    alphas, preds = [], []
    for i in range(0, x.shape[1], chunk):
        ctx = ForwardContext(model.shared)
        preds.append(model(x[:, i : i + chunk], None, ctx=ctx))  # (E, n)
        routes = ctx.scratch[queryable.NAME].routes
        alphas.append(torch.stack([routes[b].alpha for b in sorted(routes)], dim=1))  # (E, B, n, M)
    return torch.cat(alphas, dim=2), torch.cat(preds, dim=1)


def _entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy in nats along `dim`, 0 log 0 = 0."""
    return 0.0 - torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum(dim)  # no -0.0


def route_stats(alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the routing weights alpha (E, B, N, M) show (module docstring): usage (E, B, M), selection (E, B, M),
    route_entropy (E, B), usage_entropy (E, B), effective_atoms (E, B), input_dependence (E, B) and
    atom_block_entropy (E, M)."""
    alpha = alpha.to(torch.float64)
    usage = alpha.mean(2)  # (E, B, M)
    per_atom = usage / usage.sum(1, keepdim=True)  # (E, B, M): each atom's usage over the blocks
    used = usage.sum(1) > 0  # (E, M)
    return {
        "usage": usage,
        "selection": (alpha > 0).to(torch.float64).mean(2),
        "route_entropy": _entropy(alpha).mean(2),
        "usage_entropy": _entropy(usage),
        "effective_atoms": _entropy(usage).exp(),
        "input_dependence": (alpha - usage.unsqueeze(2)).abs().sum(-1).mean(2) / 2,
        "atom_block_entropy": torch.where(used, _entropy(per_atom.nan_to_num(0.0), dim=1), torch.nan),
    }


def block_table(stats_: dict[str, torch.Tensor], seeds: list[int]) -> pd.DataFrame:
    """One row per (seed, block): route entropy, usage entropy, effective atoms, input dependence and the usage of
    every atom (columns atom 0 .. M-1)."""
    E, B, M = stats_["usage"].shape
    rows = []
    for e in range(E):
        for b in range(B):
            row = {"seed": seeds[e], "block": b}
            for k in ("route_entropy", "usage_entropy", "effective_atoms", "input_dependence"):
                row[k] = float(stats_[k][e, b])
            row |= {f"atom {m}": float(stats_["usage"][e, b, m]) for m in range(M)}
            rows.append(row)
    return pd.DataFrame(rows)


def grid(function: str, n: int = 101, *, dtype=torch.float32) -> torch.Tensor:
    """An n x n grid over the function's input box, (n, n, 2), x along columns and y along rows."""
    lo, hi = zoo.task(function).bounds  # (2,), (2,)
    t = torch.linspace(0, 1, n, dtype=torch.float64)
    return (lo + (hi - lo) * torch.stack(torch.meshgrid(t, t, indexing="xy"), dim=-1)).to(dtype)


def route_maps(model: torch.nn.Module, function: str, n: int = 101) -> dict[str, torch.Tensor]:
    """The routes over an n x n grid of the input plane: grid (n, n, 2), alpha (E, B, n, n, M), dominant atom
    (E, B, n, n) (argmax of alpha; the lower index on a tie), prediction (E, n, n) and the target surface (n, n)."""
    p = next(model.parameters())
    xy = grid(function, n)  # (n, n, 2)
    E = p.shape[0]
    x = xy.reshape(1, n * n, 2).expand(E, n * n, 2).to(p)
    alpha, pred = capture_routes(model, x)  # (E, B, n n, M), (E, n n)
    alpha = alpha.reshape(E, alpha.shape[1], n, n, alpha.shape[-1]).cpu()
    return {
        "grid": xy.to(torch.float64),
        "alpha": alpha,
        "dominant": alpha.argmax(-1),
        "prediction": pred.reshape(E, n, n).cpu(),
        "target": zoo.task(function).target(xy.to(torch.float64)),
    }


# --------------------------------------------------------------------------------------------------------------
# 3. Signal propagation through a backbone.


def spread(features: list[torch.Tensor]) -> torch.Tensor:
    """Per layer, the mean over features of the std across inputs: features [(E, N, F)] -> (E, len(features))."""
    return torch.stack([h.to(torch.float64).std(dim=1, unbiased=False).mean(-1) for h in features], dim=1)


def signal_profile(
    function: str,
    inits: list[str],
    protocol: Protocol,
    *,
    store: Store | None = None,
    device: str = "cpu",
    pretrained: bool = True,
    progress=None,
    log=lambda message: None,
) -> pd.DataFrame:
    """The spread of every hidden layer's features over the target test inputs, for each backbone init, at
    initialisation and (pretrained=True) after the budget's pretraining (from the store's cache; trained and
    cached when missing). One row per (init, stage, seed, layer): arch, function, budget, init, stage
    ("init" | "pretrained"), seed, layer (0 = after the input layer; deep-narrow: l = after hidden layer l),
    spread. The protocol gives the arch, the budget and the seeds (its backbone init is not read: `inits` are)."""
    arch, budget, b = protocol.arch, protocol.budget, protocol.schedule
    for init in inits:
        check_init(arch, init)
    zoo.card(function)
    members = [(function, s) for s in protocol.seed_list]
    dev = engine.resolve_device(device)
    x = engine.StackedData.build(members, "target", device=dev, dtype=torch.float32).x_test  # (E, 800, 2)
    rows = []
    for init in inits:
        models = {"init": build_backbone(arch, members, device=dev, init=init)}
        if pretrained:
            spec = engine.Backbones(arch, b.pretrain, init=init)
            pre = engine.pretrain(spec, members, device=dev, store=store, progress=progress, log=log)
            models["pretrained"] = pre.model(device=dev, dtype=torch.float32)
        for stage, model in models.items():
            with torch.no_grad():
                s = spread(model.features(x))  # (E, L + 1)
            for e, (_, seed) in enumerate(members):
                rows += [
                    {
                        "arch": arch,
                        "function": function,
                        "budget": budget,
                        "init": init,
                        "stage": stage,
                        "seed": seed,
                        "layer": layer,
                        "spread": float(v),
                    }
                    for layer, v in enumerate(s[e])
                ]
    return pd.DataFrame(rows)
