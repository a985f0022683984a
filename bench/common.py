"""Helpers shared by the bench scripts (not a benchmark itself).

    from common import ...   # the bench scripts put bench/ on sys.path first

- `model_cache(store, model)`: the dequantized model cache in the bench store (built once, outside any timing);
  `fresh_store(path, store)`: an empty store whose models/ links to that cache, so a measured `ridgefill capture`
  finds no capture artifact but does not dequantize the GGUF again.
- `make_corpus(tok, tokens, doc_tokens, dest)`: a folder of .txt documents that all have about `doc_tokens`
  tokens (prose and code interleaved), about `tokens` in all. Equal document lengths keep corpora of different
  sizes comparable: a document's KV cache and attention scores grow with its length, not with the corpus.
- `run_measured(cmd)`: wall seconds and peak RSS (os.wait4's ru_maxrss) of a child process.
- `machine()`: load average, uptime, cores and threads, recorded in every JSON (these machines are shared).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
DEFAULT_STORE = OUT / "store"  # holds only the dequantized model caches
MODELS = ("builtin:smollm2-135m", "builtin:gemma3-270m")


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def set_threads(n: int | None) -> None:
    """Pin this process (and its children) to `n` compute threads; call before numpy / torch are imported.

    On a shared 2-core machine two OpenMP threads are slower than one as soon as anything else runs: a thread that
    is descheduled stalls the other at every barrier (SmolLM2, 256 tokens: 1.0 s with one thread, 4.7-9.6 s with
    two under a load of 5). The bench uses one thread unless told otherwise, so that ratios measure the code."""
    if n:
        for k in THREAD_VARS:
            os.environ[k] = str(n)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(n)


def env_threads(n: int | None) -> dict:
    """os.environ with the thread variables set to `n` (for child processes)."""
    env = dict(os.environ)
    if n:
        env.update({k: str(n) for k in THREAD_VARS})
    return env


def short(model: str) -> str:
    """builtin:smollm2-135m -> smollm2-135m (file names)."""
    return model.split(":", 1)[-1].replace("/", "_")


def exe(name: str = "ridgefill") -> str:
    """A console script of this venv (next to the running python)."""
    return str(Path(sys.executable).with_name(name))


def machine() -> dict:
    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        up = ""
    out = {"uptime": up, "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
           "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if "torch" in sys.modules:
        out["torch_threads"] = sys.modules["torch"].get_num_threads()
    return out


def write_json(path: Path, obj: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def med(xs) -> float:
    return float(statistics.median(xs))


def model_cache(store: Path, model: str):
    """Resolve `model` and make sure its dequantized cache is in `store` (seconds spent building it, if any).
    Returns the ModelRef."""
    from ridgefill.models import resolve_model
    from ridgefill.models.load import gguf_cache_dir

    store = Path(store)
    ref = resolve_model(model, store_root=store)
    if ref.is_gguf:
        gguf_cache_dir(ref, store_root=store)
    return ref


def fresh_store(path: Path, store: Path = DEFAULT_STORE) -> Path:
    """An empty store at `path` whose models/ entries link to `store`'s model cache."""
    path = Path(path)
    (path / "models").mkdir(parents=True)
    src = Path(store) / "models"
    if src.is_dir():
        for p in src.iterdir():
            if not p.name.startswith("."):
                os.symlink(p.resolve(), path / "models" / p.name)
    return path


def load(model: str, store: Path = DEFAULT_STORE):
    """(ref, LoadedModel) from the bench store, the way capture loads it on a CPU (float32)."""
    from ridgefill.models import load_model

    ref = model_cache(store, model)
    return ref, load_model(ref, store_root=Path(store))


def source_texts() -> list[tuple[str, str]]:
    """(kind, text) in a fixed order: builtin:default's documents (Debian licenses, then the stdlib selection),
    then further standard-library modules, so that large corpora of short documents have text enough."""
    import sysconfig

    from ridgefill.capture.corpus import builtin_sources

    seen = set()
    out = []
    for p in builtin_sources():
        seen.add(p.resolve())
        out.append(("code" if p.suffix == ".py" else "prose", p.read_text(errors="replace")))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.glob("*.py")):
        if p.resolve() not in seen and not p.name.startswith("_") and 2_000 <= p.stat().st_size <= 60_000:
            out.append(("code", p.read_text(errors="replace")))
    return out


def make_corpus(tok, tokens: int, doc_tokens: int, dest: Path) -> dict:
    """Write ceil(tokens / doc_tokens) documents of `doc_tokens` tokens each (cut from the source texts, the
    remainders shorter than that dropped; prose and code pieces alternate) into `dest`; returns a description.

    The pieces are decoded back to text, so `ridgefill capture` re-tokenizes them: lengths come out within a few
    tokens of `doc_tokens` (plus a BOS where the tokenizer adds one). The first n documents of a larger corpus are
    the n documents of a smaller one."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    want = -(-tokens // doc_tokens)
    pieces: dict[str, list[str]] = {"prose": [], "code": []}
    for kind, text in source_texts():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids) - doc_tokens + 1, doc_tokens):
            pieces[kind].append(tok.decode(ids[i : i + doc_tokens]))
        if len(pieces["code"]) >= want:  # code is the larger source; prose is used up first
            break
    order = [p for pair in zip(pieces["prose"], pieces["code"]) for p in pair]
    order += pieces["code"][len(pieces["prose"]) :]
    if len(order) < want:
        raise SystemExit(f"not enough source text for {want} documents of {doc_tokens} tokens (have {len(order)})")
    for i, text in enumerate(order[:want]):
        (dest / f"{i:04d}.txt").write_text(text)
    return {"path": str(dest), "documents": want, "doc_tokens": doc_tokens, "tokens_approx": want * doc_tokens}


def corpus_for(model: str, tokens: int, doc_tokens: int, root: Path, tok=None) -> Path:
    """make_corpus into `root/<model>-<tokens>x<doc_tokens>` (kept between runs: it depends only on its inputs)."""
    dest = Path(root) / f"corpus-{short(model)}-{tokens}x{doc_tokens}"
    if not (dest / ".done").is_file():
        if tok is None:
            from transformers import AutoTokenizer

            from ridgefill.models.load import gguf_cache_dir

            ref = model_cache(DEFAULT_STORE, model)
            src = gguf_cache_dir(ref, store_root=DEFAULT_STORE)[0] if ref.is_gguf else ref.path
            tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        import shutil

        shutil.rmtree(dest, ignore_errors=True)
        make_corpus(tok, tokens, doc_tokens, dest)
        (dest / ".done").write_text("")
    return dest


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None, check: bool = True) -> dict:
    """Run `cmd`; its wall seconds, peak RSS in MiB (ru_maxrss from os.wait4: the largest of the process and its
    waited-for descendants), exit code, stdout and the tail of stderr."""
    with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=cwd)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
        so.seek(0)
        se.seek(0)
        stdout, stderr = so.read().decode(errors="replace"), se.read().decode(errors="replace")
    if check and rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(map(str, cmd))}\n{stderr[-3000:]}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "rc": rc, "stdout": stdout,
            "stderr_tail": stderr[-2000:]}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def artifact_dir(store: Path, stage: str, art_id: str) -> Path:
    return Path(store) / stage / art_id


def status_kib(field: str = "VmRSS") -> int:
    """This process's /proc/self/status field (VmRSS, VmHWM, RssAnon, RssFile) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
