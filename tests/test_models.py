"""Loading a model: what load_model sets up besides the weights."""

import subprocess
import sys

import pytest

FAULTS = """
import resource, sys, torch
from common.models import load_model, resolve_model
if sys.argv[1] == "load":
    load_model(resolve_model("embedded", "reverse"))

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**24)  # 64 MB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for _ in range(3):  # the heap grows to its size over the first rounds
    faults()
print(faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_loading_a_model_keeps_freed_memory_for_reuse_instead_of_page_faulting_it_again():
    """After load_model (in a fresh process), a freed 64 MB tensor's memory serves the next one: allocating it again
    costs almost no page faults, where glibc's default (a process that loaded no model) maps a fresh block from the
    OS each time, about 16,384 zeroed 4 KB pages."""
    from common.models import keep_freed_memory

    assert keep_freed_memory()  # glibc on Linux: it applies
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]) for how in ("load", "default")}
    assert faults["load"] < 1000 < 10000 < faults["default"], faults
