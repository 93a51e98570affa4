"""VocabRemap: a corpus's most frequent ids onto a small vocabulary, and back."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.modeling import VocabRemap, expand_vocabulary, from_preset


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


@pytest.mark.parametrize("tied", [True, False])
def test_expanded_model_gives_the_compact_logits_over_tokenizer_ids(tied: bool) -> None:
    torch.manual_seed(0)
    remap = VocabRemap([7, 2, 11])  # compact ids 1, 2, 3; 0 is <unk>
    model = from_preset("qwen3-next-tiny", vocab_size=4, tie_word_embeddings=tied).eval()
    tokenizer_ids = torch.tensor([[2, 7, 5, 11, 0, 13]])
    with torch.no_grad():
        compact = model(input_ids=remap.encode(tokenizer_ids)).logits
        expand_vocabulary(model, remap, 16)
        full = model(input_ids=tokenizer_ids).logits
    assert model.config.vocab_size == 16 and full.shape == (1, 6, 16)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    torch.testing.assert_close(full[..., [7, 2, 11]], compact[..., 1:])
    others = [i for i in range(16) if i not in (7, 2, 11)]
    torch.testing.assert_close(full[..., others], compact[..., :1].expand(-1, -1, len(others)))
