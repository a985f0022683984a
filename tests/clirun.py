"""Run the real `ridgefill` entry point in a subprocess, as a user or CI job would."""

import subprocess
import sys


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ridgefill", *map(str, args)], capture_output=True, text=True, **kw)
