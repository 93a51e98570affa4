"""A tiny offline processor for the tiny vision-language models of :mod:`.tiny` (``tiny_vlm_model``), for trainers
that take a ``processing_class`` (TRL's ``SFTTrainer`` on images).

It is Qwen3.5's processor class (``Qwen3VLProcessor``) built in memory: Qwen2-VL's image processor with the tiny
vision tower's ``patch_size`` 4, ``temporal_patch_size`` 2 and ``merge_size`` 2 (an image of ``H x W`` pixels, both
multiples of 8, gives the grid ``(1, H / 4, W / 4)`` and ``H * W / 64`` placeholder tokens), a word-level tokenizer
whose four special tokens are :data:`~.tiny.VISION_TOKENS`, and a chat template. Images only: Qwen's video
processor needs torchvision.
"""

from __future__ import annotations

from typing import Any

from hybrid_pack.errors import MissingExtraError
from hybrid_pack.integrations.transformers.tiny import VISION_TOKENS

try:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
except ImportError as err:
    raise MissingExtraError("tiny_vlm_processor", "hf", err) from err

__all__ = ["TINY_CHAT_TEMPLATE", "TinyVLProcessor", "tiny_vlm_processor"]

SPECIAL_TOKENS = {"<|image_pad|>": VISION_TOKENS["image_token_id"], "<|video_pad|>": VISION_TOKENS["video_token_id"],
                  "<|vision_start|>": VISION_TOKENS["vision_start_token_id"],
                  "<|vision_end|>": VISION_TOKENS["vision_end_token_id"]}
"""Qwen's vision token strings -> the tiny models' ids (the last four of the vocabulary)."""

TINY_CHAT_TEMPLATE = (
    "{%- macro content(message) -%}"
    "{%- if message.content is string -%}{{ ' ' + message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'text' -%}{{ ' ' + part.text }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "assistant{% generation %}{{ content(message) }}{{ ' <eos> ' }}{% endgeneration %}"
    "{%- else -%}{{ message.role }}{{ content(message) }}{{ ' <eos> ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant{%- endif -%}"
)
"""Each turn: its role word, its images (``<|vision_start|><|image_pad|><|vision_end|>``, expanded by the processor)
and words, then ``<eos>``; the assistant's content and ``<eos>`` inside ``{% generation %}`` (TRL's
``assistant_only_loss``)."""


class TinyVLProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without its video processor (transformers builds one only with torchvision)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def tiny_vlm_processor() -> TinyVLProcessor:
    """The processor of the tiny vision-language models: token ids ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, ``user``
    3, ``assistant`` 4, the words ``w5`` ... ``w123``, then the four vision tokens (124 to 127). Its output for one
    sample: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` int64 ``[1, L]``, and with images
    ``pixel_values`` float32 ``[sum t*h*w, 96]`` and ``image_grid_thw`` int64 ``[n, 3]``."""
    first_vision = min(SPECIAL_TOKENS.values())
    vocab = ({"<pad>": 0, "<eos>": 1, "<unk>": 2, "user": 3, "assistant": 4}
             | {f"w{i}": i for i in range(5, first_vision)} | SPECIAL_TOKENS)
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", additional_special_tokens=list(SPECIAL_TOKENS))
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                      max_pixels=32 * 32)
    return TinyVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=TINY_CHAT_TEMPLATE)
