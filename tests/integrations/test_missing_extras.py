"""A part used without its optional dependency raises an ImportError naming the extra to install."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(("missing", "statement", "extra"), [
    ("accelerate", "from hybrid_pack.integrations.transformers.trainer import PackedTrainer", "hf"),
    ("transformers", "from hybrid_pack.integrations.transformers.guard import PackingGuardCallback", "hf"),
    ("transformers", "from hybrid_pack.integrations.transformers.tiny import tiny_model; tiny_model('bamba')", "hf"),
    ("trl", "from hybrid_pack.integrations.trl import PackedSFTTrainer", "trl"),
    ("trl", "from hybrid_pack.integrations.trl_grpo import PackedGRPOTrainer", "trl"),
    ("trl", "from hybrid_pack.integrations.trl_rloo import PackedRLOOTrainer", "trl"),
    ("trl", "from hybrid_pack.integrations.trl_vlm import VisionLanguagePackingCollator", "trl"),
    ("transformers", "from hybrid_pack.integrations.transformers.tiny_processor import tiny_vlm_processor", "hf"),
    ("datasets", "from hybrid_pack.packing.hf_datasets import tokenize_and_plan; tokenize_and_plan(None, None, 8)",
     "hf"),
    ("transformers", "from hybrid_pack.training.trainer import hf_causal_lm; hf_causal_lm('folder', weights=False)",
     "hf"),
    ("transformers", "from hybrid_pack.data.tokenizer import load_chat_tokenizer; load_chat_tokenizer('folder')", "hf"),
    ("transformers", "from hybrid_pack.data.tokenizer import load_hf_tokenizer; load_hf_tokenizer()", "hf"),
])
def test_missing_dependency_names_the_extra(missing: str, statement: str, extra: str):
    program = f"""
import sys
sys.modules[{missing!r}] = None  # as if it were not installed: importing it raises ImportError
from hybrid_pack.errors import MissingExtraError
try:
    {statement}
except MissingExtraError as err:
    assert isinstance(err, ImportError)
    print(err)
else:
    raise SystemExit("no error")
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"pip install 'hybrid_pack[{extra}]'" in result.stdout and missing in result.stdout
