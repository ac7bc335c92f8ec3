# qlbench: every target sets up what it needs in ./.venv first (CPU build of torch 2.13.0, then the package).
#   make run      the main job: dropwave on the deep-narrow backbone, every method, `quick` budget
#   make test     the default test suite (what CI runs, after make lint)
#   make test-faults  the slower fault cases, the random-damage test and the fuzz test (CI runs them after make test)
#   make test-peft-matrix  peft's own generic tests on Queryable LoRA beside LoRA (CI runs it after test-faults)
#   make fuzz         the fuzz test over every command with new random examples (tests/test_fuzz.py)
#   make test-cuda    the CUDA tests, on a machine with a GPU (skipped with the reason elsewhere)
#   make gpu-check    on a machine with one GPU and PyTorch (no venv: the system's Python, missing wheels in .whl/):
#                     the quick run on CUDA, deep-narrow's CUDA bench rows, the compiled bench's exit and the CUDA
#                     tests, timed, in one call of at most 10 minutes; GPU_CHECK_PARTS=... names other parts (the
#                     Transformer's bench, the deep-narrow paper table itself); logs in ./gpu-check (docs/speed.md)
#   make lint     ruff: lint and format check
#   make figures  regenerate figures/ from the notebooks
#   make bench    speed benchmarks (side by side, one run; what they measure: docs/speed.md)
#   make results-snapshot  the quick sweeps of both backbones (9 functions; deep-narrow 10 seeds, Transformer 3) and
#                          their report in docs/results/zoo, rebuilt from its per-seed CSV (README's first tables)
#   make pareto-snapshot   the accuracy-cost Pareto sweeps (ackley and the zoo-4 suite, live deep-narrow, quick) into
#                          pareto-results/pareto (not committed: its tables have no per-seed records form yet)
#   make aa-snapshot       the A/A rows of zoo-v1 (LoRA as an outside method, and peft:lora) on the shipped backbones
#   make items-snapshot    the candidate tasks of zoo-v2 (every card's shift x2, x3, x4; a panel of 9 methods)
#   make leaderboard-snapshot  the zoo-v2 baselines: every method at every rate of its grid (resumable; hours)
#   make board-pages       the leaderboards of zoo-v1 and zoo-v2 (forest plots), the external-validity page and the item analysis,
#                          rebuilt from the committed per-seed CSVs (no training)
#   make real-snapshot     the real-model experiment of docs/results/real (all-MiniLM-L6-v2 through peft, 3 seeds)
#   make real-lm-snapshot  the causal-LM experiment of docs/results/real-lm (a tiny decoder through peft, 10 seeds)
#   make diag-snapshot     the figures of docs/why.md (gradient profiles, signal, route maps): both backbone inits,
#                          3 functions, records in $(DIAG)
#   make mechanism-snapshot  the routing-vs-sharing baselines without the epsilon artifact and on a live backbone
#   make suites-snapshot   the multi-task snapshot (quick budget, live (kaiming) deep-narrow, 5 seeds; records in
#                          $(SUITES), resumed: only rows without a record train): zoo-4 and shifts-ackley, joint and
#                          sequential, shifts-ackley held-out, every default row and the same-instruction control
#   make language-snapshot the held-out experiment on the parametric suites (docs/results/language/report.md; records
#                          in $(LANGUAGE), resumed; two processes of one thread)
#   Every snapshot target first runs check-clean: it refuses a tree with uncommitted changes to tracked files
#   (untracked files do not count), so that every record it writes names one commit and its report says so.
#   ALLOW_DIRTY=1 (make results-snapshot ALLOW_DIRTY=1) skips the check; the report then warns on every table.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned: a bare `torch` requirement with no torch installed pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup setup-dev run test test-slow test-faults test-peft-matrix fuzz test-cuda gpu-check lint format figures bench results-snapshot baselines-snapshot pareto-snapshot real-snapshot real-lm-snapshot diag-snapshot \
	suites-snapshot suites-report board-pages aa-snapshot leaderboard-snapshot items-snapshot language-snapshot language-report mechanism-snapshot check-clean clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime docs/examples/qlbench-example-adapter/pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps -e docs/examples/qlbench-example-adapter  # docs/extending.md
	touch $@

setup: $(VENV)/.runtime
setup-dev: $(VENV)/.dev

run: setup
	$(BIN)/qlbench run --function dropwave --arch deep-narrow --budget quick

# the default suite on TEST_WORKERS processes (pytest-xdist; each test one intra-op thread, tests/conftest.py); tests of
# one xdist_group (the Ray executor's, which share one Ray runtime; a module's whose fixture trains once) run in one
# worker. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup-dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint: setup-dev
	$(BIN)/ruff check qlbench tests docs/gpu
	$(BIN)/ruff format --check qlbench tests docs/gpu

format: setup-dev
	$(BIN)/ruff check --fix qlbench tests docs/gpu
	$(BIN)/ruff format qlbench tests docs/gpu

# the long checks (every method's step compiled by Inductor against its eager run, the compiled bench, ...); CI runs
# them after the default suite
test-slow: setup-dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m slow

# peft's own generic custom-model tests on Queryable LoRA beside LoRA (tests/test_peft_matrix.py): the installed peft's
# sdist comes from PyPI, and its tests import diffusers and datasets, installed here only
test-peft-matrix: setup-dev
	$(BIN)/python -m pip install -q diffusers datasets
	$(BIN)/python -m pytest -q -m peft_matrix

# the CUDA tests (tests/test_cuda.py): skipped, with the reason, on a machine without a GPU (CI)
test-cuda: setup-dev
	$(BIN)/python -m pytest -q -m cuda -rs

gpu-check:
	bash docs/gpu/gpu-check.sh

# the slower fault cases and the property-based random-damage test (tests/test_faults.py); CI runs them after `make test`
test-faults: setup-dev
	$(BIN)/python -m pytest -q -m faults

# the fuzz test over every command (tests/test_fuzz.py) with new random examples, 300 per command (CI runs a fixed 60)
fuzz: setup-dev
	QLBENCH_FUZZ=random $(BIN)/python -m pytest -q -m faults tests/test_fuzz.py

figures: setup-dev
	cd notebooks && ../$(BIN)/jupyter execute 01_function_zoo.ipynb

bench: setup
	$(BIN)/qlbench bench

# the snapshot targets' guard, checked once before any of their commands (suites-snapshot writes its records into the
# tracked $(SUITES)): staged or unstaged changes to tracked files fail it, untracked files do not (as results.git_info)
ALLOW_DIRTY ?=
check-clean:
	@if [ "$(ALLOW_DIRTY)" != 1 ] && ! { git diff --quiet HEAD -- && git diff --cached --quiet; }; then \
	  echo "snapshot targets need a clean tree: commit or stash first (records must name one commit)" >&2; exit 1; fi

# deep-narrow: every method of the paper plus the routing-vs-sharing baselines; the Transformer: every adapter (its
# full-soap stack takes about a minute per step on one core of the 2-core CPU: hours; docs/speed.md)
SNAPSHOT_DN_METHODS ?= full-soap,lora,lora-matched,dora,hyra,replora,doran,vb-lora,moe-lora,lily,queryable,instruct-queryable,frozen,mean
SNAPSHOT_TF_METHODS ?= lora,lora-matched,dora,hyra,replora,doran,queryable,instruct-queryable,frozen,mean
# README's headline: LoRA, LoRA of instruct-queryable's size and the routed methods
HEADLINE_METHODS ?= lora,lora-matched,queryable,instruct-queryable,frozen,mean
HEADLINE_SEEDS ?= 10
TF_SEEDS ?= 3
# A committed report is rebuilt from its per-seed CSV, so that a test can rebuild it: $(1) a results folder, $(2) the
# report's folder under docs/results (replaced). The CSV comes from the records; every table from the CSV, and each
# table's provenance line names the commit(s) its records were written from.
define commit_report
	$(BIN)/qlbench report $(1) --format csv --no-figures --out $(1)/per-seed-export >/dev/null
	rm -rf $(2) && mkdir -p $(2) && cp $(1)/per-seed-export/per-seed.csv.gz $(2)/
	$(BIN)/qlbench report $(2)/per-seed.csv.gz --format md,csv >/dev/null
endef

# the zoo report (docs/results/zoo): the quick budget, nine functions; deep-narrow in the paper's setting (default init)
# with every method and on the live (kaiming) backbone with the headline methods, $(HEADLINE_SEEDS) seeds each; the
# Transformer with every adapter, $(TF_SEEDS) seeds. Its own records folder: a sweep resumes the finished cells of it.
results-snapshot: check-clean setup
	$(BIN)/qlbench sweep --arch deep-narrow --budget quick --threads 1 --seeds $(HEADLINE_SEEDS) \
	  --methods $(SNAPSHOT_DN_METHODS) --out snapshot-results --no-progress
	$(BIN)/qlbench sweep --arch deep-narrow --budget quick --threads 1 --seeds $(HEADLINE_SEEDS) --backbone-init kaiming \
	  --methods $(HEADLINE_METHODS) --out snapshot-results --no-progress
	$(BIN)/qlbench sweep --arch transformer --budget quick --threads 1 --seeds $(TF_SEEDS) \
	  --methods $(SNAPSHOT_TF_METHODS) --out snapshot-results --no-progress
	$(call commit_report,snapshot-results,docs/results/zoo)

# the zoo-v1 baselines (docs/results/baselines/zoo-v1) and the leaderboard (docs/results/leaderboard.md): protocol zoo-v1
# (deep-narrow, kaiming, quick, nine functions), every deep-narrow method at $(HEADLINE_SEEDS) seeds and every peft tuner
# that runs (qlbench methods --peft) at $(PEFT_SEEDS) seeds, in results-snapshot's records folder: its kaiming cells are
# the same records (resumed, never run twice). A run may stop and resume across sessions or machines. Then every
# method's step time (bench, one thread, E = 5) into docs/results/bench/zoo-v1.json: the leaderboard's µs / step.
PEFT_SEEDS ?= 5
PEFT_TUNERS = $(shell $(BIN)/python -c "from qlbench.adapters import peft_tuners as p; 	print(','.join(p.PREFIX + t for t in p.types() if t not in p.REFUSED))")
BASELINE_RUN = $(BIN)/qlbench sweep --arch deep-narrow --budget quick --backbone-init kaiming --threads 1 \
	--out snapshot-results --no-progress
baselines-snapshot: check-clean setup-dev
	$(BASELINE_RUN) --seeds $(HEADLINE_SEEDS) --methods $(SNAPSHOT_DN_METHODS)
	$(BASELINE_RUN) --seeds $(PEFT_SEEDS) --methods $(PEFT_TUNERS)
	$(BIN)/qlbench report snapshot-results --arch deep-narrow --backbone-init kaiming --format csv --no-figures \
	  --out snapshot-results/zoo-v1-export >/dev/null
	rm -rf docs/results/baselines/zoo-v1 && mkdir -p docs/results/baselines/zoo-v1
	cp snapshot-results/zoo-v1-export/per-seed.csv.gz docs/results/baselines/zoo-v1/
	$(BIN)/qlbench report docs/results/baselines/zoo-v1/per-seed.csv.gz --format md,csv >/dev/null
	$(BIN)/qlbench bench --quick --archs deep-narrow --only throughput,members --threads 1 --no-progress \
	  --methods $(SNAPSHOT_DN_METHODS),$(PEFT_TUNERS) --out snapshot-results/zoo-v1-bench >/dev/null
	cp snapshot-results/zoo-v1-bench/bench.json docs/results/bench/zoo-v1.json
	cp snapshot-results/zoo-v1-bench/bench.md docs/results/bench/zoo-v1.md
	$(MAKE) board-pages

# the zoo-v2 baselines (docs/results/baselines/zoo-v2): protocol zoo-v2 (docs/protocols/zoo-v2), every deep-narrow
# method and every peft tuner that runs, each at every rate of the protocol's grid on its tasks and seeds, on zoo-v1's
# shipped backbones, in $(BOARD_RESULTS); resumable (a finished cell is never run twice, a stopped stack resumes from
# its snapshot); BOARD_METHODS=... runs a part first. Then the per-seed CSV, its report and the board pages.
# BOARD_EXECUTOR=ray runs a method's grid as Ray tasks, one rate after another (a local Ray runtime;
# RAY_ADDRESS=host:port, or auto, attaches to a cluster), with records equal to this process's, where a method's rates
# share one stack (tests/test_ray_executor.py); resume holds across both.
BOARD_RESULTS ?= board-results
BOARD_METHODS ?= $(SNAPSHOT_DN_METHODS),$(PEFT_TUNERS)
BOARD_EXECUTOR ?= local
BOARD_RAY = $(if $(filter ray,$(BOARD_EXECUTOR)),--executor ray $(if $(RAY_ADDRESS),--ray-address $(RAY_ADDRESS)),)
V2_BASELINES = docs/results/baselines/zoo-v2
leaderboard-snapshot: check-clean setup-dev
	$(BIN)/qlbench sweep --protocol zoo-v2 --threads 1 --methods $(BOARD_METHODS) --out $(BOARD_RESULTS) \
	  $(BOARD_RAY) --no-progress
	mkdir -p $(V2_BASELINES)
	$(BIN)/qlbench results $(BOARD_RESULTS) --per-seed $(V2_BASELINES)/per-seed.csv.gz >/dev/null
	$(BIN)/qlbench report $(V2_BASELINES)/per-seed.csv.gz --format md,csv >/dev/null

# the candidate tasks of zoo-v2 (records: docs/results/candidates; item analysis: docs/results/items/candidates): every
# card's task with its shift 2, 3 and 4 times, a panel of nine methods at 5 seeds on zoo-v1's shipped backbones, beside
# zoo-v1's own tasks (its baselines' rows of the same panel and seeds); the item analysis that chose zoo-v2's tasks
ITEM_RESULTS ?= item-results
ITEM_PANEL = frozen,mean,lora,dora,replora,peft:ia3,peft:ln_tuning,peft:miss,peft:road
ITEM_TASKS = $(shell $(BIN)/python -c "from qlbench import zoo; print(','.join(f'{n}@s{s}' for n in zoo.names() for s in (2, 3, 4)))")
items-snapshot: check-clean setup-dev
	$(BIN)/qlbench sweep --protocol zoo-v1 --methods frozen --seeds 5 --out $(ITEM_RESULTS) --no-progress >/dev/null
	$(BIN)/qlbench sweep --functions $(ITEM_TASKS) --methods $(ITEM_PANEL) --budget quick --backbone-init kaiming \
	  --seeds 5 --threads 1 --out $(ITEM_RESULTS) --no-progress >/dev/null
	mkdir -p docs/results/candidates
	$(BIN)/qlbench results $(ITEM_RESULTS) --per-seed docs/results/candidates/per-seed.csv.gz >/dev/null
	$(BIN)/qlbench report docs/results/candidates/per-seed.csv.gz --format md,csv >/dev/null
	$(MAKE) board-pages

# the A/A rows of zoo-v1 (docs/results/baselines/zoo-v1-aa): LoRA written as an outside method (the example package's
# lora-twin, its own random stream) and peft:lora (lora's start and scale), 10 seeds, on the protocol's shipped backbones
AA_RESULTS ?= aa-results
aa-snapshot: check-clean setup-dev
	$(BIN)/qlbench sweep --protocol zoo-v1 --methods lora-twin,peft:lora --threads 1 --out $(AA_RESULTS) --no-progress
	$(BIN)/qlbench report $(AA_RESULTS) --format csv --no-figures --out $(AA_RESULTS)/export >/dev/null
	rm -rf docs/results/baselines/zoo-v1-aa && mkdir -p docs/results/baselines/zoo-v1-aa
	cp $(AA_RESULTS)/export/per-seed.csv.gz docs/results/baselines/zoo-v1-aa/
	$(BIN)/qlbench report docs/results/baselines/zoo-v1-aa/per-seed.csv.gz --format md,csv >/dev/null
	$(MAKE) board-pages

# the pages read from the committed baselines and reports, no training: the leaderboard and its forest plot, the
# external-validity page (peft's design split) and the item analysis of every committed single-task slice
board-pages: setup
	$(BIN)/qlbench compare --leaderboard --out docs/results >/dev/null
	$(BIN)/qlbench compare --protocol zoo-v2 --leaderboard --out docs/results/leaderboard-zoo-v2 >/dev/null
	$(BIN)/qlbench compare --validity docs/results/validity/peft-metamathqa-design.csv --out docs/results/validity >/dev/null
	$(BIN)/qlbench compare --protocol zoo-v2 --validity docs/results/validity/peft-metamathqa-design.csv \
	  --out docs/results/validity-zoo-v2 >/dev/null
	cd docs/results && ../../$(BIN)/qlbench items baselines/zoo-v1/per-seed.csv.gz zoo/per-seed.csv.gz \
	  paper/per-seed.csv.gz --out items >/dev/null
	cd docs/results && ../../$(BIN)/qlbench items candidates/per-seed.csv.gz baselines/zoo-v1/per-seed.csv.gz \
	  --methods $(ITEM_PANEL) --seeds 5 --out items/candidates >/dev/null

# the routing-vs-sharing baselines without the epsilon artifact (float64, eps 1e-30) and on the live backbone,
# 3 functions, 5 seeds, LoRA of instruct-queryable's size beside them (docs/why.md, "Routing or sharing?")
MECHANISM_RUN = $(BIN)/qlbench sweep --functions dropwave,levy,ackley --arch deep-narrow --budget quick --seeds 5 \
	--methods lora,lora-matched,vb-lora,moe-lora,lily,queryable,frozen,mean --threads 1 --out mechanism-results --no-progress
mechanism-snapshot: check-clean setup
	$(MECHANISM_RUN) --dtype float64 --eps 1e-30
	$(MECHANISM_RUN) --backbone-init kaiming
	$(call commit_report,mechanism-results,docs/results/mechanism)

# the accuracy-cost Pareto snapshot: one function on the live (kaiming) deep-narrow backbone, quick budget, 3 seeds
PARETO_GRID ?= r=4,8 M=4,8 k=1,2,4
# and one suite (zoo-4, joint): instruct-queryable over r x k at M = 8, and LoRA over r (each point a suite row)
PARETO_SUITE_GRID ?= r=4,8 M=8 k=1,2
pareto-snapshot: check-clean setup
	$(BIN)/qlbench pareto --function ackley --backbone-init kaiming --methods queryable,lora,moe-lora \
	  --grid "$(PARETO_GRID)" --budget quick --threads 1 --out pareto-results --no-progress
	$(BIN)/qlbench pareto --suite zoo-4 --schedule joint --backbone-init kaiming --methods instruct-queryable,lora \
	  --grid "$(PARETO_SUITE_GRID)" --budget quick --threads 1 --out pareto-results --no-progress

# the real-model snapshot: the bundled all-MiniLM-L6-v2 through peft, 3 seeds (qlbench real; needs setup-dev's hf
# extra); its JSON records (no weights) beside the table, which a test rebuilds from them
real-snapshot: check-clean setup-dev
	$(BIN)/qlbench real --seeds 3 --threads 1 --out real-results --no-progress
	rm -rf docs/results/real && mkdir -p docs/results/real/records
	folder=$$($(BIN)/python -c "from qlbench.experiments import real; \
	  print(real.record_path('real-results', real.RealConfig(), '').parent)") && \
	  cp $$folder/real.md $$folder/real.csv $$folder/real.png docs/results/real/ && \
	  cp $$folder/*.json docs/results/real/records/

real-lm-snapshot: check-clean setup-dev
	$(BIN)/qlbench real-lm --seeds 10 --threads 1 --out real-results --no-progress
	rm -rf docs/results/real-lm && mkdir -p docs/results/real-lm/records
	folder=$$($(BIN)/python -c "from qlbench.experiments import real_lm; \
	  print(real_lm.record_path('real-results', real_lm.LMConfig(seeds=tuple(range(10))), '').parent)") && \
	  cp $$folder/real-lm.md docs/results/real-lm/ && cp $$folder/*.json docs/results/real-lm/records/

DIAG ?= diag-results
DIAG_FUNCTIONS ?= dropwave,levy,ackley
diag-snapshot: check-clean setup
	for init in default kaiming; do \
	  $(BIN)/qlbench sweep --functions $(DIAG_FUNCTIONS) --arch deep-narrow --budget quick --threads 1 \
	    --backbone-init $$init --noise absolute --out $(DIAG) --no-progress || exit 1; done
	$(BIN)/qlbench report $(DIAG) --arch deep-narrow --budget quick --format md,csv --out $(DIAG)/report
	for d in deep-narrow deep-narrow-kaiming; do \
	  cp $(DIAG)/report/$$d/quick/gradient-profile.png figures/gradient-profile-$$d.png; \
	  cp $(DIAG)/report/$$d/quick/gradient-concentration.png figures/gradient-concentration-$$d.png; done
	$(BIN)/qlbench signal --function dropwave --backbone-init default,kaiming,orthogonal --threads 1 --out $(DIAG) \
	  --figure figures/signal-deep-narrow-dropwave.png --no-progress
	for init in default kaiming; do for m in queryable instruct-queryable; do \
	  $(BIN)/qlbench diagnose $(DIAG) --function dropwave --method $$m --backbone-init $$init \
	    --out $(DIAG)/diagnose-$$init || exit 1; \
	  cp $(DIAG)/diagnose-$$init/$$m-route-map.png figures/route-map-dropwave-$$m-$$init.png; done; done

# A suite report from its records folder $(1) into $(2) under docs/results (replaced): report.md, every table
# (.md, .csv) and figure (.png); a test rebuilds the tables from the records (the records hold no model weights).
define commit_suite_report
	rm -rf $(2) && $(BIN)/qlbench report $(1) --format md,csv --out $(2)/.full >/dev/null
	cd $(2)/.full && find . -name '*.md' -o -name '*.csv' -o -name '*.png' | xargs -I{} install -D {} $(CURDIR)/$(2)/{}
	rm -rf $(2)/.full
endef

SUITES ?= docs/results/suite-records
SUITE_RUN = $(BIN)/qlbench suite --arch deep-narrow --budget quick --backbone-init kaiming --threads 1 --seeds 5 \
	--out $(SUITES) --no-progress
# the routing-vs-sharing baselines on zoo-4 (joint and sequential), beside the default rows
SUITE_BASELINES ?= vb-lora,moe-lora,lily
suites-snapshot: check-clean setup
	for s in zoo-4 shifts-ackley; do for sched in joint sequential; do \
	  $(SUITE_RUN) --suite $$s --schedule $$sched || exit 1; \
	  $(SUITE_RUN) --suite $$s-same-instruction --schedule $$sched --methods instruct-queryable || exit 1; done; done
	for sched in joint sequential; do $(SUITE_RUN) --suite zoo-4 --schedule $$sched --methods $(SUITE_BASELINES) || exit 1; done
	$(SUITE_RUN) --suite shifts-ackley --schedule held-out
	$(SUITE_RUN) --suite shifts-ackley-same-instruction --schedule held-out --methods instruct-queryable
	$(MAKE) suites-report

# the suite snapshot's report (docs/results/suites) from its committed records, no training
suites-report: setup
	$(call commit_suite_report,$(SUITES),docs/results/suites)

# the held-out experiment (docs/results/language/report.md):
# the parametric suites (qlbench suites param-sin-cos-16), live deep-narrow, quick, 5 seeds; the first command trains
# the backbone every suite of the family shares, then two streams of one thread each (records resume: only missing
# rows train). At every T (4, 16, 64), under the fixed total (param-sin-cos-T: 1,600 training samples) and at a fixed
# n per task (param-sin-cos-T-n50): the language rows, their identity controls (task-code, text-lora-code), the
# controls that can transfer without words (param-code, text-lora-params, nearest-task), lora, frozen and mean;
# poly at T = 64 and the sequential schedule at T = 16 as before. Stream a: instruct-queryable's side and the LoRA
# rows; stream b: text-lora's. About 3 h of wall time from nothing (today's rows resumed: about 2 h more).
LANGUAGE ?= docs/results/language-records
LANGUAGE_RUN = $(BIN)/qlbench suite --arch deep-narrow --budget quick --backbone-init kaiming --threads 1 --seeds 5 \
	--out $(LANGUAGE) --no-progress
P := param-sin-cos
LANGUAGE_A := instruct-queryable,task-code,param-code,lora,nearest-task,frozen,mean
LANGUAGE_B := text-lora,text-lora-code,text-lora-params
language-snapshot: check-clean setup
	$(LANGUAGE_RUN) --suite $(P)-4 --schedule held-out --methods frozen,mean
	( for T in 64 16 4; do $(LANGUAGE_RUN) --suite $(P)-$$T --schedule held-out --methods $(LANGUAGE_A) || exit 1; done && \
	  $(LANGUAGE_RUN) --suite $(P)-64 --schedule held-out --methods poly && \
	  $(LANGUAGE_RUN) --suite $(P)-16 --schedule sequential --methods instruct-queryable,task-code,lora,frozen && \
	  for T in 64 16 4; do $(LANGUAGE_RUN) --suite $(P)-$$T-n50 --schedule held-out --methods $(LANGUAGE_A) || exit 1; done ) & a=$$!; \
	( for T in 64 16 4; do $(LANGUAGE_RUN) --suite $(P)-$$T --schedule held-out --methods $(LANGUAGE_B) || exit 1; done && \
	  $(LANGUAGE_RUN) --suite $(P)-16 --schedule sequential --methods text-lora && \
	  for T in 64 16 4; do $(LANGUAGE_RUN) --suite $(P)-$$T-n50 --schedule held-out --methods $(LANGUAGE_B) || exit 1; done ) & b=$$!; \
	wait $$a; ra=$$?; wait $$b; rb=$$?; [ $$ra = 0 ] && [ $$rb = 0 ]
	$(MAKE) language-report

# the held-out experiment's report (docs/results/language) from its committed records, no training
language-report: setup
	$(call commit_suite_report,$(LANGUAGE),docs/results/language)


clean:
	rm -rf $(VENV) results snapshot-results pareto-results mechanism-results real-results aa-results .pytest_cache .hypothesis
