"""Session settings for the whole suite.

One intra-op thread: the suite's tensors are tiny, and on a shared 2-core machine two OpenMP threads per process
made them about 10x slower in wall time. Flush-to-zero for denormals: a float32 deep-narrow step outside the
engine took 100x longer without it. Both are set before any tensor op so that worker threads inherit them.
"""

import torch

torch.set_num_threads(1)
torch.set_flush_denormal(True)
