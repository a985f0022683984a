"""The measurements eval and sweep share: each arm of a prompt built from one exact run (`fills`), the long-document
figures (`measure_documents`), needle retrieval (`measure_needles`) and timed prefills (`time_prefills`).

A measurement takes `sources`, {key: MapsSource}: eval measures one (key None), sweep one per split (key: the
split). Every prompt gets one exact forward that keeps the hidden state entering every source's split; each
(source, arm) then runs only its late layers on top of it (`runtime.prefill_from`), so the arms of one prompt are
paired. A `Checkpoint` makes a long measurement resumable: rows measured before a stop are kept, and the next run
starts at the first prompt without one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm
from ridgefill.evaluate.source import MapsSource


class Checkpoint:
    """The rows measured so far (documents, needle prompts), in `<work>/rows.json`, rewritten by rename after each
    prompt: a measurement that is stopped (even killed) resumes at the next prompt, with the same result."""

    def __init__(self, work):
        self.path = Path(work) / "rows.json"
        self.rows = json.loads(self.path.read_text()) if self.path.is_file() else {"documents": [], "needles": []}

    def add(self, kind: str, row: dict) -> None:
        self.rows.setdefault(kind, []).append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, self.rows)


class _Rows:
    """Where a measurement puts its rows: a list, or a `Checkpoint` (which also holds the rows measured before)."""

    def __init__(self, kind: str, done: Checkpoint | None):
        self.kind, self.done = kind, done
        self.rows = done.rows.setdefault(kind, []) if done is not None else []

    def add(self, row: dict) -> None:
        if self.done is not None:
            self.done.add(self.kind, row)
        else:
            self.rows.append(row)


def fill_args(src: MapsSource, arm: Arm, tail: int) -> dict:
    """prefill / prefill_from options of a fill arm ("+rows" with the source's row share)."""
    args = {"split": src.split, "tail": tail, "maps": src.maps if arm.base == "ridgefill" else None,
            "map_kinds": src.map_kinds, "anchor": src.anchor, "exact_norm": src.exact_norm}
    if src.states:
        args["states"] = src.states
    if arm.selector == "rows" and arm.control is None:
        args["row_share"] = src.row_share
    if arm.corrections:
        args["corrections"] = arm.corrections
        if "state" in arm.corrections:
            args["state_offsets"] = src.state_offsets
    return args


def rows_rng(seed: int, ids) -> np.random.Generator:
    """The random control's generator for one prompt: a function of the eval seed and the prompt's tokens."""
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def fills(lm, run, src: MapsSource, arms, tail: int, probe=None, logits_rows=None, seed: int = 0,
          timed: bool = False, counted=()) -> tuple[dict, dict]:
    """Each arm's PrefillResult for one prompt, and the number of rows each selected-rows arm added.

    With `timed` every arm is a real, timed `prefill`; otherwise the arms are built from the prompt's exact run
    (`runtime.prefill_from`: the fill arms only run their late layers; "+rows" also its probe rows, or a prefill of
    its own where the run lacks the keys it selects from). A selector's rows are the prefix rows it makes exact
    beyond the arm's own exact rows (row 0 and the rows above the exact-row norm); its controls get as many: random
    filled rows, or a longer tail. `counted`: names of selector arms wanted only for their rows (a control's
    count): they get no result, and no late layers run for them."""
    from ridgefill.runtime import fill_rows, prefill, prefill_from, selects_from

    ids = run.ids
    n = int(ids.shape[0])

    def own_prefill(base: str) -> bool:  # a prefill of its own, not one built from the exact run
        return timed or (base == "ridgefill+rows" and not selects_from(lm, run, src.split))

    def fill(arm, base: str, **extra):
        args = fill_args(src, arm, tail) | extra
        if own_prefill(base):
            return prefill(lm, ids, base, logits_rows=logits_rows, **args)
        return prefill_from(lm, run, base, logits_rows=logits_rows, **args)

    def rows_of(arm, base: str, **extra) -> list[int]:
        if own_prefill(base):
            return fill(arm, base, **extra).exact_rows
        return fill_rows(lm, run, base, **(fill_args(src, arm, tail) | extra))

    res, added, own = {}, {}, None
    for arm in arms:
        if arm.base == "exact":
            res[arm.name] = prefill(lm, ids, "exact", split=src.split, tail=tail, logits_rows=logits_rows) \
                if timed else run.result(tail)
            continue
        if arm.base == "nofill":
            res[arm.name] = fill(arm, "nofill")
            continue
        if arm.selector is None:
            res[arm.name] = fill(arm, arm.base)
            own = own or res[arm.name].exact_rows
            continue
        if own is None:  # the arm's own exact rows (row 0, rows above the norm), as a plain fill has them
            own = rows_of(Arm("ridgefill"), "ridgefill")
        if arm.control is None:
            if arm.selector == "rows":
                how = ("ridgefill+rows", {"probe": probe} if probe is not None else {})
            else:  # the prefix rows holding a protected token, as the runtime's `protected` option picks them
                how = ("ridgefill", {"protected": src.protected})
            if arm.name in counted:
                rows = rows_of(arm, how[0], **how[1])
            else:
                res[arm.name] = fill(arm, how[0], **how[1])
                rows = res[arm.name].exact_rows
            added[arm.name] = sorted(set(rows) - set(own))
            continue
        count = len(added[arm.selected.name])
        if arm.control == "random":
            taken = set(own)
            free = np.array([p for p in range(n - tail) if p not in taken], dtype=np.int64)
            pick = sorted(rows_rng(seed, ids.cpu()).choice(free, size=min(count, len(free)), replace=False).tolist())
            res[arm.name] = fill(arm, "ridgefill", exact_rows=pick)
        else:
            res[arm.name] = fill(arm, "ridgefill", tail=min(tail + count, n))
        added[arm.name] = count
    return res, {k: (len(v) if isinstance(v, list) else v) for k, v in added.items()}


# ----------------------------------------------------------------------------------------- long documents


def eval_documents(lm, tokens: int, count: int, calibration) -> list:
    """`count` evaluation documents with at least `tokens` tokens, none of them used for calibration (BadInput)."""
    from ridgefill.evaluate import texts

    docs = texts.long_documents(lm.tokenizer, tokens, limit=count)
    if len(docs) < count:
        raise BadInput(f"only {len(docs)} evaluation documents have {tokens} tokens")
    reused = texts.reused([(d.name, d.text) for d in docs], calibration)
    if reused:
        raise BadInput(f"evaluation documents were used for calibration: {', '.join(reused)}")
    return docs


SCORE_ELEMENTS = 1 << 20  # logits scored together: [rows, vocab] float64 temporaries of 8 MB


def _host(logits):
    """Logits (float32, on the model's head device) as a float32 numpy array on the host."""
    return logits.float().cpu().numpy()


class DocumentScore:
    """One document's exact side: its exact run (keeping the states entering `splits`, for the arms to build on),
    the exact loss on the last `scored` tokens, and which of them are key and novel. Calling it with an arm's
    PrefillResult (logits of the last `keep` rows) gives that arm's `metrics.doc_summary`."""

    def __init__(self, lm, ids, tail: int, scored: int, splits=()):
        from ridgefill.evaluate import metrics
        from ridgefill.runtime import exact_run

        n, self.keep, self.pick = len(ids), scored + 1, slice(0, scored)  # the first K of the last K+1 rows
        self.targets = ids[n - scored :].numpy()  # predict the scored tokens
        self.run = exact_run(lm, ids, splits=splits, logits_rows=self.keep)
        self.exact = _host(self.run.logits[self.pick])
        self.nll = metrics.token_nll(self.exact, self.targets)
        cut = exact_run(lm, ids[n - tail :], logits_rows=self.keep)  # the context cut to the tail
        self.key = metrics.key_mask(self.nll, metrics.token_nll(_host(cut.logits[self.pick]), self.targets))
        self.novel = metrics.novel_mask(ids.numpy(), n - scored)

    def __call__(self, res) -> dict:
        from ridgefill.evaluate import metrics

        la = _host(res.logits[self.pick])
        # A few rows at a time: the float64 [rows, vocab] temporaries of a whole stretch are 100 MB each, which the
        # allocator maps fresh (and the kernel zeroes) every time; a few rows' fit in memory it keeps. Row by row,
        # the figures are the same.
        step = max(1, SCORE_ELEMENTS // max(la.shape[1], 1))
        parts = [(metrics.token_nll(la[at : at + step], self.targets[at : at + step]),
                  metrics.kl_exact_arm(self.exact[at : at + step], la[at : at + step]),
                  metrics.top1_agree(self.exact[at : at + step], la[at : at + step]))
                 for at in range(0, max(len(la), 1), step)]  # fmt: skip
        nll, kl, top1 = (np.concatenate(x) for x in zip(*parts))
        return metrics.doc_summary(self.nll, nll, kl, top1, self.novel, self.key)


def measure_documents(lm, docs, length: int, sources: dict, arms, tail: int, scored: int, out, *, row,
                      seed: int = 0, done: Checkpoint | None = None, kind: str = "documents") -> list[dict]:
    """Per document (its first `length` tokens): each source's arms scored against exact on the last `scored`
    tokens. `row(name, tokens, {key: ({arm: doc_summary}, {arm: rows added})})` shapes each document's row; `kind`
    names the rows in a checkpoint holding several measurements."""
    import torch

    from ridgefill.runtime.rows import PROBE_ROWS

    rows = _Rows(kind, done)
    splits = sorted({l for src in sources.values() for l in src.reads})  # the states every source's maps read
    with out.progress("documents", total=len(docs)) as bar:
        for i, d in enumerate(docs):
            if i < len(rows.rows):  # measured before a stop
                continue
            ids = torch.tensor(d.ids[:length])
            n = len(ids)
            doc = DocumentScore(lm, ids, tail, scored, splits=splits)  # its exact run is shared by every arm
            probe = range(n - scored - PROBE_ROWS, n - scored)  # "+rows": the stretch just before the scored tokens
            per = {}
            for key, src in sources.items():
                res, added = fills(lm, doc.run, src, arms, tail, probe, logits_rows=doc.keep, seed=seed)
                per[key] = ({arm: doc(r) for arm, r in res.items()}, added)
            rows.add(row(d.name, n, per))
            del doc
            bar.update(i + 1, (i + 1) * n, f"doc {i + 1}/{len(docs)}")
    return rows.rows


# ------------------------------------------------------------------------------------------------- needles


def measure_needles(lm, suite: list, splits, jobs, out, *, row, batch: int | None = None,
                    done: Checkpoint | None = None, status=None) -> list[dict]:
    """Per needle sample: greedy answers from each job's prefill, scored. `jobs(run)` lists (key, arm, result or a
    function making it) for the sample's exact run (keeping the states entering `splits`); the prefills are made
    and decoded `batch` at a time (all at once by default), in one batched forward per step. `row(sample,
    {key: {arm: correct}}, extra)` shapes each sample's row, `extra` being what `jobs` returned beside the list."""
    import torch

    from ridgefill.evaluate.needles import decode_and_score
    from ridgefill.runtime import exact_run

    rows = _Rows("needles", done)
    with out.progress("needles", total=len(suite)) as bar:
        for i, s in enumerate(suite):
            if i < len(rows.rows):  # measured before a stop
                continue
            run = exact_run(lm, torch.tensor(s.prompt_ids), splits=splits)  # shared by every arm
            todo, extra = jobs(run)
            correct: dict = {}
            step = batch or max(len(todo), 1)
            for at in range(0, len(todo), step):
                chunk = todo[at : at + step]
                made = [r() if callable(r) else r for _, _, r in chunk]
                for (key, arm, _), ok in zip(chunk, decode_and_score(lm, s, made)):
                    correct.setdefault(key, {})[arm] = ok
            rows.add(row(s, correct, extra))
            del run
            bar.update(i + 1, (i + 1) * len(s.prompt_ids), f"sample {i + 1}/{len(suite)}"
                       + (status(rows.rows) if status else ""))
    return rows.rows


# ---------------------------------------------------------------------------------------------------- speed


def time_prefills(lm, src: MapsSource, arms, tail: int, prompts: dict, seed: int = 0) -> list[dict]:
    """The measured prefill speed: one real, timed `prefill` per arm and length ({length: prompt ids}), the arms
    interleaved within each length, so a slow spell of a shared machine does not favour one arm."""
    import torch

    from ridgefill.runtime import ExactRun

    rows = []
    for length, ids in sorted(prompts.items()):
        ids = torch.tensor(ids).to(lm.adapter.device)
        run = ExactRun(ids=ids, logits=None, cache=None, states={}, seconds=0.0)  # timed: every arm prefills
        res, _ = fills(lm, run, src, arms, tail, seed=seed, timed=True, logits_rows=1)
        rows.append({"length": length, "tokens": len(ids), "seconds": {a: r.seconds for a, r in res.items()}})
    return rows
