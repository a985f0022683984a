"""docs/runtime.md's Python example runs as written and prints what it says.

The example is the page's one fenced python block. It is run for real, with its model, store, release and prompt
file swapped for a tiny model, a temporary store, a release written for that model by the release writer, and a
short prompt. The release's maps are least-squares fits on the prompt's own hidden states with fewer prefix rows
than d + 1, so they reproduce each late layer's input exactly: the filled prefill must then give the exact
prefill's logits, and the printed continuation must be the stock model's own greedy one.
"""

import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest
import torch

from test_runtime import fit_maps, hidden_states, write_tiny_release

DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
PROMPT = ("The ridge map predicts a late layer's input from the split state. Keys and values are written from "
          "the prediction, and the tail")  # fmt: skip
SPLIT, TAIL, MAX_NEW = 1, 8, 20
pytestmark = pytest.mark.usefixtures("one_thread")


def example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, f"docs/runtime.md should hold exactly one python example, found {len(blocks)}"
    return blocks[0]


def stock_greedy(lm, ids, max_new):
    """Greedy tokens from full forwards of the stock model (no cache), stopping before end-of-sequence."""
    ids, out = list(ids), []
    with torch.no_grad():
        while len(out) < max_new:
            nxt = int(lm.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == lm.tokenizer.eos_token_id:
                break
            out.append(nxt)
            ids.append(nxt)
    return out


def test_example_is_ten_lines():
    """The example's length, blank lines included, pinned: ten lines in every version of the page so far. One that
    grows (or shrinks) changes what the page shows as the whole of using a release, so the change is made here too,
    on purpose."""
    assert len(example().rstrip("\n").splitlines()) == 10


def test_example_runs_and_prints_the_exact_continuation(lm_of, tiny_llama, tmp_path):
    from ridgefill.runtime import prefill

    lm = lm_of("llama")
    ids = lm.tokenizer(PROMPT)["input_ids"]
    n = len(ids)
    assert TAIL < n and n - TAIL < lm.adapter.hidden_size + 1  # interpolating maps: fewer prefix rows than d + 1
    maps = fit_maps(hidden_states(lm, torch.tensor(ids)), SPLIT, lm.adapter.num_layers, list(range(n - TAIL)))
    write_tiny_release(lm, tmp_path / "release", maps, SPLIT, TAIL)
    (tmp_path / "prompt.txt").write_text(PROMPT)

    code = example()
    swaps = {'"builtin:smollm2-135m"': repr(str(tiny_llama)), '"ridgefill-artifacts"': repr(str(tmp_path / "store")),
             '"release/smollm2-135m"': repr(str(tmp_path / "release")), '"README.md"': repr(str(tmp_path / "prompt.txt"))}  # fmt: skip
    for old, new in swaps.items():
        assert code.count(old) == 1, f"the example no longer names {old} once"
        code = code.replace(old, new)
    printed, scope = io.StringIO(), {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(DOC), "exec"), scope)

    exact = prefill(lm, ids, "exact", split=SPLIT, tail=TAIL)
    identity = prefill(lm, ids, "identity", split=SPLIT, tail=TAIL)
    res = scope["res"]
    assert res.arm == "ridgefill" and (res.split, res.tail, res.num_rows) == (SPLIT, TAIL, n)
    err = (res.logits - exact.logits).abs().max()
    assert err < 1e-3, err  # the release's maps reproduce the late layers' inputs
    assert (identity.logits - exact.logits).abs().max() > 100 * err  # and the fill did use them

    first, rest = printed.getvalue().split("\n", 1)
    assert re.fullmatch(rf"{n} rows, {n - TAIL} filled from layer {SPLIT} on, \d+\.\d\d s", first), first
    want = stock_greedy(lm, ids, MAX_NEW)
    assert want, "the tiny model should continue the prompt with at least one token"
    assert rest == lm.tokenizer.decode(want) + "\n"

    # "Continuing with transformers' generate": the page's two lines, run on the example's cache
    lines = re.search(r"\*\*Continuing with transformers' `generate`\.\*\*.*?\n\n((?:    [^\n]+\n)+)", DOC.read_text(),
                      flags=re.S).group(1)
    before = res.cache.get_seq_length()
    more = {**scope, "torch": torch}
    exec(compile(textwrap.dedent(lines), str(DOC), "exec"), more)
    new = more["out"][0, n:].tolist()
    assert new[: len(want)] == want  # the stock model's own continuation (generate may go on past end-of-sequence)
    assert res.cache.get_seq_length() > before  # generate extended the cache in place, as the page says
