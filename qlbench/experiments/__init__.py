"""The experiment kinds, each a workload the runner executes (plan -> units -> train -> records): cells of one function
(experiment), multi-task suites (multitask), size grids (pareto, pareto_stack), the instruction ablation (ablation) and
the real-model runs (real, real_lm), with the checks every plan runs before any work (planning)."""
