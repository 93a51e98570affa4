"""The heap corruption of CPU inductor ("double free or corruption (!prev)") in a compiled packed backward.

Compiles the pure-torch Gated DeltaNet backend itself (``torch.compile`` of
``hybrid_pack.ops.gated_delta.torch_backend.gated_delta_rule`` on one packed row of 40, 30 and 50 tokens) and
runs its backward, each variant in a subprocess (the failure kills the process):

- ``inductor``: the default; the backward aborts (glibc: "double free or corruption", "corrupted size vs.
  prev_size" or a segmentation fault, from one run to the next) on torch 2.13 CPU;
- ``aot_eager``: the same forward and backward graphs run by ATen kernels: no crash, results equal to eager;
- ``inductor, no vectorization`` (``torch._inductor.config.cpp.simdlen = 1``): no crash;
- ``inductor, no in-place buffers`` (``inplace_buffers = False``): still aborts (most runs);
- ``custom op``: the op as hybrid_pack compiles it (``StaticBoundaries``: one ``torch.library`` custom op, so
  inductor generates no code for its inside): no crash.

So the fault is in inductor's vectorized C++ for this backward (it fuses the scatter-add of the chunk gather's
gradient with the decay's cumsum backward), not in hybrid_pack's graph: eager and aot_eager run the same graphs
with bounds-checked ATen kernels and get the right gradients. Run: ``python benchmarks/repro_inductor_double_free.py``.
"""

from __future__ import annotations

import subprocess
import sys

VARIANTS = {
    "inductor": "",
    "aot_eager": "",
    "inductor, no vectorization": "torch._inductor.config.cpp.simdlen = 1",
    "inductor, no in-place buffers": "torch._inductor.config.inplace_buffers = False",
    "custom op": "",
}


def run_variant(name: str) -> None:
    import torch
    import torch._inductor.config

    from hybrid_pack import PackedBoundaries
    from hybrid_pack.boundaries import StaticBoundaries
    from hybrid_pack.ops import gated_delta_rule
    from hybrid_pack.ops.gated_delta import torch_backend

    exec(VARIANTS[name])  # one inductor setting
    torch._dynamo.config.automatic_dynamic_shapes = False
    boundaries = PackedBoundaries.from_lengths([40, 30, 50])
    generator = torch.Generator().manual_seed(0)
    t, heads, v_heads, k_dim, v_dim = boundaries.total_tokens, 2, 4, 16, 12
    q, k = (torch.randn(1, t, heads, k_dim, generator=generator).requires_grad_() for _ in range(2))
    v = torch.randn(1, t, v_heads, v_dim, generator=generator).requires_grad_()
    g = (-torch.rand(1, t, v_heads, generator=generator)).requires_grad_()
    beta = torch.rand(1, t, v_heads, generator=generator).requires_grad_()
    options = {"scale": k_dim ** -0.5, "initial_state": None, "output_final_state": False, "use_qk_l2norm": True}

    def op(*tensors: torch.Tensor) -> torch.Tensor:
        if name == "custom op":
            static = StaticBoundaries.from_boundaries(boundaries, max_documents=4)
            return gated_delta_rule(*tensors, static, backend="torch", use_qk_l2norm=True)[0]
        return torch_backend.gated_delta_rule(*tensors, boundaries, **options)[0]

    compiled = torch.compile(op, backend="aot_eager" if name == "aot_eager" else "inductor")
    inputs = (q, k, v, g, beta)
    got = torch.autograd.grad(compiled(*inputs).square().sum(), inputs)
    expected = torch.autograd.grad(op(*inputs).square().sum(), inputs)
    print(max(float((a - b).abs().max()) for a, b in zip(got, expected)))


def main() -> None:
    for name in VARIANTS:
        done = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
        lines = (done.stdout + done.stderr).strip().splitlines()
        if done.returncode == 0:
            print(f"{name:<30} backward ran; gradients differ from eager by {float(lines[-1]):.1e}")
        else:
            glibc = [line for line in lines if "free" in line or "corrupt" in line]
            print(f"{name:<30} process killed (exit {done.returncode}) {glibc[-1] if glibc else ''}")


if __name__ == "__main__":
    run_variant(sys.argv[1]) if len(sys.argv) > 1 else main()
