"""The stages take their configs (SolveConfig, ExportConfig) and a recipe is a tree of them: the ids the stages
write are those the scalar arguments gave (pinned below from the code before the configs), and a recipe's tables
become the configs in one place, refused by key and type."""

from types import SimpleNamespace

import pytest

from ridgefill.artifacts import Store
from ridgefill.artifacts.store import canonical_json, recipe_id
from ridgefill.capture.config import CaptureConfig
from ridgefill.errors import BadInput
from ridgefill.evaluate.config import EvalConfig
from ridgefill.export.config import ExportConfig
from ridgefill.recipe import Push, load_recipe, recommended_export, stage_config
from ridgefill.solve.config import SolveConfig
from ridgefill.sweep.config import SweepConfig
from conftest import quiet

CAP, FP = "0123456789abcdef", "f" * 64
# (split, SolveConfig, place, state documents' sha256) -> the recipe's canonical JSON and id, as solve wrote them
# with its scalar arguments (`_recipe(cap, ref, split, alphas, metric, chat_share, place, alpha_per_layer,
# state_docs, state_chunk, maps)`)
SOLVES = [
    (2, SolveConfig(alphas=(1.0, 0.01, 1e-4, 0.01)), "float32", None,
     '{"alphas":[0.0001,0.01,1.0],"capture":"0123456789abcdef","chat_share":null,"maps":"input","metric":"kv",'
     f'"model":"{FP}","split":2,"stage":"solve","version":7}}', "f409b84f5d03af00"),
    (3, SolveConfig(alphas=(0.5,), metric="input", chat_share=0.25, alpha_per_layer=True), "bfloat16", None,
     '{"alpha_per_layer":true,"alphas":[0.5],"capture":"0123456789abcdef","chat_share":0.25,"device":"cpu",'
     f'"dtype":"bfloat16","maps":"input","metric":"input","model":"{FP}","split":3,"stage":"solve","version":7}}',
     "e861a02f3d38e6f8"),
    (1, SolveConfig(alphas=(1e-3,), maps="kv", state_data=("a.txt", "b.txt"), state_chunk=512), "float32",
     ["a" * 64, "b" * 64],
     '{"alphas":[0.001],"capture":"0123456789abcdef","chat_share":null,"maps":"kv","metric":"kv",'
     f'"model":"{FP}","split":1,"stage":"solve","state":{{"chunk":512,"data":["{"a" * 64}","{"b" * 64}"]}},'
     '"version":7}', "be65b379183858b8"),
]


@pytest.mark.parametrize("split, cfg, dtype, docs, text, ident", SOLVES)
def test_a_solve_config_gives_the_recipe_the_scalars_gave(split, cfg, dtype, docs, text, ident):
    from ridgefill.models.device import where
    from ridgefill.solve import run

    state = None if docs is None else [SimpleNamespace(sha256=s) for s in docs]
    alphas = sorted(set(cfg.alphas))  # as solve sorts the grid
    recipe = run._recipe(SimpleNamespace(id=CAP), SimpleNamespace(fingerprint=FP), split, alphas, cfg,
                         where(device="cpu", dtype=dtype), state)
    assert canonical_json(recipe) == text and recipe_id(recipe) == ident


def test_export_ids_are_the_ones_the_scalars_gave(tmp_path):
    """The hand-made chain exported (plain from the quantize artifact; ridgefill+rows at tail 64 from the solve; the
    GGUF) under the ids export wrote before it took an ExportConfig."""
    from fakestore import fake_chain

    from ridgefill.export import export, export_gguf

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    assert ids == {"capture": "81b12d7f1504b3dd", "solve": "c7b6cb31591ad9ab", "quantize": "925b0e9f6882e121"}
    plain, cached, copied = export(st, ids["quantize"], ExportConfig(), quiet())
    assert (plain.id, cached, copied) == ("682a8e0546080a68", False, None)
    assert plain.recipe == {"stage": "export", "version": 5, "source": f"quantize/{ids['quantize']}", "tail": 512}
    rows = export(st, ids["solve"], ExportConfig(tail=64, configuration="ridgefill+rows", row_share=0.2), quiet())[0]
    assert rows.id == "50797dca2e6f4379"
    assert export_gguf(st, ids["quantize"], ExportConfig(), quiet())[0].id == "b259b49e19c3d1a6"


def test_a_recipe_is_a_tree_of_stage_configs(tmp_path):
    (tmp_path / "s.txt").write_text("kept apart")
    path = tmp_path / "r.toml"
    path.write_text('model = "m"\ndevice = "cpu"\n'
                    '[capture]\ndata = "texts"\nsplits = [2, 3]\nchunk = 64\ndtype = "bfloat16"\n'
                    '[solve]\nsplit = 3\nalphas = [0.1, 1]\nmaps = "kv"\nstate_data = "s.txt"\nstate_chunk = 32\n'
                    '[quantize]\nenabled = false\n[export]\ntail = 64\n'
                    '[eval]\nlengths = [600]\narms = ["exact", "ridgefill"]\n'
                    '[push]\nrepo = "a/b"\nprivate = true\n')
    r = load_recipe(path)
    assert r.data == (str(tmp_path / "texts"),)
    assert r.capture == CaptureConfig(splits=(2, 3), chunk=64) and r.capture_place == {"dtype": "bfloat16"}
    assert r.solve == SolveConfig(split=3, alphas=(0.1, 1), maps="kv", state_data=(str(tmp_path / "s.txt"),),
                                  state_chunk=32)
    assert (r.quantize, r.export) == (False, ExportConfig(tail=64))
    assert r.eval == EvalConfig(lengths=(600,), arms=("exact", "ridgefill"))
    assert r.push == Push(repo="a/b", private=True) and r.place == {"device": "cpu"} and r.sweep is None
    # split = "auto": the sweep's config, its tail the release's, quantize and alpha_per_layer the release's own
    path.write_text('model = "m"\n[solve]\nsplit = "auto"\nalpha_per_layer = true\n[quantize]\nenabled = false\n'
                    '[export]\ntail = 64\n[sweep]\nsplits = [1, 2]\nlength = 600\nscored = 16\n')
    r = load_recipe(path)
    assert r.solve == SolveConfig(alpha_per_layer=True) and r.export == ExportConfig(tail=64)
    assert r.sweep == SweepConfig(splits=(1, 2), length=600, tail=64, scored=16, quantize=False, alpha_per_layer=True)


def test_stage_config_takes_a_table_as_its_config():
    cfg, extra = stage_config(SolveConfig, {"alphas": [1, 2], "split": "auto"}, "solve", leave=frozenset({"split"}),
                              extra={"split": 'integer | "auto"'})
    assert (cfg, extra) == (SolveConfig(alphas=(1, 2)), {"split": "auto"})
    with pytest.raises(BadInput) as e:
        stage_config(SolveConfig, {"alpha": [1]}, "solve", leave=frozenset({"split"}))
    assert str(e.value) == ("recipe [solve]: unknown key(s) alpha (known: alpha_per_layer, alphas, chat_share, "
                            "earlier, maps, metric, state_chunk, state_data)")
    with pytest.raises(BadInput) as e:
        stage_config(ExportConfig, {"tail": 1.5}, "export")
    assert str(e.value) == "recipe [export]: tail must be an integer, got number 1.5"


@pytest.mark.parametrize("table, message", [
    ("alphas = [0.1, 0.0]", "recipe [solve]: alphas must be > 0 (got 0)"),
    ('metric = "cosine"', "recipe [solve]: metric must be one of kv, input, got 'cosine'"),
    ('maps = "kv"\nmetric = "input"', "recipe [solve]: metric input scores predicted layer inputs, and key/value maps "
                                      "predict none: use metric kv with maps kv"),
    ("state_chunk = 0", "recipe [solve]: state_chunk must be >= 1, got 0"),
])
def test_solve_values_are_checked_when_the_recipe_is_read(tmp_path, table, message):
    """A [solve] value solve would refuse is refused by load_recipe, by its key, before a capture runs."""
    path = tmp_path / "r.toml"
    path.write_text(f'model = "x"\n[solve]\n{table}\n')
    with pytest.raises(BadInput) as e:
        load_recipe(path)
    assert str(e.value) == message


def test_the_release_is_at_the_tail_the_sweep_recommended():
    """split = "auto": the release records the sweep's configuration and id, at the tail its recommendation was
    measured with, whether or not [export] named a tail."""
    sw = SimpleNamespace(id="5" * 16, manifest={"summary": {"tail": 256, "configuration": "ridgefill+rows"}})
    for given in (ExportConfig(), ExportConfig(tail=64)):
        assert recommended_export(given, sw) == ExportConfig(tail=256, configuration="ridgefill+rows", sweep=sw.id)


def test_solve_and_export_take_their_configs_only():
    """No scalar setting beside the config: the signatures are (store, ref, cfg, out, *, where and how)."""
    import inspect

    from ridgefill.export import export, export_gguf
    from ridgefill.solve import solve

    assert list(inspect.signature(solve).parameters) == ["store", "capture_ref", "cfg", "out", "model", "place"]
    assert list(inspect.signature(export).parameters) == ["store", "ref", "cfg", "out", "out_dir", "force", "model"]
    assert list(inspect.signature(export_gguf).parameters) == ["store", "ref", "cfg", "out", "out_path", "force",
                                                               "model"]
