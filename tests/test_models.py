"""Loading a model: what load_model sets up besides the weights."""

import subprocess
import sys

import pytest

FAULTS = """
import resource, torch
from common.models import load_model, resolve_model
load_model(resolve_model("embedded", "reverse"))

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**24)  # 64 MB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()
print(faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_loading_a_model_keeps_freed_memory_for_reuse_instead_of_page_faulting_it_again():
    """After load_model (in a fresh process), a freed 64 MB tensor's memory serves the next one: allocating it again
    costs almost no page faults, where glibc's default maps a fresh block from the OS, 16,384 zeroed 4 KB pages."""
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 1000
