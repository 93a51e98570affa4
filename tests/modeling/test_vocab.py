"""VocabRemap: a corpus's most frequent ids onto a small vocabulary, and back."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.modeling import VocabRemap


def test_vocab_remap() -> None:
    remap = VocabRemap.from_corpus([[7, 7, 7, 3, 3, 151000], [3, 9]], size=3)
    assert remap.size == 3 and remap.kept_ids.tolist() == [3, 7]
    assert remap.encode([3, 7, 9, 151000, 200000, -100]) == [1, 2, 0, 0, 0, -100]
    ids = torch.tensor([[7, 3, 12]])
    assert torch.equal(remap.decode(remap.encode(ids), unk_token_id=99), torch.tensor([[7, 3, 99]]))
    example = remap.encode_example({"input_ids": [7, 9], "labels": [-100, 3], "prompt": "x"})
    assert example == {"input_ids": [2, 0], "labels": [-100, 1], "prompt": "x"}
    with pytest.raises(ValueError, match="^ids"):
        remap.decode([3], unk_token_id=0)
