"""The fill in a vLLM server (figure "vllm_fill"): time to first token of `vllm serve` with RIDGEFILL_RELEASE set
against the same server without it, side by side in one run, and the multi-user figure.

    .venv/bin/python bench/vllm_serve_bench.py [RELEASE_DIR] [--model builtin:smollm2-135m] [--lengths 2048 4096 8192]
        [--repeat 3] [--users 3] [--user-prompt 1024] [--arriving 4096] [--dtype auto] [--tp 1] [--threads 0]
        [--out FILE]

(8000, not 8192: SmolLM2's context is 8192 positions, the prompt and its first token included.)

Needs the vLLM environment (scripts/setup-engines.sh vllm, which installs the plugin) and a release of `--model`
(default release/smollm2-135m, the main job's, of builtin:smollm2-135m). Two OpenAI-compatible servers run at once
on this machine with vLLM's defaults (chunked prefill with the server's default budget, prefix caching, the compiled
forward): "stock" and "fill" (RIDGEFILL_RELEASE=RELEASE), both serving the folder `ridgefill engine model` writes
(in bfloat16 with `--dtype bfloat16`). Only one of them is sent work at any moment; their requests alternate.

- Time to first token: for each length N, --repeat rounds after a warm-up (one prompt of the shortest length per
  server: vLLM preallocates its cache and runs every length with the same kernels, so a warm-up round of every
  length would add a third to a 3-round run); in each round both servers get the same new prose prompt (its own per
  round, so no prefix-cache hit) as a streamed one-token completion, stock first in even rounds and fill first in
  odd ones. Speed-up = median stock / median fill; `share_N` = speed-up /
  compute ceiling, the ceiling being 1 / ((S(N-T) + LT) / (LN)) with the release's split S and tail T.
- Multi-user (the paper's serving figure): --users streamed completions of --user-prompt prompt tokens decode
  (`ignore_eos`); once each has streamed 8 tokens, a new --arriving-token request arrives. Measured: the new
  request's time to first token, the decoding users' tokens per second between its arrival and its first token,
  and their longest stall (the largest gap between two of a user's tokens in that window), stock vs fill, median
  over --repeat interleaved rounds after a warm-up round (its new request cut to the shortest length). `--users 0`
  skips it (time to first token only).
- `--tp N` serves with vLLM's tensor_parallel_size N, each rank's threads bound to its share of this machine's
  cores (harness.vllm_ranks_env). Set VLLM_CPU_KVCACHE_SPACE lower then (it is per rank; default 4 GiB here). With
  one rank vLLM binds the threads itself, keeping a core for its scheduler: on 2 cores the forward runs on one.

Value: share_N and speed-up per length, and share_long, the least share at 8,000 tokens and beyond (the target's
figure: filled rows are worth most on long prompts); the multi-user figures are in the details.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    REPO, Bench, Parser, count, engine_model, env_threads, positive, release, vllm_ranks_env)

MODEL = "builtin:smollm2-135m"
VLLM = REPO / ".engines" / "vllm"
LONG = 8000  # share_long, the target's figure: the least share from here up (SmolLM2's context ends at 8,192)
USER_TOKENS = 2048  # what a decoding user asks for: more than it streams before the new request's first token


def arguments():
    ap = Parser(__doc__)
    ap.add_argument("release", type=release, nargs="?", default=REPO / "release" / "smollm2-135m")
    ap.add_argument("--model", default=MODEL, help="the model the release is for (a built-in, Hub id or path)")
    ap.add_argument("--lengths", type=positive, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--repeat", type=positive, default=3)
    ap.add_argument("--users", type=count, default=3, help="decoding users of the multi-user figure (0: skip it)")
    ap.add_argument("--user-prompt", type=positive, default=1024)
    ap.add_argument("--arriving", type=positive, default=4096)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--tp", type=positive, default=1, help="vLLM's tensor_parallel_size")
    ap.add_argument("--store", type=Path, default=None, help="ridgefill store (default: a fresh temporary one)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default bench/out/vllm_fill-<model>.json)")
    ap.set_defaults(threads=0)
    args = ap.parse_args()
    if not (VLLM / ".done").is_file():
        ap.error("the vLLM environment is not built: run scripts/setup-engines.sh vllm")
    if not (args.release / "ridgefill.json").is_file():
        ap.error(f"no release at {args.release}: run scripts/main.sh")
    return args


# -- the servers ---------------------------------------------------------------------------------------------------


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` server) on a free local port."""

    def __init__(self, name: str, model: Path, release: Path | None, args, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # vLLM places its own threads (one per core, bound); MKL_NUM_THREADS / OPENBLAS_NUM_THREADS set for it made
        # its CPU prefill three times slower here, so the servers get the thread variables only with --threads N.
        env = {k: v for k, v in env_threads(args.threads).items() if k != "RIDGEFILL_RELEASE"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # else the CPU backend wants 92 % of the memory free
        env |= vllm_ranks_env(args.tp)
        if release is not None:
            env["RIDGEFILL_RELEASE"] = str(release)
        multi = [args.arriving, args.user_prompt + USER_TOKENS] if args.users else []
        longest = max([*args.lengths, *multi]) + 16
        cmd = [VLLM / "bin" / "python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--port", str(self.port), "--dtype", args.dtype, "--max-model-len", str(longest), "--seed", "0",
               "--tensor-parallel-size", str(args.tp)]
        self.name, self.model, self.log = name, str(model), log
        # A process group of its own: the idle server is paused (SIGSTOP) while the other one is timed. vLLM's
        # processes poll their queues while idle, which on a 2-core machine would take cores from the other.
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)  # fmt: skip

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.wait(60)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm_fill: the {self.name} server stopped:\n{self.log.read_text()[-3000:]}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"vllm_fill: the {self.name} server did not start in {timeout} s")
            time.sleep(2)

    def stream(self, ids: list[int], max_tokens: int, arrivals: list, stop: threading.Event | None = None,
               ignore_eos: bool = False, errors: list | None = None) -> float:
        """A streamed completion; appends each token chunk's arrival time (perf_counter) to `arrivals`; returns the
        time it was sent. Stops reading (closing the connection aborts the request) when `stop` is set. A failure
        goes to `errors` when given (a thread's), else ends the bench."""
        try:
            return self._stream(ids, max_tokens, arrivals, stop, ignore_eos)
        except (OSError, RuntimeError) as e:
            if errors is None:
                raise SystemExit(f"vllm_fill: {e}") from None
            errors.append(str(e))
            return 0.0

    def _stream(self, ids, max_tokens, arrivals, stop, ignore_eos) -> float:
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": ignore_eos}).encode()  # fmt: skip
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        sent = time.perf_counter()
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{self.name} answered {r.status}: {r.read()[:500]!r}")
        while not (stop and stop.is_set()):
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                arrivals.append(time.perf_counter())
        c.close()
        return sent

    def ttft(self, ids: list[int]) -> float:
        arrivals: list[float] = []
        sent = self.stream(ids, 1, arrivals)
        return arrivals[0] - sent

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def multi_user(server: Server, users: list[list[int]], arriving: list[int]) -> dict:
    """`users` decode; once each has streamed 8 tokens, `arriving` is sent: its time to first token, and the
    decoding users' tokens/s and longest stall until then."""
    stop, errors = threading.Event(), []
    arrivals = [[] for _ in users]
    threads = [threading.Thread(target=server.stream, args=(ids, USER_TOKENS, got, stop, True, errors), daemon=True)
               for ids, got in zip(users, arrivals)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.time() + 900
    while min(len(a) for a in arrivals) < 8:
        if errors:
            raise SystemExit(f"vllm_fill: {errors[0]}")
        if time.time() > deadline:
            raise SystemExit(f"vllm_fill: the {server.name} users did not start decoding")
        time.sleep(0.05)
    first: list[float] = []
    sent = server.stream(arriving, 1, first)
    end = first[0]
    time.sleep(0.5)  # the users' next tokens, to see the stall that ends after the new request's prefill
    stop.set()
    rates, stalls = [], []
    for a in arrivals:
        window = [t for t in a if sent <= t <= end]
        rates.append(len(window) / (end - sent))
        before = [t for t in a if t < sent][-1:]
        after = [t for t in a if t > end][:1]
        seen = before + window + after
        stalls.append(max(b - x for x, b in zip(seen, seen[1:])))
    for t in threads:
        t.join(60)
    return {"ttft_s": end - sent, "users_tokens_per_s": statistics.mean(rates), "longest_stall_s": max(stalls)}


# -- the figure ----------------------------------------------------------------------------------------------------


def spread(xs) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "runs": [round(x, 4) for x in xs]}  # fmt: skip


def main() -> None:
    args = arguments()
    with Bench("vllm_fill", args, args.model) as bench:
        from ridgefill.engines.vllm.served import load as load_release
        from ridgefill.evaluate.texts import prose_prompts
        from ridgefill.runtime import ceiling

        from transformers import AutoTokenizer

        rel = load_release(args.release)
        L, S, T = rel.model["num_layers"], rel.split, rel.tail
        folder = engine_model(bench, args.model, args.dtype)
        tok = AutoTokenizer.from_pretrained(folder)
        rounds = args.repeat + 1  # round 0 warms up
        needed = 1 + args.repeat * len(args.lengths) + (rounds * (1 + args.users) if args.users else 0)
        longest = max([*args.lengths, *([args.arriving, args.user_prompt] if args.users else [])])
        pool = iter(prose_prompts(tok, longest, min(needed, 79)))
        servers = {"stock": Server("stock", folder, None, args, bench.scratch / "stock.log"),
                   "fill": Server("fill", folder, args.release, args, bench.scratch / "fill.log")}
        try:
            for s in servers.values():
                s.wait()
                s.pause()

            @contextlib.contextmanager
            def running(k):  # server `k` runs while the other one stays paused
                servers[k].resume()
                try:
                    yield servers[k]
                finally:
                    servers[k].pause()

            ttft = {n: {k: [] for k in servers} for n in args.lengths}
            for rnd in range(rounds):
                order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
                for n in args.lengths if rnd else [min(args.lengths)]:
                    ids = next(pool)[:n]
                    for k in order:
                        with running(k) as server:
                            t = server.ttft(ids)
                        if rnd:
                            ttft[n][k].append(t)
                    print(f"round {rnd} N={n}: " + ", ".join(f"{k} {ttft[n][k][-1]:.2f} s" for k in order
                                                           if rnd), file=sys.stderr)  # fmt: skip
            users = {k: [] for k in servers}
            for rnd in range(rounds if args.users else 0):
                order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
                group = [next(pool)[: args.user_prompt] for _ in range(args.users)]
                arriving = next(pool)[: args.arriving if rnd else min(args.lengths)]
                for k in order:
                    with running(k) as server:
                        got = multi_user(server, group, arriving)
                    if rnd:
                        users[k].append(got)
                print(f"multi-user round {rnd}: {users if rnd else 'warm-up'}", file=sys.stderr)
            logs = {k: s.log.read_text() for k, s in servers.items()}
        finally:
            for s in servers.values():
                s.close()
        value, table = {}, {}
        for n in args.lengths:
            med = {k: statistics.median(v) for k, v in ttft[n].items()}
            top = 1 / ceiling(n, T, S, L)
            speedup = med["stock"] / med["fill"]
            value[f"share_{n}"] = round(speedup / top, 3)
            value[f"speedup_{n}"] = round(speedup, 3)
            table[n] = {"stock_s": spread(ttft[n]["stock"]), "fill_s": spread(ttft[n]["fill"]),
                        "speedup": round(speedup, 3), "ceiling": round(top, 3), "share": round(speedup / top, 3)}
        long = [value[f"share_{n}"] for n in args.lengths if n >= LONG]
        if long:
            value["share_long"] = min(long)
        multi = {k: {m: spread([u[m] for u in v]) for m in ("ttft_s", "users_tokens_per_s", "longest_stall_s")}
                 for k, v in users.items()} if args.users else None  # fmt: skip
        filled = [line for line in logs["fill"].splitlines() if "ridgefill: release" in line]
        details = {"release": str(args.release), "split": S, "tail": T, "layers": L, "repeat": args.repeat,
                   "dtype": args.dtype, "tp": args.tp, "threads": args.threads, "ttft": table, "multi_user": multi,
                   "users": args.users, "user_prompt": args.user_prompt, "arriving": args.arriving,
                   "fill_log": filled}  # fmt: skip
        checks = {"the fill server says once per rank what is on": len(filled) == args.tp,
                  "the stock server runs no fill": "ridgefill" not in logs["stock"]}  # fmt: skip
        print(json.dumps({"ttft": table, "multi_user": multi}, indent=1), file=sys.stderr)
        bench.finish(value, details=details, checks=checks)


if __name__ == "__main__":
    main()
