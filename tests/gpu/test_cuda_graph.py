"""The static training step (docs/api.md §9, docs/compile.md) captured in one CUDA graph and replayed on every
layout of one ``(L, M)``: forward and backward of a whole packed hybrid model (Gated DeltaNet or Mamba-2 SSD, conv,
attention), the documents' boundaries copied into the graph's input buffers like the tokens.

The pure-torch backends' static forms read no tensor value on the host, so the compiled step holds nothing a
replay could not change. A kernel backend reads the documents' lengths on the host (its opaque op refuses a
capture, naming itself); the capture therefore forces the pure-torch backends.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import PackingCollator, backends
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import INPUT_IDS
from tests import kit

PURE_TORCH = {"attention": "torch", "conv": "torch", "gated_delta": "torch", "ssd": "torch"}
PACK_LENGTH, MAX_DOCUMENTS = 256, 8
LAYOUTS = [(256,), (100, 156), (1, 7, 30, 60, 100), (32,) * 8]


def _documents(lengths: tuple[int, ...], seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{INPUT_IDS: torch.randint(1, 8192, (n,), generator=generator)} for n in lengths]


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_static_step_is_captured_once_and_replays_every_layout(preset: str, cuda: torch.device) -> None:
    torch.manual_seed(0)
    model = from_preset(preset).to(cuda)
    static, plain = (PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS),
                     PackingCollator(pack_length=PACK_LENGTH))
    with backends.use_backends(**PURE_TORCH):
        compiled = torch.compile(model, fullgraph=True)
        buffers = {k: v.to(cuda) for k, v in static(_documents(LAYOUTS[0], 0)).items() if torch.is_tensor(v)}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile, autotune, allocate
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                compiled(**buffers).loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        model.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            loss = compiled(**buffers).loss
            loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

        for seed, lengths in enumerate(LAYOUTS):
            documents = _documents(lengths, seed)
            for key, value in static(documents).items():
                if torch.is_tensor(value):
                    buffers[key].copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            model.zero_grad(set_to_none=True)
            eager = model(**{k: v.to(cuda) if torch.is_tensor(v) else v for k, v in plain(documents).items()}).loss
            eager.backward()
            kit.assert_close(loss, eager.detach(), f"loss {lengths}", tol=1e-4)
            for name, grad in grads.items():
                kit.assert_close(grad, dict(model.named_parameters())[name].grad, f"d{name} {lengths}", tol=1e-3)
