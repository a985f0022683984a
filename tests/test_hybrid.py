"""Hybrid models (Gated DeltaNet layers between gated-attention layers): the whole chain on the tiny random
qwen3_next and qwen3_5 models through the CLI, solve's Gated DeltaNet score against a brute-force float64
computation from the raw weights, the filled layer's state against the stock layer run on the predicted inputs,
and the refusals. The runtime's arms are checked against the stock forward and `generate` in test_runtime.py."""

import json

import numpy as np
import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.capture.artifact import load_heldout
from ridgefill.errors import BadInput
from ridgefill.models.load import check_architecture
from ridgefill.runtime import prefill
from clirun import cli_here as cli  # in this process: no interpreter and torch start-up per command
from conftest import TINY_FIXTURES
from tiny import HYBRIDS

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [f"document {i}: " + "the cat sat on the mat and looked around. import os; print(x) " * (9 + i) for i in range(6)]
STATE_TEXTS = [f"state text {i}: " + "a river runs under the old stone bridge while birds sing. " * (12 + i) for i in range(2)]
EVAL = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--documents", "2",
        "--samples", "1"]  # fmt: skip


@pytest.fixture(scope="module", params=HYBRIDS)
def chain(request, tmp_path_factory):
    """capture -> solve -> quantize -> export -> verify -> eval on one tiny hybrid, through the CLI."""
    arch = request.param
    model = request.getfixturevalue(TINY_FIXTURES[arch])
    tmp = tmp_path_factory.mktemp(f"hybrid-{arch}")
    data = tmp / "data"
    data.mkdir()
    for i, t in enumerate(TEXTS):
        (data / f"d{i}.txt").write_text(t)
    state = tmp / "state"
    state.mkdir()
    for i, t in enumerate(STATE_TEXTS):
        (state / f"s{i}.txt").write_text(t)
    store = tmp / "store"
    ids, prev = {}, None
    for stage, args in (("capture", [model, "--data", data, "--split", "2", "--chunk", "64", "--held-out", "2"]),
                        ("solve", ["--state-data", state, "--state-chunk", "32"]), ("quantize", [])):  # fmt: skip
        args = args if stage == "capture" else [ids[prev], *args]
        r = cli(stage, *args, "--store", store, "--json")
        assert r.returncode == 0, r.stderr
        ids[stage], prev = json.loads(r.stdout)["id"], stage
    rel = tmp / "release"
    r = cli("export", ids["quantize"], "--out", rel, "--store", store)
    assert r.returncode == 0, r.stderr
    return {"arch": arch, "model": model, "store": store, "ids": ids, "release": rel, "state": state, "data": data}


def _rms(x, w, eps):
    """The hybrids' RMSNorm, (1 + w) scaled, in float64."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * (1 + w)


def _gdn_kv_brute(model, l, x):
    """Key and value parts of Gated DeltaNet layer l's input projection, per head, from the raw weights (float64)."""
    layer = model.model.layers[l]
    gdn, cfg = layer.linear_attn, model.config
    norm = layer.input_layernorm
    xn = _rms(x, norm.weight.double().numpy(), norm.eps)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    if hasattr(gdn, "in_proj_qkv"):  # Qwen3.5: [queries | keys | values]
        p = xn @ gdn.in_proj_qkv.weight.double().numpy().T
        return p[:, hk * dk : 2 * hk * dk].reshape(-1, hk, dk), p[:, 2 * hk * dk :].reshape(-1, hv, dv)
    p = (xn @ gdn.in_proj_qkvz.weight.double().numpy().T).reshape(len(x), hk, -1)  # per key head: q k v.. z..
    r = hv // hk
    return p[..., dk : 2 * dk], p[..., 2 * dk : 2 * dk + r * dv].reshape(-1, hv, dv)


def _attn_kv_brute(model, l, x):
    layer = model.model.layers[l]
    attn, norm, hd = layer.self_attn, layer.input_layernorm, model.config.head_dim
    xn = _rms(x, norm.weight.double().numpy(), norm.eps)
    k = (xn @ attn.k_proj.weight.double().numpy().T).reshape(len(x), -1, hd)
    k = _rms(k, attn.k_norm.weight.double().numpy(), attn.k_norm.eps)
    return k, (xn @ attn.v_proj.weight.double().numpy().T).reshape(len(x), -1, hd)


def _cos(a, b):
    return ((a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))).mean()


def test_solve_scores_gated_deltanet_layers_by_their_projections(chain):
    """Solve's held-out score of a Gated DeltaNet layer is the cosine of its key and value input projections from
    the predicted and the true input; an attention layer keeps keys and values (brute force, float64)."""
    from transformers import AutoModelForCausalLM

    from ridgefill.formats import safetensors

    store = Store(chain["store"])
    sol = store.get(chain["ids"]["solve"], stage="solve")
    rep = json.loads(sol.file("report.json").read_text())
    held = load_heldout(store.get(chain["ids"]["capture"], stage="capture"))
    model = AutoModelForCausalLM.from_pretrained(chain["model"], dtype=torch.float32).requires_grad_(False)
    maps = safetensors.load(sol.file("maps.safetensors"))[0]
    x = held["hidden.2"].astype(np.float64)
    for l, brute in ((2, _gdn_kv_brute), (3, _attn_kv_brute)):
        y = held[f"hidden.{l}"].astype(np.float64)
        y_hat = x @ maps[f"layer.{l}.weight"].astype(np.float64).T + maps[f"layer.{l}.bias"]
        (kp, vp), (kt, vt) = brute(model, l, y_hat), brute(model, l, y)
        got = rep["fitted"]["layers"][str(l)]
        assert got["k_cosine"] == pytest.approx(_cos(kp, kt), abs=2e-5)
        assert got["v_cosine"] == pytest.approx(_cos(vp, vt), abs=2e-5)


def test_release_and_eval(chain, lm_of):
    """The release verifies and carries its state offsets; eval's figures for every arm (the state and value-rescale
    corrections included) are what independent prefills of the same documents and needle prompts give
    (test_eval.recompute, test_eval.check_summary)."""
    from dataclasses import asdict

    from ridgefill.evaluate import EvalConfig
    from ridgefill.evaluate.source import load_source
    from test_eval import check_summary, recompute

    rel = chain["release"]
    man = json.loads((rel / "ridgefill.json").read_text())
    assert man["model"]["architecture"] == chain["arch"]
    assert man["layers"] == [{"index": 2, "kind": "linear_attention", "map": "input"},
                             {"index": 3, "kind": "full_attention", "map": "input"}]
    assert cli("verify", rel).returncode == 0
    assert sorted(p.name for p in rel.iterdir()) == ["README.md", "corrections.safetensors", "maps.safetensors",
                                                     "protected.safetensors", "ridgefill.json"]
    assert man["corrections"]["state"]["layers"] == [2] and man["corrections"]["state"]["chunk"] == 32
    arms = ("exact", "ridgefill", "identity", "nofill", "ridgefill+state", "ridgefill+vscale")
    r = cli("eval", chain["model"], rel, *EVAL, *[x for a in arms for x in ("--arms", a)], "--store", chain["store"],
            "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["summary"]
    assert set(s["arms"]) == set(arms)
    cfg = EvalConfig(arms=arms, tail=48, scored=16, doc_tokens=128, lengths=(600,), documents=2, samples=1)
    recipe = Store(chain["store"]).get(doc["id"]).recipe
    assert {k: recipe[k] for k in asdict(cfg)} == {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in asdict(cfg).items()}  # what the flags asked for
    docs, needles = recompute(lm_of(chain["arch"]), load_source(Store(chain["store"]), str(rel)), cfg)
    assert (len(docs), len(needles)) == (2, 6)  # one length x 2 depths x 3 tasks
    check_summary(s, docs, needles, arms)
    # each correction changes what the fill computes
    for arm in ("ridgefill+state", "ridgefill+vscale"):
        assert s["arms"][arm]["kl"] != s["arms"]["ridgefill"]["kl"], arm
    assert set(s["pairs"]) == {"ridgefill+state - ridgefill", "ridgefill+vscale - ridgefill"}
    assert json.loads((rel / "ridgefill.json").read_text())["eval"]["corrections"] == ["state", "vscale"]


def test_state_offsets_by_brute_force(chain, lm_of):
    """The solve's terminal-state offsets: the stock Gated DeltaNet layer run chunk by chunk on the true inputs and
    on the fill's (row 0 exact, the rest from the solved maps), sum(exact - filled) / sum(share) over chunk ends."""
    from ridgefill.formats import safetensors
    from ridgefill.runtime.corrections import filled_share
    from transformers import AutoTokenizer, DynamicCache

    lm = lm_of(chain["arch"])
    store = Store(chain["store"])
    sol = store.get(chain["ids"]["solve"], stage="solve")
    maps = safetensors.load(sol.file("maps.safetensors"))[0]
    got = safetensors.load(sol.file("state.safetensors"))[0]["layer.2.state_offset"]
    tok = AutoTokenizer.from_pretrained(chain["model"])
    W, b = (torch.tensor(maps[f"layer.2.{k}"]) for k in ("weight", "bias"))
    gdn, norm = lm.adapter.layers[2].linear_attn, lm.adapter.layers[2].input_layernorm
    diff, share = np.zeros(got.shape), np.zeros(got.shape[0])
    for text in STATE_TEXTS:
        ids = torch.tensor(tok(text)["input_ids"][: lm.model.config.max_position_embeddings])  # as solve cuts them
        with torch.no_grad():
            hs = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
            x_true, x_fill = hs[2][0], hs[2][0].clone()
            x_fill[1:] = hs[2][0][1:] @ W.T + b  # split 2: h_S is layer 2's own input
            filled = torch.ones(len(ids), dtype=torch.bool)
            filled[0] = False
            if hasattr(gdn, "in_proj_a"):  # Qwen3.5: its own projection
                a = gdn.in_proj_a(norm(x_fill))
            else:  # Qwen3-Next: per key head [b b a a]
                a = gdn.in_proj_ba(norm(x_fill)).view(len(ids), 2, 4)[..., 2:].reshape(len(ids), 4)
            gates = -gdn.A_log.exp() * torch.nn.functional.softplus(a + gdn.dt_bias)
            for end in range(32, len(ids) + 1, 32):
                states = []
                for x in (x_true, x_fill):
                    c = DynamicCache(config=lm.model.config)
                    gdn(norm(x[:end])[None], cache=c)  # one call over the whole run: the same state as chunk by chunk
                    states.append(c.layers[2].recurrent_states[0][0].double().numpy())
                diff += states[0] - states[1]
                share += filled_share(gates[:end], filled[:end]).numpy()
    np.testing.assert_allclose(got, diff / share[:, None, None], rtol=1e-3, atol=1e-6)


def test_corrections_refusals(chain, tmp_path):
    """A release whose correction tensors do not match its layers, and --state-data the capture used: one line,
    exit 2, nothing written (a model without such layers: test_corrections.py, test_solve_chain.py)."""
    if chain["arch"] != "qwen3_next":
        pytest.skip("the refusals do not depend on the architecture: checked on qwen3_next")
    from ridgefill.formats.release import load_release, load_state_offsets, verify_release, write_release

    rel = chain["release"]
    manifest, maps = load_release(rel)
    offsets = load_state_offsets(rel, manifest)
    bad = tmp_path / "bad"
    facts = {k: v for k, v in manifest.items() if k not in ("files", "eval", "format", "projector", "corrections",
                                                              "protected_tokens")}  # fmt: skip
    write_release(bad, {l: {"weight": m["weight"], "bias": m["bias"]} for l, m in maps.items()}, facts, "card",
                  state_offsets={2: offsets[2][:, :, :4].copy()}, state_facts=manifest["corrections"]["state"])
    verify_release(bad)  # consistent hashes: only the shapes are wrong
    evals = lambda: sorted((chain["store"] / "eval").iterdir())  # noqa: E731
    before = evals()
    r = cli("eval", chain["model"], bad, *EVAL, "--arms", "exact", "--arms", "ridgefill+state", "--store",
            chain["store"])  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"Error: arm 'ridgefill+state': {bad}: terminal-state offset of layer 2 has shape [4, 8, 4], but the layer's "
        "state is [4, 8, 8]"), r.stderr
    assert evals() == before and "Traceback" not in r.stderr
    r = cli("solve", chain["ids"]["capture"], "--state-data", chain["data"], "--store", chain["store"])
    assert r.returncode == 2 and "--state-data must be kept apart from the capture's text" in r.stderr


@pytest.mark.parametrize("arch", HYBRIDS)
def test_filled_state_is_the_stock_layer_run_on_the_predicted_inputs(arch, lm_of):
    """A filled Gated DeltaNet layer's recurrent and conv states after the prompt are what the stock layer leaves
    when it runs on the prompt with the filled rows' inputs replaced by their predictions and the exact rows' (row 0
    and the tail) kept: checked by running the stock model's layers one by one on exactly those inputs."""
    from transformers import DynamicCache

    lm = lm_of(arch)
    ad = lm.adapter
    ids, S, T, n = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(7)), 2, 6, 24
    g = torch.Generator().manual_seed(8)
    d = ad.hidden_size
    maps = {l: (torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, generator=g)) for l in range(S, 4)}
    res = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    assert res.exact_rows == [0]
    with torch.no_grad():
        hs = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        h_s = hs[S][0]
        # Layer 2 (Gated DeltaNet): the prefix rows but row 0 take W h_S + b; row 0 and the tail their true input.
        x = hs[2][0].clone()
        W, b = maps[2]
        x[1 : n - T] = h_s[1 : n - T] @ W.T + b
        ref = DynamicCache(config=lm.model.config)
        ad.layers[2](x[None], position_embeddings=None, attention_mask=None, cache=ref)
    for name in ("conv_states", "recurrent_states"):
        torch.testing.assert_close(getattr(res.cache.layers[2], name)[0], getattr(ref.layers[2], name)[0],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    # The early Gated DeltaNet layer (0) holds the stock forward's states.
    with torch.no_grad():
        stock = lm.model(input_ids=ids[None], use_cache=True).cache
    torch.testing.assert_close(res.cache.layers[0].recurrent_states[0], stock.layers[0].recurrent_states[0],
                               atol=1e-6, rtol=1e-6)  # fmt: skip


def test_hybrid_refusals(lm_of, tmp_path):
    with pytest.raises(BadInput, match=r"^transformers .* has no 'qwen3_next' architecture: pip install -U"):
        check_architecture("qwen3_next", known={"llama", "qwen3"})
    with pytest.raises(BadInput, match=r"has no 'qwen3_5_text' architecture"):
        check_architecture("qwen3_5", known={"qwen3_5"})  # the config's type, but not its text part
    check_architecture("qwen3_5", known={"qwen3_5", "qwen3_5_text"})
    from ridgefill.fold.queries import context_cache

    with pytest.raises(BadInput, match="^compact and fold handle attention-only models; this one has Gated DeltaNet"):
        context_cache(lm_of("qwen3_next"), torch.arange(3, 20))


def test_qwen3_5_loads_its_text_part(lm_of):
    lm = lm_of("qwen3_5")
    assert lm.ref.model_type == "qwen3_5" and lm.model.config.model_type == "qwen3_5_text"
    assert (lm.ref.num_layers, lm.ref.hidden_size) == (4, 64)  # read from config.json's text_config
    assert type(lm.adapter).__name__ == "Qwen3_5Adapter"


def test_recipe_releases_a_hybrid_with_its_state_correction(tmp_path, tiny_qwen3_next):
    """The whole chain from one recipe file on a hybrid: solve measures the terminal-state offsets on its
    state_data (a path relative to the recipe), the release carries them, eval runs the corrected arm."""
    for name, texts in (("data", TEXTS), ("state", STATE_TEXTS)):
        (tmp_path / name).mkdir()
        for i, t in enumerate(texts):
            (tmp_path / name / f"d{i}.txt").write_text(t)
    recipe = tmp_path / "hybrid.toml"
    recipe.write_text("\n".join([
        f'model = "{tiny_qwen3_next}"', 'out = "rel"', "[capture]", 'data = ["data"]', "splits = [2]", "chunk = 64",
        "held_out = 2", "[solve]", 'state_data = ["state"]', "state_chunk = 32", "[eval]", "tail = 48", "scored = 16",
        "doc_tokens = 128", "lengths = [600]", "documents = 2", "samples = 1",
        'arms = ["exact", "ridgefill", "ridgefill+state"]']) + "\n")  # fmt: skip
    r = cli("release", recipe, "--store", tmp_path / "store", "--json")
    assert r.returncode == 0, r.stderr
    man = json.loads((tmp_path / "rel" / "ridgefill.json").read_text())
    assert man["corrections"]["state"]["layers"] == [2] and man["eval"]["corrections"] == ["state"]
    assert "ridgefill+state" in man["eval"]["arms"]
