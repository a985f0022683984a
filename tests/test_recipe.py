"""`ridgefill release RECIPE`: the whole chain from one file on a tiny model; cache hits; gate; refusals."""

import json
import re

import pytest

from ridgefill.artifacts import Store
from ridgefill.errors import GateFailed
from ridgefill.models.spec import HUB_ID
from ridgefill.recipe import load_recipe, run_recipe
from ridgefill.runtime.rows import DEFAULT_TAIL
from ridgefill.sweep.config import SweepConfig
from clirun import cli
from conftest import quiet

EVAL = {"tail": 48, "scored": 16, "doc_tokens": 128, "lengths": [600], "documents": 2, "samples": 1,
        "arms": ["exact", "ridgefill", "identity"]}


def write_recipe(tmp, model, alphas=(1e-3,), gate=None, push=None, name="recipe"):
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for i in range(5):
        (data / f"d{i}.txt").write_text(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i))
    lines = [f'model = "{model}"', 'out = "rel"', "[capture]", 'data = ["data"]', "splits = [2]", "chunk = 64",
             "held_out = 1", "[solve]", f"alphas = {list(alphas)}", "[eval]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in EVAL.items()]
    if gate:
        (tmp / f"{name}-gate.toml").write_text(gate)
        lines.append(f'gate = "{name}-gate.toml"')
    if push:
        lines += ["[push]", f'repo = "{push}"']
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("recipe")
    path = write_recipe(tmp, tiny_llama, gate="[thresholds]\nkl_max = 1e9\n")
    r = cli("release", path, "--store", tmp / "store", "--json")
    assert r.returncode == 0, r.stderr
    return tmp, path, json.loads(r.stdout)


def test_recipe_runs_the_chain(first_run):
    tmp, path, s = first_run
    assert set(s["stages"]) == {"capture", "solve", "quantize", "export", "eval"}
    assert not any(v["cached"] for v in s["stages"].values())
    assert s["release"] == str(tmp / "rel") and s["gate"]["passed"] is True
    man = json.loads((tmp / "rel" / "ridgefill.json").read_text())
    assert man["eval"]["eval_id"] == s["stages"]["eval"]["id"] and man["split"] == 2
    assert cli("verify", tmp / "rel").returncode == 0


def test_rerun_is_all_cache_hits_without_a_model(first_run, monkeypatch):
    tmp, path, s = first_run
    import ridgefill.models
    import ridgefill.models.load

    def no(*a, **k):
        raise AssertionError("a cached re-run must not load a model")

    monkeypatch.setattr(ridgefill.models.load, "load_model", no)
    monkeypatch.setattr(ridgefill.models, "load_model", no)
    again = run_recipe(load_recipe(path), Store(tmp / "store"), quiet())
    assert all(v["cached"] for v in again["stages"].values())
    assert {k: v["id"] for k, v in again["stages"].items()} == {k: v["id"] for k, v in s["stages"].items()}


def test_changing_alphas_reruns_solve_not_capture(first_run):
    tmp, path, s = first_run
    path2 = write_recipe(tmp, load_recipe(path).model, alphas=(1.0,), name="alphas")  # other maps (the grid alone would not do:
    # an eval is keyed by the maps' bytes, so a grid that picks the same alpha re-uses it)
    again = run_recipe(load_recipe(path2), Store(tmp / "store"), quiet())
    assert again["stages"]["capture"] == {**again["stages"]["capture"], "id": s["stages"]["capture"]["id"], "cached": True}
    for name in ("solve", "quantize", "export", "eval"):
        assert again["stages"][name]["cached"] is False and again["stages"][name]["id"] != s["stages"][name]["id"]


def test_push_to_a_local_hub(first_run, tiny_llama):
    """--push after a passing gate: one commit on the (local, Hub-compatible) server holding the release."""
    from hubserver import HubServer, Token
    from test_hub import hub_env, remote_files

    tmp, _, s = first_run
    token = "hf_rfRECIPE_3c2b1a0f9e8d"
    path = write_recipe(tmp, tiny_llama, gate="[thresholds]\nkl_max = 1e9\n", push="alice/tiny-maps", name="pushing")
    with HubServer(tokens={token: Token("alice")}) as hub:
        r = cli("release", path, "--push", "--store", tmp / "store", "--json", env=hub_env(hub, tmp / "hfhome", token))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["push"]["repo"] == "alice/tiny-maps" and out["push"]["unchanged"] is False
        assert remote_files(hub, "alice/tiny-maps") == {p.name: p.read_bytes() for p in sorted((tmp / "rel").iterdir())}
        again = cli("release", path, "--push", "--store", tmp / "store", "--json", env=hub_env(hub, tmp / "hfhome", token))
        assert json.loads(again.stdout)["push"] == {**out["push"], "unchanged": True}
    assert token not in r.stdout + r.stderr + again.stdout + again.stderr


def test_gate_failure_exits_3_and_does_not_push(first_run, tiny_llama):
    tmp, _, _ = first_run  # same store: every stage is a cache hit, only the gate differs
    path = write_recipe(tmp, tiny_llama, gate="[thresholds]\nkl_max = -1\n", push="me/never", name="failing")
    r = cli("release", path, "--push", "--store", tmp / "store", "--json")
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: gate failed: kl_max: ridgefill kl = ")
    s = json.loads(r.stdout)
    assert s["gate"]["passed"] is False and "push" not in s


@pytest.mark.parametrize("text, message", [
    ('model = "x"\n[capture]\nwindow = 3\n', "recipe [capture]: unknown key(s) window"),
    ('out = "rel"\n', "'model' (a model spec string) is required"),
    ('model = "x"\n[push]\nprivate = true\n', "recipe [push]: 'repo' (OWNER/NAME) is required"),
    ('model = "x"\n[stages]\n', "recipe [top level]: unknown key(s) stages"),
    ('model = \n', "recipe '"),
    ('model = "x"\n[capture]\nsplits = [2]\n[solve]\nsplit = "auto"\n', "[capture] splits and [solve] split = \"auto\" conflict"),
    ('model = "x"\n[sweep]\nsamples = 40\n', "a [sweep] table is used only with [solve] split = \"auto\""),
    ('model = "x"\n[solve]\nsplit = "auto"\n[sweep]\nneedle = 3\n', "recipe [sweep]: unknown key(s) needle"),
])
def test_bad_recipes(tmp_path, text, message):
    path = tmp_path / "r.toml"
    path.write_text(text)
    r = cli("release", path, "--store", tmp_path / "store")
    assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "store").exists()


def test_bad_input_is_refused_before_any_stage_runs(tmp_path, tiny_llama):
    """An eval arm that does not exist, a gate naming an arm the eval does not measure, a solve split the capture
    does not make: refused before the first stage, so no store and no release folder exist afterwards."""
    path = write_recipe(tmp_path, tiny_llama, gate='arm = "ridgefill+rows"\n[thresholds]\nkl_max = 1.0\n')
    text = path.read_text()
    cases = [(text, f"gate file '{tmp_path / 'recipe-gate.toml'}': arm 'ridgefill+rows' is not among the arms eval "
                    "measures (exact, ridgefill, identity); add it with --arms (a recipe: [eval] arms)"),
             (text.replace('"identity"]', '"idenity"]'), "unknown arm 'idenity' (an arm is one of exact, nofill, "
                                                           "identity, ridgefill, optionally with +modifiers)"),
             (text.replace("[solve]\n", "[solve]\nsplit = 3\n"),
              "recipe: [solve] split = 3 is not one of [capture] splits = [2]")]
    for recipe, message in cases:
        path.write_text(recipe)
        r = cli("release", path, "--store", tmp_path / "store")
        assert r.returncode == 2 and r.stderr.strip() == f"Error: {message}", r.stderr
        assert not (tmp_path / "store").exists() and not (tmp_path / "rel").exists()


def test_a_solve_split_alone_is_what_the_capture_makes(tmp_path, tiny_llama):
    path = write_recipe(tmp_path, tiny_llama)
    path.write_text(path.read_text().replace("splits = [2]\n", "").replace("[solve]\n", "[solve]\nsplit = 3\n"))
    recipe = load_recipe(path)
    assert recipe.capture.splits == (3,) and recipe.solve.split == 3


@pytest.mark.parametrize("text, message", [
    ('[capture]\nchunk = "big"', "recipe [capture]: chunk must be an integer, got string 'big'"),
    ("[capture]\ndata = 5", "recipe [capture]: data must be a string or an array of strings, got integer 5"),
    ("out = 5", "recipe [top level]: out must be a string, got integer 5"),
    ('[export]\ntail = "x"', "recipe [export]: tail must be an integer, got string 'x'"),
    ("[export]\ntail = 0", "recipe [export]: tail is 0, expected an integer from 1 to 2147483647"),
    ("[export]\ntail = 2147483648", "recipe [export]: tail is 2147483648, expected an integer from 1 to 2147483647"),
    ('[solve]\nsplit = "auto"\n[sweep]\nsplits = 2.5', "recipe [sweep]: splits must be an array of integers or a "
                                                        "string, got number 2.5"),
    ('[eval]\nenabled = "no"', "recipe [eval]: enabled must be a boolean, got string 'no'"),
    ('[quantize]\nenabled = "false"', "recipe [quantize]: enabled must be a boolean, got string 'false'"),
    ("[eval]\nlengths = [1.5]", "recipe [eval]: lengths must be an array of integers, got an array [1.5]"),
    ('[solve]\nalpha_per_layer = "no"', "recipe [solve]: alpha_per_layer must be a boolean, got string 'no'"),
    ('[solve]\nsplit = "deep"', "recipe [solve]: split must be an integer or \"auto\", got string 'deep'"),
    ("[solve]\nalphas = 0.1", "recipe [solve]: alphas must be an array of numbers, got number 0.1"),
    ('[solve]\nmaps = 2', "recipe [solve]: maps must be a string, got integer 2"),
    ('[solve]\nmaps = "keys"', "recipe [solve]: maps must be one of input, kv, got 'keys'"),
    # capture's own checks, by the recipe's keys, when the recipe is read (not once the stage has begun)
    ("[capture]\nearlier = [0]", "recipe [capture]: earlier takes offsets k >= 1 below the split (the states "
                                 "h_{S-k}), got 0"),
    ("[capture]\nearlier = [2, 2]", "recipe [capture]: earlier names an offset twice: 2, 2"),
    ("[capture]\nchunk = 1", "recipe [capture]: chunk must be at least 2 tokens (got 1)"),
    ("[capture]\noutlier_ratio = 0.5", "recipe [capture]: the outlier ratio (outlier_ratio) must be 0 (off) or "
                                       "above 1, got 0.5"),
    ("capture = 3", "recipe [capture] must be a table, got integer 3"),
    ("max_memory = 5", "recipe [top level]: max_memory must be a table or an array of strings, got integer 5"),
    ('[push]\nrepo = "a/b"\nprivate = "yes"', "recipe [push]: private must be a boolean, got string 'yes'"),
])
def test_recipe_values_are_type_checked(tmp_path, text, message):
    """A value of the wrong TOML type is bad input naming table, key and type (never a TypeError, and never a string
    read as true): `load_recipe` refuses it before anything runs."""
    from ridgefill.errors import BadInput

    path = tmp_path / "r.toml"
    path.write_text('model = "x"\n' + text + "\n")
    with pytest.raises(BadInput) as e:
        load_recipe(path)
    assert str(e.value) == message


def test_push_needs_a_push_table(tmp_path, tiny_llama):
    path = write_recipe(tmp_path, tiny_llama)
    r = cli("release", path, "--push", "--store", tmp_path / "store")
    assert r.returncode == 2 and "--push needs a [push] table" in r.stderr
    assert not (tmp_path / "store").exists()


def test_example_recipes_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in ("smollm2-135m", "gemma3-270m"):
        r = load_recipe(root / "examples" / "recipes" / f"{name}.toml")
        assert r.model == f"builtin:{name}" and r.gate == root / "examples" / "gates" / f"{name}.toml"
        assert r.gate.is_file() and r.out == root / "release" / name
    # the README's own-model recipe: a Hub id, its split measured, the sweep's budget as the defaults, no gate
    r = load_recipe(root / "examples" / "recipes" / "hub-model.toml")
    assert HUB_ID.match(r.model) and r.solve.split is None and r.gate is None and r.eval is not None
    assert r.sweep == SweepConfig(tail=DEFAULT_TAIL)  # the budget's defaults; measured with the [export] tail
    assert r.place == {"device": "auto", "dtype": "auto"} and r.out == root / "release" / "my-model"
    # the 1.5B built-in's recipe: bfloat16 wherever it runs (the practical dtype on an AMX CPU as on a GPU)
    r = load_recipe(root / "examples" / "recipes" / "qwen2.5-coder-1.5b.toml")
    assert r.model == "builtin:qwen2.5-coder-1.5b" and r.place == {"device": "auto", "dtype": "bfloat16"}
    assert r.out == root / "release" / "qwen2.5-coder-1.5b" and r.eval is not None


def test_sample_ci_workflow():
    """The sample workflow parses, caches the store and runs an example recipe that exists."""
    from pathlib import Path

    import yaml  # a test dependency (pyproject's `test` extra): the check runs everywhere, never skips

    root = Path(__file__).resolve().parents[1]
    wf = yaml.safe_load((root / "examples" / "ci" / "release.yml").read_text())
    steps = wf["jobs"]["release"]["steps"]
    caches = [s for s in steps if s.get("uses", "").startswith("actions/cache")]
    assert len(caches) == 1 and caches[0]["with"]["path"] == "ridgefill-artifacts"
    # the store the cache keeps is the one ridgefill writes to
    assert wf["jobs"]["release"]["env"]["RIDGEFILL_STORE"] == "${{ github.workspace }}/ridgefill-artifacts"
    run = next(s["run"] for s in steps if "ridgefill release" in s.get("run", ""))
    recipe = run.split("ridgefill release ")[1].split()[0]
    assert (root / recipe).is_file() and "--push" in run
    assert f"'{recipe}'" in caches[0]["with"]["key"]  # a changed recipe is a new cache key


SWEEP = ["[sweep]", "splits = [1, 2, 3]", "length = 600", "scored = 16", "needles = 4", "documents = 2"]


def _auto_recipe(tmp, model, budget, gate=None):
    path = write_recipe(tmp, model, gate=gate)
    text = path.read_text().replace("splits = [2]\n", "").replace("[solve]\n", '[solve]\nsplit = "auto"\n')
    path.write_text(text + "[export]\ntail = 48\n" + "\n".join(SWEEP + budget) + "\n")
    return path


def test_auto_split_releases_the_sweeps_recommendation(tmp_path, tiny_llama_1k, monkeypatch):
    """split = "auto": the sweep runs first (its capture has every split), the release is its recommended split,
    and capture / solve / quantize are the sweep's own artifacts (cache hits); the recipe's gate is part of the
    sweep's budget. A budget no split meets, the gate's included: exit 3, naming the figure over.

    The random tiny model has no key tokens (none loses 2 nats without its context), and a split whose key-token
    ΔNLL cannot be measured is not within any budget: here every scored token counts as a key token."""
    import numpy as np

    from ridgefill.evaluate import metrics

    monkeypatch.setattr(metrics, "key_mask", lambda full, cut, threshold=2.0: np.ones(len(full), dtype=bool))
    loose = ["max_needle_drop = 100.0", "max_key_dnll = 1e9"]
    path = _auto_recipe(tmp_path, tiny_llama_1k, loose, gate="[thresholds]\nkl_max = 1e9\nneedle_drop_max = 100.0\n")
    s = run_recipe(load_recipe(path), Store(tmp_path / "store"), quiet())
    sw = Store(tmp_path / "store").get(s["stages"]["sweep"]["id"])
    assert sw.recipe["gate"] == [["kl_max", 1e9], ["needle_drop_max", 100.0]]
    assert s["sweep"]["recommended"] == sw.manifest["summary"]["recommended"] == 1  # the shallowest: all qualify
    assert sw.recipe["tail"] == 48 and sw.recipe["splits"] == [1, 2, 3]
    assert s["stages"]["capture"] == {**s["stages"]["capture"], "id": sw.recipe["capture"], "cached": True}
    assert s["stages"]["solve"]["cached"] and s["stages"]["quantize"]["cached"]
    assert s["stages"]["quantize"]["id"] == sw.recipe["maps"]["1"]
    manifest = json.loads((tmp_path / "rel" / "ridgefill.json").read_text())
    assert manifest["split"] == 1 and manifest["tail_default"] == 48
    # the release records what the sweep recommended, and which sweep it was
    assert manifest["configuration"] == {"arm": "ridgefill", "sweep": sw.id}
    assert s["sweep"]["configuration"] == "ridgefill" and s["sweep"]["tail"] == 48

    path = _auto_recipe(tmp_path, tiny_llama_1k, loose, gate="[thresholds]\nkl_max = 0.0\n")
    with pytest.raises(GateFailed) as failed:  # exit 3 from the CLI
        run_recipe(load_recipe(path), Store(tmp_path / "store"), quiet())
    assert re.fullmatch(r"sweep \w+: no split or configuration is within budget \(needle drop ≤ 100 points, key ΔNLL "
                        r"≤ 1e\+09, KL ≤ 0\); even the deepest, split 3, is over \(KL [0-9.e-]+ > 0\)",
                        str(failed.value))


@pytest.mark.parametrize("line, message", [
    ("bootstrap = 0", "recipe [sweep]: bootstrap must be at least 1, got 0"),
    ("bootstrap = -5", "recipe [sweep]: bootstrap must be at least 1, got -5"),
    ("repeats = 0", "recipe [sweep]: repeats must be at least 3 (a median and an interval need three timings), got 0"),
    ("needles = 0", "recipe [sweep]: needles must be at least 1, got 0"),
    ("seed = -1", "recipe [sweep]: seed must be at least 0 (numpy's generators take no negative seed), got -1"),
    ("splits = []", "recipe [sweep]: splits is an empty array: name at least one split, or leave splits out for the "
                    "default ones"),
    ("splits = [0, 2]", "recipe [sweep]: splits: 0 is not a split; a split is a layer 1 or deeper"),
    ('splits = "8-"', "recipe [sweep]: splits: '8-' is not a split, a range A-B or A-B:STEP (e.g. 8-24, 8-24:2, "
                      "8,12,16)"),
    ("max_needle_drop = -1", "recipe [sweep]: max_needle_drop must be a number >= 0 (got -1)"),
    ("scored = 600", "recipe [sweep]: need 0 < scored (600) < tail (512)"),
    ("length = 400", "recipe [sweep]: length (400) must be longer than tail (512): the fill skips the rows before "
                     "the tail"),
])
def test_sweep_values_are_checked_when_the_recipe_is_read(tmp_path, line, message):
    """Every [sweep] value is refused by load_recipe, naming its key in the recipe (never a flag of `ridgefill
    sweep`), before a model is resolved; empty splits are refused rather than read as the default splits."""
    from ridgefill.errors import BadInput

    path = tmp_path / "r.toml"
    path.write_text(f'model = "x"\n[solve]\nsplit = "auto"\n[sweep]\n{line}\n')
    with pytest.raises(BadInput) as e:
        load_recipe(path)
    assert str(e.value) == message


def test_a_sweep_past_the_models_context_is_refused_before_any_stage(tmp_path, tiny_llama):
    """[sweep] length beyond the model's context (the tiny llama's 256 positions), and a bad [sweep] value through
    `ridgefill release`: one line naming the recipe key, exit 2, no store, no release."""
    path = _auto_recipe(tmp_path, tiny_llama, ["max_needle_drop = 100.0"])  # length = 600
    r = cli("release", path, "--store", tmp_path / "store")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("Error: recipe [sweep]: length 600 is longer than the model's "
                                                 "context (256 positions)")
    assert not (tmp_path / "store").exists() and not (tmp_path / "rel").exists()
    path.write_text(path.read_text() + "bootstrap = 0\n")
    r = cli("release", path, "--store", tmp_path / "store")
    assert r.returncode == 2 and r.stderr.strip() == "Error: recipe [sweep]: bootstrap must be at least 1, got 0"
    assert not (tmp_path / "store").exists() and not (tmp_path / "rel").exists()


def test_the_stages_share_one_load_of_the_model(tmp_path, tiny_llama, monkeypatch):
    """One `ridgefill release` reads the model once: capture, solve, quantize and eval, which run it alike, share
    the load; the release and the eval's figures are the ones stages loading it each on its own make."""
    import contextlib

    import ridgefill.models.load as load

    loads, real = [], load._load
    monkeypatch.setattr(load, "_load", lambda *a, **k: loads.append(a[0].path) or real(*a, **k))
    summaries = {}
    for name in ("shared", "apart"):
        if name == "apart":
            monkeypatch.setattr(load, "kept_models", contextlib.nullcontext)
        (tmp_path / name).mkdir()
        path = write_recipe(tmp_path / name, tiny_llama)
        summaries[name] = run_recipe(load_recipe(path), Store(tmp_path / name / "store"), quiet())
        assert load._KEPT is None  # let go once the recipe is done
        if name == "shared":
            assert len(loads) == 1
    assert len(loads) == 5 and set(loads) == {loads[0]}
    files = {name: {p.name: p.read_bytes() for p in (tmp_path / name / "rel").iterdir() if p.suffix == ".safetensors"}
             for name in summaries}
    assert files["shared"] == files["apart"] and "maps.safetensors" in files["shared"]
    figures = {name: {arm: {k: v for k, v in f.items() if k not in ("prefill_s", "speedup")}  # timings apart
                      for arm, f in s["eval"]["arms"].items()} for name, s in summaries.items()}
    assert figures["shared"] == figures["apart"] and figures["shared"]["ridgefill"]["dnll"] > 0
