"""The bench harness (bench/harness.py) ends cleanly on a plain `kill`: a figure script stopped by SIGTERM runs its
`finally` blocks (the serve bench resumes and stops its paused servers there) and removes its scratch folder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from harness import Bench, parser

    args = parser("a figure").parse_args([])
    with Bench("killed", args, None) as bench:
        child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, start_new_session=True)
        os.killpg(child.pid, signal.SIGSTOP)  # as a paused server
        try:
            print(bench.scratch, child.pid, flush=True)
            time.sleep(300)
        finally:
            os.killpg(child.pid, signal.SIGCONT)
            child.terminate()
            child.wait()
            print("cleaned up", flush=True)
""")


def test_sigterm_runs_finally_and_removes_scratch(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(ROOT / "bench")], stdout=subprocess.PIPE, text=True,
                         cwd=tmp_path)  # fmt: skip
    scratch, child = p.stdout.readline().split()
    assert Path(scratch).is_dir()
    p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=60)
    finally:  # a failed run must not leave its paused child behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(child), signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM
    assert out == "cleaned up\n"
    assert not Path(scratch).exists()
