"""`ridgefill.memory.keep_freed_memory`: freed blocks of a few MB are reused by the next allocation instead of being
returned to the kernel and faulted in again."""

import subprocess
import sys

import pytest

WORK = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from ridgefill.memory import keep_freed_memory
    assert keep_freed_memory()
def work():  # activations of a forward: allocated, used, freed, again
    for n in (3 << 20, 9 << 20, 20 << 20, 5 << 20):
        a = np.ones(n // 8)
        b = a * 2
        del a, b
work()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    work()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", WORK, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    kept, default = faults("keep"), faults("default")
    assert kept < 200  # 10 rounds of 37 MB: each would be 9,000+ fresh pages
    assert default > 10 * (kept + 100)  # glibc alone returns them to the kernel (the reason for the setting)


def test_the_cli_sets_it_and_help_imports_no_torch():
    code = ("import sys, ridgefill.memory as m; calls = []; m.keep_freed_memory = lambda: calls.append(1) or True; "
            "sys.argv = ['ridgefill', '--help']\n"
            "from ridgefill.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert calls == [1], calls; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
