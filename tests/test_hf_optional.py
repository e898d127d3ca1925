"""`import zero` works without transformers; importing the HF integration says what to install."""
import subprocess
import sys

CODE = """
import sys
sys.modules["transformers"] = None  # as if not installed
import zero, zero.engine, zero.checkpoint.training  # noqa: E401
try:
    import zero.integrations.hf
except ImportError as exc:
    print(exc)
"""


def test_zero_works_without_transformers_and_the_integration_names_the_package():
    run = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert "zero.integrations.hf needs transformers and accelerate: pip install 'zero[hf]'" in run.stdout, run
