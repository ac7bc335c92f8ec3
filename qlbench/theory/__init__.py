"""The paper's theory on the code that runs, in layers (each importing only the ones above it):

- `formulas`: plain formulas (norms, Jacobians, objectives, the right-hand side of every bound); tests/properties
  checks them against the router;
- `tracing`: one traced forward of a real Queryable LoRA model (routes, rank states, every adapted layer call);
- `bounds`: `Bound`, one statement observed against its right-hand side, and the report order of the statements;
- `norm_checks`, `lipschitz_checks`: every norm and every Lipschitz statement observed on a trace against its formula;
- `checks`: all of them over a data set (`check_model`, what `qlbench verify` reports).
"""
