"""The paper's theory on the code that runs, in three layers (each importing only the ones above it):

- `formulas`: plain formulas (norms, Jacobians, objectives, the right-hand side of every bound); tests/properties
  checks them against the router;
- `tracing`: one traced forward of a real Queryable LoRA model (routes, rank states, every adapted layer call);
- `checks`: every norm and Lipschitz statement observed on a trace against its formula (`qlbench verify`).
"""
