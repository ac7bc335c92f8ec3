"""Storage: the atomic writer and the results folder (store), one record's fields (results, schema), the claim and
resume protocol every workload runs under (runner) and the per-seed CSV (per_seed). Nothing here trains."""
