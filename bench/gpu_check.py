"""The GPU check (figure "gpu"): one prepared command for a lent GPU machine, correctness first, then speed.

    bash scripts/gpu-check.sh [--dry-run]          # installs the carried wheels, then runs this file
    python3 bench/gpu_check.py [--dry-run] [--out DIR] [--budget SECONDS] [--wheels DIR]

Phases, each timed (its elapsed seconds printed and recorded), a failure recorded and the next phase run:

- env: versions, the GPU, and every requirement of ridgefill's closure (pyproject.toml, then each installed
  distribution's own requirements) against what this python imports: on the GPU machine, the image's packages
  with the carried wheels in front. One not met is logged and recorded (a wheel to add to scripts/gpu-wheels.sh).
- wheels (dry run only): the wheels of scripts/gpu-wheels.sh install into a clean --target with --no-index
  --no-deps, one distribution each at the wheel's version. No .whl folder: skipped, with the line that says so.
- correctness: tiny random llama, qwen3 and gemma3_text models (tests/tiny.py), through the CLI's own `main()`
  in this process, each with a temporary store: a capture on the device in bfloat16 (float32 products) has
  statistics within STATS_TOL of a capture on the CPU in float32; solve, quantize, export and verify from the
  device capture; eval's arms on the device; eval with `--device-map auto` and a `--max-memory` that forces
  offload (to the CPU on a GPU machine, to disk in the dry run); the runtime's `prefill(..., "ridgefill")` of
  the release on the device in float32 equals the CPU's within PREFILL_TOL.
- speed: a random-weight model of Llama-3.1-8B's shape in bfloat16, built on the GPU; the runtime's exact and
  ridgefill prefills (split 16 of 32, tail 512, random maps: time does not depend on their values) at 8K, 16K
  and 32K tokens, arms interleaved, the median of `--repeat` runs after a warm-up, with SDPA restricted to its
  flash and memory-efficient kernels (no O(N^2) math fallback); each speed-up as a share of the compute ceiling
  (`ridgefill.runtime.ceiling`); peak GPU memory per arm. A size whose predicted time does not fit in what is
  left of the budget is skipped and recorded so.
- capture: capture's per-chunk work against the plain decoder-stack forward on the same chunks of the same
  model (bench/capture_bench.py's profile arms: `document_chunks` alone, then with `fitted_moments` +
  `merge_into` after each chunk), and the peak GPU memory of each.

`--dry-run` takes the same steps on the CPU at tiny sizes (the 8B shape replaced by one of the same layout,
lengths 256/512/1024, tail 64), for CI. The result is one JSON in the bench schema (bench/harness.py) at
OUT/gpu.json (OUT: --out, else $OUT, else bench/out/gpu); its value: each length's share of the ceiling,
their minimum (the target, FIGURES["gpu"]) and the capture ratio. Exit 1 when a correctness check fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent / "tests"))  # tests/tiny.py: the tiny models

from harness import REPO, Bench, Parser, machine  # noqa: E402

STATS_TOL = 0.05  # relative Frobenius error of a bfloat16 capture's statistics against float32 (measured ~1e-2)
PREFILL_TOL = 1e-3  # max |logit difference| / max |logit|, float32 on the device against the CPU
TINY_ARCHS = ("llama", "qwen3", "gemma3_text")
SPLIT_TINY = 2  # of the tiny models' 4 layers
# eval at tiny sizes: one needle prompt of 300 tokens, one document of 128 for the NLL figures
EVAL_TINY = ["--tail", "32", "--scored", "16", "--doc-tokens", "128", "--lengths", "300", "--depths", "0.5",
             "--tasks", "single", "--documents", "1", "--samples", "1"]
# (layers, d, heads, KV heads, MLP, vocab): Llama-3.1-8B, and the same layout small for the dry run
SHAPE_8B = (32, 4096, 32, 8, 14336, 128256)
SHAPE_DRY = (4, 256, 8, 2, 896, 4096)


# ------------------------------------------------------------------------------------------------- pure helpers


def rel_err(a, b) -> float:
    """‖a - b‖ / ‖b‖ (Frobenius, float64); 0 when both are zero."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def ceiling_share(speedup: float, n: int, tail: int, split: int, layers: int) -> float:
    """A measured speed-up as a share of the compute ceiling 1 / ceiling(N, T, S, L) (`ridgefill.runtime`)."""
    from ridgefill.runtime import ceiling

    return speedup * ceiling(n, tail, split, layers)


def predicted_seconds(seconds: float, n_from: int, n_to: int) -> float:
    """Time at n_to rows from a time measured at n_from, scaled as (n_to / n_from)^2: attention's share grows
    quadratically, the rest linearly, so this bounds the time from above for n_to >= n_from."""
    return seconds * (n_to / n_from) ** 2


class Clock:
    """The run's time budget and its phases: `with clock.phase(name) as rec:` times one, prints its elapsed time
    and records its status ("ok", "failed" with the error's last line, or what the body set, e.g. "skipped")."""

    def __init__(self, budget: float):
        self.start, self.budget, self.phases = time.perf_counter(), budget, {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    @contextlib.contextmanager
    def phase(self, name: str):
        rec = {"status": "ok"}
        self.phases[name] = rec
        log(f"phase {name}: start ({self.left():.0f} s of the budget left)")
        t = time.perf_counter()
        try:
            yield rec
        except Exception as exc:  # noqa: BLE001 -- recorded; the next phase still runs
            rec["status"] = "failed"
            rec["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            log(traceback.format_exc())
        rec["seconds"] = round(time.perf_counter() - t, 2)
        log(f"phase {name}: {rec['status']} in {rec['seconds']:.1f} s (total {self.elapsed():.1f} s)")


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------- phase: env


def requirement_check() -> dict:
    """Every requirement reachable from ridgefill's pyproject.toml through installed distributions' metadata:
    {name: {"need": specifiers, "have": version or None, "ok": bool}}."""
    import re
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    todo = list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    out, seen = {}, set()
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = norm(req.name)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        entry = out.setdefault(name, {"need": [], "have": have, "ok": have is not None})
        if str(req.specifier):
            entry["need"].append(str(req.specifier))
            entry["ok"] = entry["ok"] and req.specifier.contains(have, prereleases=True)
        if have is not None and name not in seen and name not in ("torch", "numpy"):
            seen.add(name)
            todo.extend(metadata.requires(name) or [])
    return dict(sorted(out.items()))


def phase_env(device: str) -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "cuda": torch.version.cuda, "requirements": requirement_check()}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                       "multiprocessors": p.multi_processor_count}
    bad = {k: v for k, v in info["requirements"].items() if not v["ok"]}
    for k, v in bad.items():
        log(f"requirement not met: {k} {', '.join(v['need'])} (have {v['have']})")
    info["requirements_met"] = not bad
    return info


def phase_wheels(wheels: Path, scratch: Path) -> dict:
    """Install the carried wheels into a clean --target with --no-index --no-deps; each wheel's distribution must
    land there at its version, once."""
    found = sorted(wheels.glob("*.whl"))
    target = scratch / "site"
    # as the GPU machine's python installs them: CPython 3.12 on x86-64 Linux, whatever python runs here
    where = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
             *[x for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
               for x in ("--platform", p)]]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", *where, "--target", str(target), *map(str, found)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"pip install --target failed: {p.stderr.strip()[-500:]}")
    want = sorted("-".join(w.name.split("-")[:2]).lower() for w in found)  # name-version, as the wheel spells it
    got = sorted(d.name.removesuffix(".dist-info").lower() for d in target.glob("*.dist-info"))
    return {"wheels": [w.name for w in found], "bytes": sum(w.stat().st_size for w in found),
            "installed": got, "match": want == got}


# ------------------------------------------------------------------------------------------ phase: correctness


STEPS: dict = {}  # "arch: command" -> seconds, for the record


def cli(*args) -> dict:
    """`ridgefill ARGS --json` through `ridgefill.cli.main` in this process; its JSON document (exit 0 required)."""
    from ridgefill.cli import main

    t = time.perf_counter()

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["ridgefill", *map(str, args), "--json"]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    STEPS[f"{len(STEPS)} {args[0]}"] = round(time.perf_counter() - t, 2)
    if code:
        raise RuntimeError(f"ridgefill {' '.join(map(str, args[:2]))} exited {code}: {err.getvalue().strip()[-800:]}")
    return json.loads(out.getvalue())


def corpus(dest: Path) -> Path:
    """Six short documents cut from the built-in corpus's text (one for held-out rows)."""
    from harness import source_texts

    dest.mkdir(parents=True, exist_ok=True)
    for i, (_, text) in enumerate(source_texts()[:6]):
        (dest / f"{i}.txt").write_text(text[:3000])
    return dest


def stats_error(store: Path, cpu_id: str, dev_id: str, split: int) -> dict:
    """Relative errors of the device capture's statistics against the CPU's, per field."""
    from ridgefill.artifacts import Store
    from ridgefill.capture.artifact import load_stats

    st = Store(store)
    a, b = (load_stats(st.get(i, stage="capture"), split) for i in (dev_id, cpu_id))
    assert a.n == b.n, (a.n, b.n)
    return {f: round(rel_err(getattr(a, f), getattr(b, f)), 6) for f in ("mean_x", "cxx", "mean_y", "cxy", "yy")}


def prefill_error(model_dir: Path, store: Path, release: Path, device: str, tail: int) -> float:
    """max |logits on `device` - logits on the CPU| / max |CPU logits| of the release's ridgefill prefill, float32."""
    import torch

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps, prefill

    ref = resolve_model(str(model_dir), store_root=store)
    ids = torch.randint(3, 300, (4 * tail,), generator=torch.Generator().manual_seed(0))
    logits = []
    for dev in ("cpu", device):
        lm = load_model(ref, store_root=store, device=dev, dtype="float32")
        rel = load_release_maps(lm, release)
        logits.append(prefill(lm, ids, "ridgefill", split=rel.split, tail=tail, maps=rel.maps).logits.cpu())
    return float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())


def flags(name: str, values) -> list[str]:
    return [x for v in values for x in (name, v)]


def eval_arms(doc: dict) -> dict:
    """{arm: its figures} of an eval's JSON document; {} when the eval came from the store (it did not run) or a
    figure is not finite."""
    import math

    if doc["cached"]:
        return {}
    arms = {a: {k: v for k, v in s.items() if k in ("needle", "dnll", "kl", "top1", "prefill_s")}
            for a, s in doc["summary"]["arms"].items()}
    finite = all(math.isfinite(v) for s in arms.values() for v in s.values() if isinstance(v, (int, float)))
    return arms if finite else {}


def phase_correctness(dry: bool, device: str, scratch: Path, checks: dict) -> dict:
    from tiny import make_tiny_model

    data = corpus(scratch / "data")
    # Offload: the GPU gets room for the embeddings and a layer or so of a tiny model (~75 KB a layer in bfloat16,
    # and accelerate keeps the largest layer's size free), the rest goes to CPU memory; a CPU-only dry run puts
    # what exceeds its CPU budget on disk.
    offload = ["--max-memory", "cpu=60KB"] if dry else ["--max-memory", "0=250KB", "--max-memory", "cpu=4GiB"]
    out = {}
    for arch in TINY_ARCHS:
        t = time.perf_counter()
        rec = out[arch] = {}
        model = make_tiny_model(scratch / arch, arch=arch, context=1024)
        store = scratch / f"store-{arch}"
        common = ["--data", data, "--split", SPLIT_TINY, "--chunk", 64, "--held-out", 1, "--held-out-rows", 64,
                  "--max-length", 256, "--store", store]
        cap_cpu = cli("capture", model, *common, "--device", "cpu", "--dtype", "float32")["id"]
        cap_dev = cli("capture", model, *common, "--device", device, "--dtype", "bfloat16")["id"]
        rec["capture_ids"] = {"cpu_float32": cap_cpu, f"{device}_bfloat16": cap_dev}
        rec["stats_rel_err"] = err = stats_error(store, cap_cpu, cap_dev, SPLIT_TINY)
        checks[f"{arch}: bfloat16 capture on {device} within {STATS_TOL} of float32 on cpu"] = max(err.values()) <= STATS_TOL
        place = ["--device", device, "--dtype", "bfloat16", "--store", store]
        sol = cli("solve", cap_dev, *place)["id"]
        qnt = cli("quantize", sol, *place)["id"]
        release = scratch / f"release-{arch}"
        cli("export", qnt, "--out", release, "--store", store)
        verify = cli("verify", release)
        rec["chain"] = {"solve": sol, "quantize": qnt, "release": str(release), "verify": verify}
        checks[f"{arch}: solve, quantize, export from the {device} capture verify"] = True  # cli() raised otherwise
        arms = ("exact", "ridgefill", "identity", "nofill")
        rec["eval"] = ev = eval_arms(cli("eval", model, release, *EVAL_TINY, *flags("--arms", arms), *place))
        checks[f"{arch}: eval's arms on {device}"] = sorted(ev) == sorted(arms)
        rec["eval_device_map"] = ev = eval_arms(cli("eval", model, release, *EVAL_TINY, *flags("--arms", arms[:2]),
                                                    "--device", device, "--device-map", "auto", *offload,
                                                    "--store", store))
        checks[f"{arch}: eval with --device-map auto, offloaded"] = sorted(ev) == sorted(arms[:2])
        rec["prefill_rel_err"] = e = prefill_error(model, store, release, device, tail=32)
        checks[f"{arch}: ridgefill prefill on {device} within {PREFILL_TOL} of cpu"] = e <= PREFILL_TOL
        rec["seconds"] = round(time.perf_counter() - t, 2)
        log(f"{arch}: stats {err}, prefill {e:.2e}, {rec['seconds']:.1f} s")
    return out


# ------------------------------------------------------------------------------------------------ phase: speed


def shaped_model(shape: tuple, device: str, context: int):
    """A random-weight Llama of `shape` (layers, d, heads, KV heads, MLP, vocab) in bfloat16, made directly on
    `device` (no CPU copy of its weights), wrapped as ridgefill's LoadedModel."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ridgefill.models.adapters import adapter_for
    from ridgefill.models.load import LoadedModel
    from ridgefill.models.spec import ModelRef

    L, d, heads, kv, mlp, vocab = shape
    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=mlp, num_hidden_layers=L,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=d // heads,
                         max_position_embeddings=context, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    ref = ModelRef(spec="gpu-check:random", kind="dir", path=Path("(in memory)"), name=f"llama-{L}x{d}",
                   revision=None, model_type="llama", num_layers=L, hidden_size=d, has_qk_norm=False,
                   fingerprint="0" * 64, context_length=context)
    return LoadedModel(ref=ref, model=model, tokenizer=None, adapter=adapter_for(model), device=device,
                       dtype="bfloat16")


def sdpa_fast(device: str):
    """On a GPU, SDPA restricted to its flash kernel (the causal, unmasked attention of every full-row layer) and
    the memory-efficient one (the masked tail rows of the fill's late layers); no math fallback, whose N x N
    scores would not fit at 32K. On a CPU, SDPA's own choice."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def peak_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def phase_speed(lm, device: str, lengths: list[int], tail: int, repeat: int, clock: Clock, reserve: float) -> dict:
    """Exact and ridgefill prefill per length (see the module docstring); a length whose predicted time would
    leave less than `reserve` seconds of the budget is skipped."""
    import torch

    from ridgefill.runtime import ceiling, maps_on_devices

    L, d = lm.adapter.num_layers, lm.adapter.hidden_size
    split = L // 2
    gen = torch.Generator().manual_seed(1)
    # Random maps near the identity: the fill's time does not depend on their values.
    maps = {l: (torch.eye(d) + 0.01 * torch.randn(d, d, generator=gen), torch.zeros(d)) for l in range(split, L)}
    maps = maps_on_devices(lm, maps, range(split, L))  # once, outside every clock
    vocab = lm.model.config.vocab_size
    out, last = {}, None
    for n in lengths:
        if last is not None:
            need = predicted_seconds(last[1], last[0], n)
            if need > clock.left() - reserve:
                out[str(n)] = {"skipped": f"predicted {need:.0f} s, {clock.left() - reserve:.0f} s left"}
                log(f"speed {n}: skipped ({out[str(n)]['skipped']})")
                continue
        t = time.perf_counter()
        ids = torch.randint(0, vocab, (n,), generator=gen)
        runs = {"exact": [], "ridgefill": []}
        peak = {}
        with sdpa_fast(device):
            for rep in range(repeat + 1):  # round 0 warms up
                for arm in runs:
                    peak_reset(device)
                    res = prefill_arm(lm, ids, arm, split, tail, maps)
                    if rep:
                        runs[arm].append(res.seconds)
                    peak[arm] = peak_gib(device)
                    del res
        med = {a: statistics.median(s) for a, s in runs.items()}
        speedup = med["exact"] / med["ridgefill"]
        out[str(n)] = {"median_s": {a: round(v, 4) for a, v in med.items()},
                       "runs_s": {a: [round(x, 4) for x in s] for a, s in runs.items()},
                       "speedup": round(speedup, 4), "ceiling_speedup": round(1 / ceiling(n, tail, split, L), 4),
                       "share": round(ceiling_share(speedup, n, tail, split, L), 4), "peak_gib": peak,
                       "seconds": round(time.perf_counter() - t, 2)}
        last = (n, out[str(n)]["seconds"])
        log(f"speed {n}: {out[str(n)]['median_s']}, share {out[str(n)]['share']}, peak {peak} GiB")
    return {"split": split, "layers": L, "tail": tail, "repeat": repeat, "lengths": out,
            "sdpa": "flash + memory-efficient" if device.startswith("cuda") else "default (cpu)"}


def prefill_arm(lm, ids, arm: str, split: int, tail: int, maps):
    from ridgefill.runtime import prefill

    if arm == "exact":
        return prefill(lm, ids, "exact", split=split, tail=tail)
    return prefill(lm, ids, "ridgefill", split=split, tail=tail, maps=maps)


# ---------------------------------------------------------------------------------------------- phase: capture


def phase_capture(lm, device: str, docs: int, doc_tokens: int, chunk: int) -> dict:
    """bench/capture_bench.py's arms on random token documents: `document_chunks` alone (the stack), then with
    capture's per-chunk step (`fitted_moments` + `merge_into`), after one warm-up document each; ratio = stack
    seconds / capture seconds."""
    import numpy as np

    from ridgefill.capture import CaptureConfig
    from ridgefill.capture.forward import document_chunks, exact_float32, fitted_moments
    from ridgefill.capture.stats import Moments, merge_into

    cfg = CaptureConfig(chunk=chunk)
    L, d = lm.adapter.num_layers, lm.adapter.hidden_size
    split = L // 2
    layers = list(range(split, L))
    rng = np.random.default_rng(2)
    vocab = lm.model.config.vocab_size
    texts = [rng.integers(0, vocab, doc_tokens) for _ in range(docs + 1)]  # [0]: the warm-up

    def stack(ids_list) -> float:
        sync(device)
        t = time.perf_counter()
        for x in ids_list:
            for _ in document_chunks(lm, x, layers, chunk, lm.adapter.device):
                pass
        sync(device)
        return time.perf_counter() - t

    def capture(ids_list) -> float:
        sync(device)
        t = time.perf_counter()
        for x in ids_list:
            part = Moments.empty(L - split, d, d)
            for start, hs in document_chunks(lm, x, layers, chunk, lm.adapter.device):
                for _, m in fitted_moments(hs, start, [split], L, cfg.outlier_ratio, cfg.product_dtype).items():
                    part = merge_into(part, m)
        sync(device)
        return time.perf_counter() - t

    out = {}
    with exact_float32(), sdpa_fast(device):
        for name, arm in (("stack", stack), ("capture", capture)):
            arm(texts[:1])
            peak_reset(device)
            out[f"{name}_s"] = round(arm(texts[1:]), 4)
            out[f"{name}_peak_gib"] = peak_gib(device)
    tokens = docs * doc_tokens
    out |= {"tokens": tokens, "documents": docs, "chunk": chunk, "split": split,
            "stack_tok_s": round(tokens / out["stack_s"], 1), "capture_tok_s": round(tokens / out["capture_s"], 1),
            "ratio": round(out["stack_s"] / out["capture_s"], 4)}
    log(f"capture: {out}")
    return out


# --------------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu.json (default $OUT, else bench/out/gpu)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 7 minutes)")
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the carried wheels (dry run: checked)")
    args = ap.parse_args()
    out_dir = args.out or Path(os.environ.get("OUT") or BENCH / "out" / "gpu")
    args.out, args.store = out_dir / "gpu.json", None  # what Bench reads
    dry = args.dry_run
    clock = Clock(args.budget)

    with Bench("gpu", args, None) as bench:
        import torch

        device = "cpu" if dry else "cuda"
        if not dry and not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no CUDA device (use --dry-run on a CPU)")
        scratch = bench.scratch
        checks, details = {}, {"dry_run": dry, "device": device, "budget_s": args.budget}
        with clock.phase("env") as rec:
            details["env"] = phase_env(device)  # a requirement not met is logged, not a failed check: pip's
            # bounds are not always what the code needs, and the phases after it show whether it runs
        if dry:
            with clock.phase("wheels") as rec:
                if not any(args.wheels.glob("*.whl")):
                    rec["status"] = "skipped"
                    rec["reason"] = f"no wheels in {args.wheels}: run scripts/gpu-wheels.sh to check them"
                    log(f"wheels: skipped: {rec['reason']}")
                else:
                    details["wheels"] = w = phase_wheels(args.wheels, scratch)
                    checks["wheels install with --no-index --no-deps, one each"] = w["match"]
        with clock.phase("correctness") as rec:
            details["correctness"] = phase_correctness(dry, device, scratch, checks)
        details["cli_seconds"] = STEPS
        checks["correctness ran"] = clock.phases["correctness"]["status"] == "ok"

        shape, lengths, tail, context = ((SHAPE_DRY, [256, 512, 1024], 64, 2048) if dry else
                                         (SHAPE_8B, [8192, 16384, 32768], 512, 32768))
        lm = None
        with clock.phase("model") as rec:
            t = time.perf_counter()
            lm = shaped_model(shape, device, context)
            rec["shape"] = dict(zip(("layers", "d", "heads", "kv_heads", "mlp", "vocab"), shape))
            rec["parameters"] = sum(p.numel() for p in lm.model.parameters())
            rec["build_s"] = round(time.perf_counter() - t, 2)
        capture_reserve = 20.0 if dry else 60.0  # what the capture phase after it needs
        if lm is not None:
            with clock.phase("speed") as rec:
                details["speed"] = phase_speed(lm, device, lengths, tail, 3, clock, capture_reserve)
            with clock.phase("capture") as rec:
                docs, doc_tokens, chunk = (2, 512, 128) if dry else (2, 4096, 1024)
                if clock.left() < capture_reserve / 2:
                    rec["status"] = "skipped"
                    rec["reason"] = f"{clock.left():.0f} s of the budget left"
                else:
                    details["capture"] = phase_capture(lm, device, docs, doc_tokens, chunk)
        details["phases"] = clock.phases
        details["elapsed_s"] = round(clock.elapsed(), 2)
        shares = {f"share_{n}": v["share"] for n, v in details.get("speed", {}).get("lengths", {}).items()
                  if "share" in v}
        value = {"share_min": min(shares.values()) if shares else None, **shares,
                 "capture": details.get("capture", {}).get("ratio")}
        details["machine_versions"] = {k: machine().get(k) for k in ("torch", "transformers")}
        bench.finish(value, details=details, checks=checks)


if __name__ == "__main__":
    main()
