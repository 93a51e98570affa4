"""Test-session settings: one torch thread per pytest worker (the suite runs under xdist on a
2-core machine; several OpenMP threads per worker only contend)."""

import torch

torch.set_num_threads(1)
