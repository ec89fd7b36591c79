import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.embedded import tiny_llama_config  # noqa: E402
from common.models import char_tokenizer  # noqa: E402

# A chat template over the character vocabulary, for the chat-model code path.
CHAT_TEMPLATE = "{% for m in messages %}q: {{ m['content'] }} {% endfor %}a: "

# Keys whose values depend on the wall clock, not on the computation.
TIMING_KEYS = ("time/", "throughput/")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    """A randomly initialised 2-layer Llama over the character vocabulary (fixed seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(tokenizer)).eval()


def run_script(*argv: str, timeout: float = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root, capturing its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


def state_dicts_equal(a, b, atol: float = 0.0) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=0, atol=atol) for k in sa)
