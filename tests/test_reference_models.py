"""zero.models: the reference GPT that library code knows by name (the tensor-parallel plan "gpt",
replace_self_attention) lives in the library, not among the test fixtures of zero.testing."""
import subprocess
import sys

import zero.models
import zero.testing.models

USE_BOTH = """
import sys

from zero.models import GPT, GPTConfig
from zero.sparse_attention import DenseSparsityConfig, replace_self_attention
from zero.tp.plans import PLANS

model = GPT(GPTConfig(n_head=2, fused_qkv=False))
plan = PLANS["gpt"](model, 1)
replace_self_attention(model, DenseSparsityConfig(2, block=16))
assert "blocks.0.q" in plan and model.blocks[0].attend is not None
print(sorted(m for m in sys.modules if m == "zero.testing" or m.startswith("zero.testing.")))
"""


def test_the_gpt_plan_and_attention_swap_do_not_import_the_test_fixtures():
    out = subprocess.run([sys.executable, "-c", USE_BOTH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_test_fixtures_reexport_the_same_classes():
    assert zero.testing.models.GPT is zero.models.GPT and zero.testing.models.Block is zero.models.Block
    assert zero.testing.models.GPTConfig is zero.models.GPTConfig
