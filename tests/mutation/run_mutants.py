"""Mutation check of the theorem suite and the router oracle: do `pytest tests/properties tests/test_router_oracle.py`
catch deliberate router bugs?

    python tests/mutation/run_mutants.py             # every mutant, one at a time, then the table and the kill rate
    python tests/mutation/run_mutants.py --jobs 2    # two mutants at once (one repo copy per worker)
    python tests/mutation/run_mutants.py --only gate_without_sigmoid S_transposed
    python tests/mutation/run_mutants.py --list

Each mutant is (name, file, exact original snippet, mutated snippet). The repository is copied to a temp folder, the
copy is patched (one mutant at a time; the snippet must occur exactly once, so this list breaks loudly when the code
moves on), and `python -m pytest tests/properties tests/test_router_oracle.py -x -q -p no:cacheprovider` runs in the
copy with PYTHONPATH pointing at it (checked: the copy's qlbench, router and adapter are the ones imported, and the
unpatched copy passes). A mutant is killed when the suite fails. The theorem suite runs first, so a mutant whose first
failing test is in test_router_oracle.py passed every theorem check (only the oracle sees it). Equivalent mutants
(same function by one of the paper's lemmas) are run too, but left out of the kill rate. Not collected by pytest
(tests/mutation/conftest.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROUTING = "qlbench/adapters/routing.py"
QUERYABLE = "qlbench/adapters/queryable.py"
TARGET_RATE = 0.9
# the theorem checks, then the independent oracle of Algorithm 2 (whole-model outputs against a loop re-computation)
SUITE = ["tests/properties", "tests/test_router_oracle.py"]
TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    equivalent: str = ""  # why the mutant computes the same function (then it is not counted)


MUTANTS = [
    # RMSNorm (paper Assumption 3: x / sqrt(mean(x^2) + eps))
    Mutant("rmsnorm_dropped", ROUTING, "return F.rms_norm(x, x.shape[-1:], eps=eps)", "return x"),
    Mutant(
        "rmsnorm_eps_outside_sqrt",
        ROUTING,
        "return F.rms_norm(x, x.shape[-1:], eps=eps)",
        "return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)",
    ),
    Mutant(
        "rmsnorm_sum_not_mean",
        ROUTING,
        "return F.rms_norm(x, x.shape[-1:], eps=eps)",
        "return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)",
    ),
    # state / language logits <RMSNorm(a), RMSNorm(k_m)> / (sqrt(d_k) T)
    Mutant(
        "similarity_temperature_multiplied",
        ROUTING,
        "rmsnorm(b, eps).transpose(-1, -2) / (math.sqrt(d_k) * temperature)",
        "rmsnorm(b, eps).transpose(-1, -2) * temperature / math.sqrt(d_k)",
    ),
    Mutant(
        "similarity_missing_sqrt_dk",
        ROUTING,
        "rmsnorm(b, eps).transpose(-1, -2) / (math.sqrt(d_k) * temperature)",
        "rmsnorm(b, eps).transpose(-1, -2) / temperature",
    ),
    Mutant(
        "keys_not_normalised",
        ROUTING,
        "rmsnorm(a, eps) @ rmsnorm(b, eps).transpose(-1, -2)",
        "rmsnorm(a, eps) @ b.transpose(-1, -2)",
    ),
    Mutant(
        "language_prior_uses_t_attn",
        ROUTING,
        "R_ctx.transpose(1, 2), keys, t_lang, eps)",
        "R_ctx.transpose(1, 2), keys, t_attn, eps)",
    ),
    # fusion zeta + tau_lang log p
    Mutant(
        "prior_softmax_not_log_softmax",
        ROUTING,
        "logits = zeta + tau_lang * rho.log_softmax(dim=-1)",
        "logits = zeta + tau_lang * rho.softmax(dim=-1)",
    ),
    Mutant(
        "tau_lang_on_raw_rho",
        ROUTING,
        "logits = zeta + tau_lang * rho.log_softmax(dim=-1)",
        "logits = zeta + tau_lang * rho",
        equivalent="lem:app_equivalent_raw_logit_fusion: zeta + tau rho differs from zeta + tau log p by a "
        "constant per row, so top-k set, weights and gradients are unchanged",
    ),
    # top-k router
    Mutant("softmax_over_all_atoms", ROUTING, "alpha = topk_softmax(logits, top_k)", "alpha = logits.softmax(dim=-1)"),
    Mutant(
        "topk_smallest",
        ROUTING,
        "top, idx = logits.topk(k, dim=-1)",
        "top, idx = logits.topk(k, dim=-1, largest=False)",
    ),
    # pre-query q0 = w + Q_cur s_entry + lambda_ctx Q_ctx e(c)
    Mutant(
        "block_prior_dropped",
        ROUTING,
        "q0 = w.unsqueeze(1) + s_entry @ Q_cur.transpose(1, 2)",
        "q0 = s_entry @ Q_cur.transpose(1, 2)",
    ),
    # depth summary and query
    Mutant("depth_temperature_multiplied", ROUTING, "/ (math.sqrt(d_k) * t_dep)", "* t_dep / math.sqrt(d_k)"),
    Mutant(
        "depth_query_not_normalised",
        ROUTING,
        "q_hat = rmsnorm(q0 @ Q_dep_q.transpose(1, 2), eps)",
        "q_hat = q0 @ Q_dep_q.transpose(1, 2)",
    ),
    Mutant(
        "beta_from_block_prior_only",
        ROUTING,
        "u, beta = depth_summary(q0, summaries,",
        "u, beta = depth_summary(w.unsqueeze(1).expand_as(q0), summaries,",
    ),
    Mutant(
        "depth_summary_through_Q_cur",
        ROUTING,
        "q = q0 + u @ Q_dep.transpose(1, 2)",
        "q = q0 + u @ Q_cur.transpose(1, 2)",
    ),
    Mutant("depth_summary_dropped", ROUTING, "q = q0 + u @ Q_dep.transpose(1, 2)", "q = q0"),
    Mutant(
        "depth_attention_uniform",
        ROUTING,
        "beta = xi.softmax(dim=-1)",
        "beta = torch.full_like(xi, 1.0 / P)",
    ),
    Mutant(
        "instruction_after_depth_attention",
        ROUTING,
        """    if lambda_ctx:
        q0 = q0 + lambda_ctx * (instruction @ Q_ctx.transpose(1, 2))  # + (E, 1 or N, d_k)
    u = beta = None
    q = q0
    if summaries is not None and Q_dep_q is None:  # one earlier block (the peft tuner at B = 2 has no Q_dep_q, Q_dep_k)
        if summaries.shape[2] != 1:
            raise ValueError(
                f"a router without Q_dep_q and Q_dep_k attends over one earlier block, not {summaries.shape[2]}"
            )
        u, beta = summaries[:, :, 0], summaries.new_ones(summaries.shape[:3])  # a softmax over one item is 1
    elif summaries is not None:
        u, beta = depth_summary(q0, summaries, Q_dep_q, Q_dep_k, t_dep, eps)
    if summaries is not None:
        q = q0 + u @ Q_dep.transpose(1, 2)  # (E, N, d_k)
""",
        """    u = beta = None
    q = q0
    if summaries is not None and Q_dep_q is None:  # one earlier block (the peft tuner at B = 2 has no Q_dep_q, Q_dep_k)
        if summaries.shape[2] != 1:
            raise ValueError(
                f"a router without Q_dep_q and Q_dep_k attends over one earlier block, not {summaries.shape[2]}"
            )
        u, beta = summaries[:, :, 0], summaries.new_ones(summaries.shape[:3])  # a softmax over one item is 1
    elif summaries is not None:
        u, beta = depth_summary(q0, summaries, Q_dep_q, Q_dep_k, t_dep, eps)
    if summaries is not None:
        q = q0 + u @ Q_dep.transpose(1, 2)  # (E, N, d_k)
    if lambda_ctx:
        q = q + lambda_ctx * (instruction @ Q_ctx.transpose(1, 2))  # + (E, 1 or N, d_k)
""",
    ),
    Mutant(
        "instruction_ignores_lambda_ctx",
        ROUTING,
        "q0 = q0 + lambda_ctx * (instruction @ Q_ctx.transpose(1, 2))",
        "q0 = q0 + (instruction @ Q_ctx.transpose(1, 2))",
    ),
    Mutant(
        "summary_only_last_block",
        QUERYABLE,
        "for i in range(block)], dim=2)",
        "for i in range(block - 1, block)], dim=2)",
    ),
    Mutant(
        "summary_sum_not_mean", QUERYABLE, "torch.stack(self.states[i]).mean(0)", "torch.stack(self.states[i]).sum(0)"
    ),
    # the adapted layer s B (I + g S_b) A
    Mutant(
        "gate_without_sigmoid", QUERYABLE, "g = memberwise(torch.sigmoid, self.queryable_eta)", "g = self.queryable_eta"
    ),
    Mutant(
        "gate_gradient_dropped",
        QUERYABLE,
        "grad_g = (grad_t * u_t).sum((1, 2)) if need[3] else None",
        "grad_g = None",
    ),
    # S s per sample in the eager RoutedLinear node (S stored samples-last as S_t (E, r, r, N)): S^T s instead
    Mutant(
        "S_transposed",
        QUERYABLE,
        "u_t = (S_t * s_t.unsqueeze(1)).sum(2)",
        "u_t = (S_t * s_t.unsqueeze(2)).sum(1)",
    ),
    # the same in RoutedLinearDense, CUDA's node (S stored (E, N, r, r))
    Mutant(
        "S_transposed_dense",
        QUERYABLE,
        "u = torch.bmm(S.view(E * N, r, r), s.reshape(E * N, r, 1))",
        "u = torch.bmm(S.view(E * N, r, r).transpose(1, 2), s.reshape(E * N, r, 1))",
    ),
    Mutant(
        "S_transposed_tokens",
        QUERYABLE,
        "t = s + g * (s @ S.transpose(-1, -2))",
        "t = s + g * (s @ S)",
    ),
]

IGNORE = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.egg-info",
    ".hypothesis",
    ".pytest_cache",
    "results",
    "notebooks",
    "figures",
    ".venv",
    "*.pt",
)


def copy_repo(dest: Path) -> Path:
    root = dest / "repo"
    shutil.copytree(REPO, root, ignore=IGNORE)
    return root


def env_for(root: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(root),
        HYPOTHESIS_PROFILE=env.get("HYPOTHESIS_PROFILE", "ci"),
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def check_imports(root: Path) -> None:
    """The copy's modules, not the editable install's, are the ones imported."""
    code = (
        "import qlbench, qlbench.adapters.routing as r, qlbench.adapters.queryable as q, qlbench.theory as t; "
        "print(qlbench.__file__); print(r.__file__); print(q.__file__); print(t.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env_for(root), capture_output=True, text=True, check=True
    ).stdout.split()
    bad = [p for p in out if not Path(p).resolve().is_relative_to(root.resolve())]
    if bad:
        raise SystemExit(f"the copy is not what gets imported: {bad}")


def run_suite(root: Path) -> tuple[bool, str, float]:
    """(passed, first failing test or error, seconds)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", *SUITE, "-x", "-q", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {TIMEOUT_S} s", time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    header = re.search(r"qlbench under test: (\S+)", out)
    if header and not Path(header.group(1)).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"pytest imported {header.group(1)}, not the copy {root}")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    first = failed[0].split("/")[-1] if failed else ("" if proc.returncode == 0 else out.strip().splitlines()[-1])
    return proc.returncode == 0, first, time.perf_counter() - t0


def apply(root: Path, m: Mutant) -> str:
    path = root / m.file
    text = path.read_text()
    n = text.count(m.original)
    if n != 1:
        raise SystemExit(f"mutant {m.name}: the original snippet occurs {n} times in {m.file}; update the list")
    path.write_text(text.replace(m.original, m.mutated))
    return text


def worker(mutants: list[Mutant], results: dict, log) -> None:
    with tempfile.TemporaryDirectory(prefix="qlbench-mutants-") as tmp:
        root = copy_repo(Path(tmp))
        check_imports(root)
        for m in mutants:
            original = apply(root, m)
            try:
                passed, first, secs = run_suite(root)
            finally:
                (root / m.file).write_text(original)
            results[m.name] = (not passed, first, secs)
            log(f"{m.name}: {'killed' if not passed else 'SURVIVED'} ({secs:.0f} s) {first}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(mutants) != len(set(args.only)):
        raise SystemExit(f"unknown mutant(s); valid: {', '.join(m.name for m in MUTANTS)}")
    if args.list:
        for m in MUTANTS:
            print(
                f"{m.name:36s} {m.file:32s} {m.original!r} -> {m.mutated!r}" + (" [equivalent]" if m.equivalent else "")
            )
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="qlbench-mutants-") as tmp:  # the unpatched copy must pass
        root = copy_repo(Path(tmp))
        check_imports(root)
        passed, first, secs = run_suite(root)
        if not passed:
            raise SystemExit(f"the unpatched suite fails in the copy ({first}); fix that first")
        log(f"baseline: unpatched copy passes ({secs:.0f} s); qlbench imported from the copy")
    results: dict[str, tuple[bool, str, float]] = {}
    jobs = max(1, min(args.jobs, len(mutants)))
    shards = [mutants[i::jobs] for i in range(jobs)]
    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(worker, s, results, log) for s in shards]:
            f.result()
    rows = []
    for m in mutants:
        killed, first, secs = results[m.name]
        status = (
            ("equivalent (killed!)" if killed else "equivalent")
            if m.equivalent
            else ("killed" if killed else "SURVIVED")
        )
        rows.append((m.name, m.file.rsplit("/", 1)[-1], status, first or "-", f"{secs:.0f}"))
    head = ("mutant", "file", "status", "first failing test", "s")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |")
    counted = [m for m in mutants if not m.equivalent]
    killed = sum(results[m.name][0] for m in counted)
    rate = killed / len(counted) if counted else 1.0
    print(
        f"\nkill rate: {killed}/{len(counted)} = {rate:.0%} of the non-equivalent mutants "
        f"({len(mutants) - len(counted)} equivalent mutant(s) excluded)"
    )
    for m in mutants:
        if m.equivalent:
            print(f"equivalent: {m.name}: {m.equivalent}")
    return 0 if rate >= TARGET_RATE else 1


if __name__ == "__main__":
    sys.exit(main())
