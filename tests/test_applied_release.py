"""One applied release: the reader's `Release` computes the facts a release is applied with once (`fill_options`),
and the reference runtime, eval and the vLLM plugin take them from it and refuse the same models with the same check
(`Release.check_model`), each where it meets the model. The plugin's processes keep the facts, not the maps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ridgefill.errors import BadInput
from ridgefill.formats import release
from ridgefill.formats.release import CONFIGURATIONS
from clirun import cli
from conftest import SMALL_CHAIN
from test_release_bounds import reseal, small
from test_release_configuration import TABLE, write_small

pytestmark = pytest.mark.usefixtures("one_thread")
SERVED = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}  # the config of the releases' model


def configured(path: Path, arm: str) -> Path:
    conf = {"arm": arm, "sweep": None, **({"row_share": 0.25} if arm == "ridgefill+rows" else {})}
    write_small(path, conf, protected=TABLE)
    return path


@pytest.mark.parametrize("arm", CONFIGURATIONS)
def test_fill_options_are_the_one_mapping_of_a_configuration(tmp_path, arm):
    from ridgefill.engines.vllm import served
    from ridgefill.evaluate.source import load_source

    d = configured(tmp_path / "rel", arm)
    rel = release.read_release(d)
    opts = rel.fill_options()
    base = {"split": 2, "tail": 8, "anchor": 1, "exact_norm": 812.5, "map_kinds": {2: "input", 3: "input"}}
    extra = {"ridgefill+rows": {"row_share": 0.25}, "ridgefill+kscale": {"corrections": ("kscale",)},
             "ridgefill+protected": {"protected": TABLE.astype(np.int64)}}.get(arm, {})
    assert opts.keys() == {**base, **extra}.keys()
    for key, value in {**base, **extra}.items():
        assert np.array_equal(opts[key], value) if key == "protected" else opts[key] == value, key
    if "protected" in opts:
        assert opts["protected"].dtype == np.int64
    assert rel.arm == ("ridgefill+rows" if arm == "ridgefill+rows" else "ridgefill")
    # eval's source and the engine's fill read the same facts from it
    src = load_source(None, str(d))
    assert (src.split, src.anchor, src.exact_norm, src.map_kinds) == (2, 1, 812.5, base["map_kinds"])
    assert src.row_share == opts.get("row_share", src.row_share) and src.release is not None
    if arm in served.CAUSAL:
        fill = served.load(d)
        assert (fill.split, fill.tail, fill.anchor, fill.exact_norm, fill.map_kinds) == tuple(base.values())
        assert (fill.protected is None) == ("protected" not in opts)  # the table is applied only where configured
        if fill.protected is not None:
            assert np.array_equal(fill.protected, opts["protected"])


def served_refusal(fill, config=SERVED, dtype=None) -> str:
    from ridgefill.engines.vllm import served

    with pytest.raises(BadInput) as e:
        served.check_model(fill, config, None, dtype=dtype)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    return str(e.value)


def test_the_plugin_refuses_what_the_runtime_refuses(tmp_path):
    """Maps of the wrong width in a /1 release (key/value maps [48, 64] written as input maps of a 64-wide model), a
    protected-token table past the served vocabulary in a plain release, and maps past float16's range: each refused
    with the words every runtime's check has (`Release.check_model`), here naming the served model."""
    from ridgefill.engines.vllm import served

    v1 = small(tmp_path / "v1", fmt=release.FORMAT_V1)
    reseal(v1, tensors=lambda t: t.update({"layer.3.weight": ("F32", t["layer.3.weight"][1][:48]),
                                            "layer.3.bias": ("F32", t["layer.3.bias"][1][:48])}))
    fill = served.load(v1)  # the reader cannot know a /1 release's widths: the model's check does
    assert served_refusal(fill) == (f"RIDGEFILL_RELEASE={v1}: layer 3's input map is [48, 64], expected [64, 64] for "
                                    "'the served model'")
    past = configured(tmp_path / "past", "ridgefill")
    fill = served.load(past)
    assert fill.protected is None  # a plain release: the table is not applied, and still checked
    config = {**SERVED, "vocab_size": 77}
    assert served_refusal(fill, config) == (f"RIDGEFILL_RELEASE={past}: the protected-token table holds token id 77, "
                                            "past the vocabulary of 'the served model' (77 tokens: ids 0..76)")
    served.check_model(fill, {**SERVED, "vocab_size": 78})
    wide = small(tmp_path / "wide")
    reseal(wide, lambda m: m["fit"].update(exact_norm=1e5))
    fill = served.load(wide)
    served.check_model(fill, SERVED, dtype="torch.bfloat16")
    assert served_refusal(fill, dtype="torch.float16").startswith(
        f"RIDGEFILL_RELEASE={wide}: the maps write values up to ")


def test_a_fill_without_its_maps_keeps_every_check(tmp_path):
    """What the plugin keeps in the processes that do not build the model (`Fill.without_maps`): no decoded map,
    the same facts, and the same refusals of a model the maps do not fit."""
    from ridgefill.engines.vllm import served

    v1 = small(tmp_path / "v1", fmt=release.FORMAT_V1)
    reseal(v1, tensors=lambda t: t.update({"layer.3.weight": ("F32", t["layer.3.weight"][1][:48]),
                                            "layer.3.bias": ("F32", t["layer.3.bias"][1][:48])}))
    full = served.load(v1)
    bare = full.without_maps()
    assert full.maps and bare.maps == {} and bare.release.maps == {}
    assert (bare.split, bare.tail, bare.sha256, bare.describe()) == (full.split, full.tail, full.sha256,
                                                                      full.describe())
    assert served_refusal(bare) == served_refusal(full)


def test_the_plugin_keeps_only_the_facts_and_the_model_reads_the_maps(tmp_path, monkeypatch):
    """What a vLLM process keeps (`served.PROCESS`, which `plugin.register` fills) holds no decoded map; the model
    being built (`PROCESS.for_model`) gets them again, from the folder `register` verified."""
    from ridgefill.engines.vllm import served

    d = small(tmp_path / "rel")
    process = served.Process()
    process.remember(served.load(d))
    got = process.for_model()
    want = release.read_release(d).maps
    assert process.fill.maps == {} and process.fill.release.maps == {}
    assert sorted(got.maps) == sorted(want)
    for l, (W, b) in got.maps.items():
        assert np.array_equal(W, want[l]["weight"]) and np.array_equal(b, want[l]["bias"])


@pytest.fixture(scope="module")
def chain(tiny_chain):
    return tiny_chain(SMALL_CHAIN)


def test_eval_refuses_a_release_of_another_kv_shape_and_writes_nothing(chain, tmp_path):
    """The chain's release claiming 4 KV heads of 8 for the tiny llama (input maps, so no width shows it): eval
    refuses it in one line, as the runtime's loader does, and leaves the release and the store as they were."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    d = tmp_path / "rel"
    shutil.copytree(chain.release, d)
    heads = json.loads((chain.model / "config.json").read_text())["num_key_value_heads"]
    reseal(d, lambda m: m["model"].update(num_kv_heads=heads + 2))
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    store = chain.store.root
    before = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    r = cli("eval", chain.model, d, "--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600",
            "--documents", "1", "--samples", "1", "--store", store)
    want = f"{d}: the release is for a model with num_kv_heads {heads + 2}, but '{chain.model}' has {heads}"
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"Error: {want}", r.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir()} == files
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before
    lm = load_model(resolve_model(str(chain.model), store_root=store), store_root=store)
    with pytest.raises(BadInput) as e:
        load_release_maps(lm, d)
    assert str(e.value) == want.replace(f"'{chain.model}'", f"'{lm.ref.spec}'")
