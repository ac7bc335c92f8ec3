"""`qlbench real-lm`: the causal-LM experiment (qlbench/experiments/real_lm.py): a tiny decoder, pretrained here,
adapted through peft with LoRA (at r 8, at instruct-queryable's parameter count, and with the instruction's words in
its prompt), Queryable LoRA and Instruction-Queryable LoRA to three generation tasks told apart by their instruction
alone; records and a table."""

from __future__ import annotations

import sys

from qlbench.commands import UsageError, check_out, options, split_list, usage_errors
from qlbench.experiments import real_lm, runner
from qlbench.progress import bar
from qlbench.records import store


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "real-lm",
        help="adapt a tiny pretrained decoder to three instructed generation tasks (needs the hf extra)",
        description="The causal-LM experiment: a 2-layer Llama-style decoder built from a config and pretrained here "
        "on copying letters, adapted through peft to reverse, shift and swap them, three tasks over the same inputs "
        "told apart only by their instruction (lora-prompt reads its words in the prompt, instruct-queryable routes "
        "on its embedding; the other rows see the letters only); greedy exact match per task (KV cache on), every "
        "method, several seeds, paired with LoRA; records and table under OUT/real-lm/. Needs "
        "`pip install 'qlbench[hf]'`.",
    )
    methods = dict(default=",".join(real_lm.METHODS), help=f"any of: {', '.join(real_lm.METHODS)}")
    options.add(
        p,
        "--methods",
        "--epochs",
        methods=methods,
        epochs=dict(default=20, help="adaptation passes over the training set (default 20)"),
    )
    seeds = dict(default=3, help="seeds 0..N-1 (default 3)")
    options.add_training_options(p, "seeds", "threads", "device", seeds=seeds)
    options.add_output_options(p)  # records and table under OUT/real-lm/
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    methods = split_list(args.methods, "--methods")
    if not methods or (bad := [m for m in methods if m not in real_lm.METHODS]):
        raise UsageError(
            f"unknown method {', '.join(bad) if methods else '(none)'}; valid: {', '.join(real_lm.METHODS)}"
        )
    execution = options.execution_of(args)  # --threads checked against the cores present
    out = execution.out_dir
    if args.seeds is None or not 1 <= args.seeds <= 100:
        raise UsageError(f"--seeds must be an integer from 1 to 100, got {args.seeds}")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise UsageError(f"qlbench real-lm needs the hf extra (pip install 'qlbench[hf]'): {err}") from None
    with usage_errors():
        config = real_lm.LMConfig(epochs=args.epochs, seeds=tuple(range(args.seeds)))
        work = real_lm.plan(methods, config, execution)  # the device checked before any work
    check_out(out, "results folder")
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    todo = sum(real_lm.steps(config, m) for m in methods) * len(config.seeds)
    with bar(total=todo, desc="real-lm", disable=args.no_progress) as progress:
        paths = runner.run(work, progress=progress.update, log=log)
    finished = [p for p in paths if p.exists()]
    folder = real_lm.record_path(out, config, methods[0]).parent
    md = real_lm.markdown(finished)
    store.write_text(md, folder / "real-lm.md")
    print(md)
    print(f"records and table in {folder}")
    return 0
