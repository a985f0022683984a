"""A release's configuration (docs/format.md, "Configuration"): the manifest fact and its refusals, `export
--configuration` (the fact byte for byte, ids unchanged without one, refusals before anything is written, the GGUF
carrying it), the runtime applying it (`prefill(lm, ids, rel.arm, **rel.options())` equals the explicit call), eval
measuring the configured arm by default, the gate judging it by default, and the model card stating it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ridgefill.artifacts import Store, recipe_id
from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.export import card as card_mod
from ridgefill.export.config import ExportConfig
from ridgefill.formats import release, safetensors
from ridgefill.formats.release import CONFIGURATIONS, MANIFEST, MAPS_FILE
from clirun import cli_here
from conftest import SMALL_CHAIN, quiet

pytestmark = pytest.mark.usefixtures("one_thread")
D = 64  # the tiny models' width


# ---------------------------------------------------------------------------------------------- the format


def small_manifest(**extra) -> dict:
    return {"model": {"name": "example/model-1", "revision": None, "architecture": "llama", "num_layers": 4,
                      "hidden_size": D, "num_kv_heads": 2, "head_dim": 16, "fingerprint": "ab" * 32},
            "split": 2, "tail_default": 8,
            "layers": [{"index": l, "kind": "full_attention", "map": "input"} for l in (2, 3)],
            "fit": {"exact_norm": 812.5, "skip_first_rows": 1}, **extra}


def small_maps(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {l: {"weight": (rng.standard_normal((D, D)) / 8).astype(np.float32),
                "bias": rng.standard_normal(D).astype(np.float32)} for l in (2, 3)}


TABLE = np.array([5, 40, 77], dtype=np.int32)


def write_small(path: Path, configuration=None, protected=None) -> dict:
    extra = {} if configuration is None else {"configuration": configuration}
    kw = {} if protected is None else {"protected": protected, "protected_facts": {"share": 0.25, "types": 3}}
    return release.write_release(path, small_maps(), small_manifest(**extra), "# card\n", weight_dtype="f32", **kw)


def forge(d: Path, edit) -> None:
    """Edit the manifest and the facts maps.safetensors records alike, and reseal the hashes: a release whose
    hashes and facts agree, so that only the configuration rule can refuse it."""
    m = json.loads((d / MANIFEST).read_text())
    edit(m)
    tensors = release.read_tensors(d / MAPS_FILE)
    blob = safetensors.encode({n: safetensors.BF16(a) if dt == "BF16" else a for n, (dt, a) in tensors.items()},
                              {"format": release.FORMAT, "ridgefill.facts": release.facts_json(m)})
    (d / MAPS_FILE).write_bytes(blob)
    m["files"][MAPS_FILE] = sha256_file(d / MAPS_FILE)
    (d / MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")


def test_every_configuration_is_an_eval_arm_named_canonically():
    from ridgefill.evaluate.arms import parse_arm

    assert CONFIGURATIONS == ("ridgefill", "ridgefill+rows", "ridgefill+kscale", "ridgefill+protected")
    for name in CONFIGURATIONS:
        assert parse_arm(name).name == name


@pytest.mark.parametrize("conf", [
    {"arm": "ridgefill", "sweep": None},
    {"arm": "ridgefill", "sweep": "0123456789abcdef"},
    {"arm": "ridgefill+rows", "sweep": None, "row_share": 0.25},
    {"arm": "ridgefill+kscale", "sweep": "0123456789abcdef"},
    {"arm": "ridgefill+protected", "sweep": None},
])
def test_round_trip(tmp_path, conf):
    written = write_small(tmp_path / "rel", conf, TABLE if conf["arm"] == "ridgefill+protected" else None)
    assert written["configuration"] == conf
    rel = release.read_release(tmp_path / "rel")
    assert rel.manifest["configuration"] == conf and rel.configuration == conf
    meta = safetensors.read_header(tmp_path / "rel" / MAPS_FILE)[1]
    assert json.loads(meta["ridgefill.facts"])["configuration"] == conf  # a fact: under the maps file's hash


def test_a_release_without_one_is_plain_and_an_added_one_is_an_edit(tmp_path):
    write_small(tmp_path / "rel")
    before = {p.name: p.read_bytes() for p in (tmp_path / "rel").iterdir()}
    assert "configuration" not in release.verify_release(tmp_path / "rel")
    assert release.read_release(tmp_path / "rel").configuration == {"arm": "ridgefill", "sweep": None}
    assert {p.name: p.read_bytes() for p in (tmp_path / "rel").iterdir()} == before
    m = json.loads((tmp_path / "rel" / MANIFEST).read_text())
    m["configuration"] = {"arm": "ridgefill+kscale", "sweep": None}
    (tmp_path / "rel" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BadInput, match=r"^ridgefill.json: 'configuration' is \{.*\} but maps.safetensors records no "
                                       r"such field \(the manifest was edited\)$"):
        release.verify_release(tmp_path / "rel")


ARMS_LIST = "ridgefill, ridgefill+rows, ridgefill+kscale, ridgefill+protected"
REFUSED = [
    ("not-object", "ridgefill+rows", "'configuration' is \"ridgefill+rows\", expected an object {\"arm\": ..., "
                                     "\"sweep\": ...}"),
    ("unknown-arm", {"arm": "ridgefill+vscale", "sweep": None},
     f"'configuration.arm' is \"ridgefill+vscale\", expected one of {ARMS_LIST}"),
    ("no-arm", {"sweep": None}, f"'configuration.arm' is missing, expected one of {ARMS_LIST}"),
    ("rows-without-share", {"arm": "ridgefill+rows", "sweep": None},
     "'configuration' has the keys arm, sweep, expected exactly arm, row_share, sweep for ridgefill+rows"),
    ("share-elsewhere", {"arm": "ridgefill+kscale", "sweep": None, "row_share": 0.1},
     "'configuration' has the keys arm, row_share, sweep, expected exactly arm, sweep for ridgefill+kscale"),
    ("no-sweep", {"arm": "ridgefill+kscale"}, "'configuration' has the keys arm, expected exactly arm, sweep"),
    ("extra-key", {"arm": "ridgefill", "sweep": None, "note": 1}, "'configuration' has the keys arm, note, sweep"),
    ("share-one", {"arm": "ridgefill+rows", "sweep": None, "row_share": 1},
     "'configuration.row_share' is 1, expected a number between 0 and 1 (exclusive)"),
    ("share-zero", {"arm": "ridgefill+rows", "sweep": None, "row_share": 0.0}, "'configuration.row_share' is 0.0"),
    ("share-bool", {"arm": "ridgefill+rows", "sweep": None, "row_share": True}, "'configuration.row_share' is true"),
    ("share-text", {"arm": "ridgefill+rows", "sweep": None, "row_share": "0.1"}, "'configuration.row_share' is \"0.1\""),
    ("sweep-number", {"arm": "ridgefill", "sweep": 5},
     "'configuration.sweep' is 5, expected a sweep artifact id (a string) or null"),
    ("sweep-empty", {"arm": "ridgefill", "sweep": ""}, "'configuration.sweep' is \"\""),
    ("protected-without-table", {"arm": "ridgefill+protected", "sweep": None},
     "'configuration.arm' is \"ridgefill+protected\", but the release has no protected-token table "
     "('protected_tokens')"),
]


@pytest.mark.parametrize("conf, message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_the_reader_refuses_a_bad_configuration_by_name(tmp_path, conf, message):
    d = tmp_path / "rel"
    write_small(d)
    forge(d, lambda m: m.update(configuration=conf))
    for fn in (release.verify_release, release.load_release):
        with pytest.raises(BadInput) as e:
            fn(d)
        assert str(e.value).startswith(f"ridgefill.json: {message}"), str(e.value)
        assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(ValueError, match=re.escape(message)):  # and the writer never writes one
        write_small(tmp_path / "other", conf)
    assert not (tmp_path / "other").exists()


# ------------------------------------------------------------------------------------------------ export


@pytest.fixture
def store_chain(tmp_path) -> tuple[Store, dict]:
    """fakestore's hand-made capture -> solve -> quantize (no protected-token table), and a sweep artifact."""
    from fakestore import fake_chain

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    with st.build("sweep", {"stage": "sweep", "capture": ids["capture"], "splits": [2]}) as b:
        (b.path / "report.json").write_text("{}")
        ids["sweep"] = b.commit(summary={"recommended": 2}).id
    return st, ids


def export_cli(st, ref, *args):
    r = cli_here("export", ref, *args, "--store", st.root, "--json")
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def test_export_records_the_configuration_byte_for_byte(store_chain, tmp_path):
    st, ids = store_chain
    r, doc = export_cli(st, ids["quantize"], "--out", tmp_path / "rel", "--configuration", "ridgefill+rows",
                        "--sweep", ids["sweep"][:8])
    assert r.returncode == 0, r.stderr
    fact = {"arm": "ridgefill+rows", "row_share": 0.1, "sweep": ids["sweep"]}  # the sweep's full id
    text = (tmp_path / "rel" / MANIFEST).read_text()
    assert ('  "configuration": {\n    "arm": "ridgefill+rows",\n    "row_share": 0.1,\n'
            f'    "sweep": "{ids["sweep"]}"\n  }},\n') in text
    meta = safetensors.read_header(tmp_path / "rel" / MAPS_FILE)[1]
    assert f'"configuration":{{"arm":"ridgefill+rows","row_share":0.1,"sweep":"{ids["sweep"]}"}}' in meta[
        "ridgefill.facts"]
    assert release.read_release(tmp_path / "rel").configuration == fact
    assert st.get(doc["id"]).recipe["configuration"] == fact
    readme = (tmp_path / "rel" / "README.md").read_text()
    assert f"- Configuration: `ridgefill+rows`, recommended by sweep `{ids['sweep']}`" in readme

    r, doc2 = export_cli(st, ids["quantize"], "--out", tmp_path / "rel2", "--configuration", "ridgefill+rows",
                         "--row-share", "0.25")
    assert r.returncode == 0, r.stderr
    assert release.read_release(tmp_path / "rel2").configuration == {"arm": "ridgefill+rows", "sweep": None,
                                                                      "row_share": 0.25}
    assert len({doc["id"], doc2["id"]}) == 2


def test_export_without_a_configuration_keeps_its_id(store_chain, tmp_path):
    """The plain fill without a sweep records nothing: the export is the one made before configurations existed
    (its recipe, so its id, and its files)."""
    st, ids = store_chain
    from ridgefill.export.build import FORMAT_VERSION

    legacy = {"stage": "export", "version": FORMAT_VERSION, "source": f"quantize/{ids['quantize']}", "tail": 512}
    r, doc = export_cli(st, ids["quantize"], "--out", tmp_path / "rel")
    assert r.returncode == 0, r.stderr
    assert doc["id"] == recipe_id(legacy) and st.get(doc["id"]).recipe == legacy
    assert "configuration" not in json.loads((tmp_path / "rel" / MANIFEST).read_text())
    r, again = export_cli(st, ids["quantize"], "--out", tmp_path / "rel", "--configuration", "ridgefill")
    assert r.returncode == 0 and again["id"] == doc["id"] and again["cached"] is True
    r, swept = export_cli(st, ids["quantize"], "--configuration", "ridgefill", "--sweep", ids["sweep"])
    assert r.returncode == 0 and swept["id"] != doc["id"]  # a recommended plain fill records its sweep
    assert st.get(swept["id"]).recipe["configuration"] == {"arm": "ridgefill", "sweep": ids["sweep"]}


def test_export_refusals_write_nothing(store_chain, tmp_path):
    st, ids = store_chain
    out = tmp_path / "rel"
    exports = lambda: sorted(p.name for p in (st.root / "export").iterdir()) if (st.root / "export").exists() else []  # noqa: E731
    before = exports()
    sol = ids["solve"]
    for args, message in (
            (["--configuration", "ridgefill+vscale"],
             f"--configuration 'ridgefill+vscale' is not one of: {ARMS_LIST}"),
            (["--configuration", "ridgefill+protected"],
             f"--configuration ridgefill+protected needs a protected-token table, and solve {sol} has none"),
            (["--row-share", "0.2"], "--row-share applies to --configuration ridgefill+rows only, not ridgefill"),
            (["--configuration", "ridgefill+rows", "--row-share", "1.5"],
             "--row-share must be a number between 0 and 1 (exclusive), got 1.5"),
            (["--configuration", "ridgefill+kscale", "--sweep", "nosuch"], "no artifact 'nosuch' in store"),
            (["--configuration", "ridgefill+kscale", "--sweep", sol], f"artifact '{sol}' is a solve artifact, not "
                                                                       "sweep"),
            (["--tail", "0"], "--tail is 0, expected an integer from 1 to 2147483647"),
            (["--tail", "2147483648"], "--tail is 2147483648, expected an integer from 1 to 2147483647")):
        r, _ = export_cli(st, ids["quantize"], "--out", out, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {message}"), r.stderr
        assert not out.exists() and exports() == before


def test_two_exports_into_one_new_out_at_once(store_chain, tmp_path, monkeypatch):
    """Two exports into one new --out at the same time, one plain (this process) and one ridgefill+rows (another
    process): the second to reach the folder waits for the first, finds a different release there and is refused;
    the first's release stays, whole. The interleaving is forced: this export stops just before its swap, starts the
    other and goes on once the other says it waits (without the lock, the other would finish first, unseen)."""
    import os
    import subprocess
    import sys
    import threading

    from ridgefill.export.build import export

    st, ids = store_chain
    out = tmp_path / "new" / "rel"
    move, other = release.move_into_place, {}

    def interleaved(tmp, dst):
        if Path(dst) == out and not other:
            other["proc"] = p = subprocess.Popen(
                [sys.executable, "-m", "ridgefill", "export", ids["quantize"], "--out", str(out), "--configuration",
                 "ridgefill+rows", "--store", str(st.root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            other["lines"], other["watchdog"] = [], threading.Timer(300, p.kill)  # never a hung test
            other["watchdog"].start()
            for line in p.stderr:  # until it waits for this export, or ends
                other["lines"].append(line)
                if "waiting for it to finish" in line:
                    break
        return move(tmp, dst)

    monkeypatch.setattr(release, "move_into_place", interleaved)
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out)
    p = other["proc"]
    _, rest = p.communicate(timeout=300)
    other["watchdog"].cancel()
    lines = [x.rstrip("\n") for x in other["lines"]] + rest.splitlines()
    waited = [x for x in lines if x.endswith("; waiting for it to finish")]
    assert waited and waited[0].startswith(f"--out {out} is being written by pid {os.getpid()} on "), lines
    assert p.returncode == 2 and lines[-1] == (f"Error: --out {out} holds a different release; pass --force to "
                                               "replace it"), lines
    assert "configuration" not in release.read_release(out).manifest
    assert sorted(x.name for x in out.parent.iterdir()) == ["rel"]  # no lock file, no staging folder left


def test_export_refuses_kscale_where_no_layer_above_the_split_has_keys(store_chain, tmp_path, monkeypatch):
    """+kscale rescales keys: a model whose every layer above the split is linear attention (a Gated DeltaNet hybrid
    split above its last full-attention layer) has none, as the runtime says; refused before anything is written."""
    from ridgefill.capture import artifact as captured

    st, ids = store_chain
    monkeypatch.setattr(captured, "captured_kinds", lambda *a: ["full_attention"] * 9 + ["linear_attention"] * 3)
    before = sorted(p.name for p in (st.root / "export").iterdir()) if (st.root / "export").exists() else []
    r, _ = export_cli(st, ids["quantize"], "--out", tmp_path / "rel", "--configuration", "ridgefill+kscale")
    assert r.returncode == 2 and r.stderr.strip() == (
        "Error: --configuration ridgefill+kscale rescales keys, and every layer above split 9 is linear attention "
        "(no keys): choose another configuration")
    assert not (tmp_path / "rel").exists()
    assert (sorted(p.name for p in (st.root / "export").iterdir()) if (st.root / "export").exists() else []) == before
    # (the fake store's maps are key/value maps, which a linear_attention layer cannot have: the model's own kinds)
    monkeypatch.undo()
    r, _ = export_cli(st, ids["quantize"], "--configuration", "ridgefill+kscale")  # layers with keys: exported
    assert r.returncode == 0, r.stderr


def test_gguf_carries_the_configuration(store_chain, tmp_path):
    from ridgefill.formats import gguf

    st, ids = store_chain
    r, _ = export_cli(st, ids["quantize"], "--format", "gguf", "--out", tmp_path / "m.gguf", "--configuration",
                      "ridgefill+kscale")
    assert r.returncode == 0, r.stderr
    facts, _ = gguf.load_gguf(tmp_path / "m.gguf")
    assert facts["configuration"] == {"arm": "ridgefill+kscale"}  # the null sweep is left out, as every null
    r, _ = export_cli(st, ids["quantize"], "--format", "gguf", "--out", tmp_path / "p.gguf")
    assert r.returncode == 0 and "configuration" not in gguf.load_gguf(tmp_path / "p.gguf")[0]
    write_small(tmp_path / "rel", {"arm": "ridgefill+rows", "sweep": "s1", "row_share": 0.3})
    r, _ = export_cli(st, str(tmp_path / "rel"), "--format", "gguf", "--out", tmp_path / "f.gguf")
    assert r.returncode == 0, r.stderr
    assert gguf.load_gguf(tmp_path / "f.gguf")[0]["configuration"] == {"arm": "ridgefill+rows", "sweep": "s1",
                                                                        "row_share": 0.3}
    r, _ = export_cli(st, str(tmp_path / "rel"), "--format", "gguf", "--out", tmp_path / "g.gguf", "--configuration",
                      "ridgefill")
    assert r.returncode == 2 and "records its own configuration" in r.stderr and not (tmp_path / "g.gguf").exists()


# ----------------------------------------------------------------------------------------------- runtime


def tiny_release(lm, folder: Path, configuration=None, table=None) -> Path:
    """A release of random maps at split 2, tail 6, for the loaded tiny model (fit: row 0, and the rows above a norm of
    1e4, which no row of a tiny model reaches)."""
    ref, ad = lm.ref, lm.adapter
    g = torch.Generator().manual_seed(3)
    maps = {l: {"weight": (torch.randn(D, D, generator=g) / D**0.5).numpy(), "bias": torch.randn(D, generator=g).numpy()}
            for l in range(2, ad.num_layers)}  # fmt: skip
    m = {"model": {"name": ref.name, "revision": ref.revision, "architecture": ref.model_type,
                   "num_layers": ad.num_layers, "hidden_size": D, "num_kv_heads": ad.num_kv_heads,
                   "head_dim": ad.head_dim, "fingerprint": ref.fingerprint},
         "split": 2, "tail_default": 6,
         "layers": [{"index": l, "kind": ad.layer_kinds[l], "map": "input"} for l in maps],
         "fit": {"skip_first_rows": 1, "outlier_ratio": 20.0, "exact_norm": 1e4},
         **({"configuration": configuration} if configuration else {})}
    kw = {} if table is None else {"protected": np.asarray(table, dtype=np.int32), "protected_facts": {"types": 3}}
    release.write_release(folder, maps, m, card_mod.model_card, weight_dtype="f32", **kw)
    return folder


def ids_and_table():
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(5))
    table = sorted({int(ids[3]), int(ids[9]), int(ids[17]), int(ids[27])})  # 27 is in the tail: not a prefix row
    positions = [p for p in range(24) if int(ids[p]) in table]
    return ids, table, positions


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_the_runtime_applies_each_configuration_as_the_explicit_call(arch, lm_of, tmp_path):
    from ridgefill.runtime import load_release_maps, prefill

    lm = lm_of(arch)
    ids, table, positions = ids_and_table()
    base = {"split": 2, "tail": 6, "anchor": 1, "exact_norm": 1e4}
    cases = [(None, "ridgefill", {}),
             ({"arm": "ridgefill", "sweep": "s1"}, "ridgefill", {}),
             ({"arm": "ridgefill+rows", "sweep": None, "row_share": 0.25}, "ridgefill+rows", {"row_share": 0.25}),
             ({"arm": "ridgefill+kscale", "sweep": None}, "ridgefill", {"corrections": ("kscale",)}),
             ({"arm": "ridgefill+protected", "sweep": None}, "ridgefill", {"exact_rows": positions})]
    for i, (conf, arm, explicit) in enumerate(cases):
        rel = load_release_maps(lm, tiny_release(lm, tmp_path / f"r{i}", conf, table))
        assert rel.arm == arm and rel.configuration == (conf or {"arm": "ridgefill"})["arm"]
        assert rel.sweep == (conf or {}).get("sweep") and rel.protected.tolist() == table
        opts = rel.options()
        assert set(opts) - set(base) - {"maps", "map_kinds"} == set(explicit) - {"exact_rows"} | (
            {"protected"} if "exact_rows" in explicit else set())
        got = prefill(lm, ids, rel.arm, **opts)
        want = prefill(lm, ids, arm, maps=rel.maps, **base, **explicit)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        assert got.exact_rows == want.exact_rows and got.arm == arm
        if conf and conf["arm"] == "ridgefill+protected":
            assert set(positions) <= set(got.exact_rows) and len(positions) == 3
        if conf and conf["arm"] == "ridgefill+rows":  # the release's share, not the default 10 %
            assert len(got.exact_rows) > len(prefill(lm, ids, arm, maps=rel.maps, **base).exact_rows)


def test_protected_rows_in_every_entry_point(lm_of):
    """`protected` picks the same rows as the explicit exact rows in prefill's fill arms, in prefill_from (built
    from an exact run) and in prefix_prefill; the exact arm ignores it, like the anchor."""
    from ridgefill.runtime import exact_run, prefill, prefill_from, prefix_prefill

    lm = lm_of("llama")
    ids, table, positions = ids_and_table()
    g = torch.Generator().manual_seed(1)
    maps = {l: (torch.randn(D, D, generator=g) / 8, torch.randn(D, generator=g)) for l in (2, 3)}
    run = exact_run(lm, ids, splits=[2], logits_rows=6)
    for arm in ("ridgefill", "identity", "nofill"):
        kw = {"split": 2, "tail": 6, "maps": maps if arm == "ridgefill" else None}
        want = prefill(lm, ids, arm, exact_rows=positions, **kw)
        for protected in (table, set(table), np.array(table, dtype=np.int32), torch.tensor(table)):
            got = prefill(lm, ids, arm, protected=protected, **kw)
            assert got.exact_rows == want.exact_rows == [0, *positions]
            torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
        built = prefill_from(lm, run, arm, protected=table, **kw)
        assert built.exact_rows == want.exact_rows
        torch.testing.assert_close(built.logits, want.logits, atol=1e-4, rtol=1e-4)
    kw = {"split": 2, "tail": 6, "maps": maps}
    assert prefix_prefill(lm, ids, "ridgefill", protected=table, **kw).exact_rows == \
        prefix_prefill(lm, ids, "ridgefill", exact_rows=positions, **kw).exact_rows == [0, *positions]
    assert prefill(lm, ids, "exact", split=2, tail=6, protected=table).exact_rows == []
    assert prefill(lm, ids, "ridgefill", protected=[], **kw).exact_rows == [0]
    with pytest.raises(BadInput, match=r"^protected must be token ids \(integers\), got torch.float32$"):
        prefill(lm, ids, "ridgefill", protected=[0.5], **kw)


# -------------------------------------------------------------------------------------------- eval, gate

EVAL = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--depths", "0.5", "--tasks",
        "single", "--documents", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def configured(tiny_chain):
    """conftest's small chain, exported with --configuration ridgefill+rows --row-share 0.2 (and plain)."""
    from ridgefill.export import export

    c = tiny_chain(SMALL_CHAIN)
    export(c.store, c.sol.id, ExportConfig(configuration="ridgefill+rows", row_share=0.2), quiet(),
           out_dir=c.tmp / "rows")
    return c


def test_eval_measures_the_configured_arm_by_default(configured, tiny_llama):
    """Without --arms, eval measures a configured release's arm (with its controls) beside the default four, at the
    release's row share; the recipe says so. Arms given by name are measured as given."""
    from ridgefill.evaluate import texts
    from ridgefill.evaluate.source import configuration_of, load_source
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import prefill

    c, rel = configured, configured.tmp / "rows"
    r = cli_here("eval", tiny_llama, rel, *EVAL, "--store", c.store.root, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    arms = ["exact", "ridgefill", "identity", "nofill", "ridgefill+rows", "ridgefill+rows:random",
            "ridgefill+rows:tail"]
    assert sorted(doc["summary"]["arms"]) == sorted(arms) and c.store.get(doc["id"]).recipe["arms"] == arms
    assert "ridgefill+rows - ridgefill" in doc["summary"]["pairs"]
    manifest = json.loads((rel / MANIFEST).read_text())
    assert sorted(manifest["eval"]["arms"]) == sorted(arms)
    assert "- Configuration: `ridgefill+rows`" in (rel / "README.md").read_text()

    src = load_source(c.store, str(rel))
    assert (src.configuration, src.row_share) == ("ridgefill+rows", 0.2) and configuration_of(str(rel)) == src.configuration
    assert configuration_of(c.sol.id) == "ridgefill" and load_source(c.store, c.sol.id).configuration == "ridgefill"
    lm = load_model(resolve_model(str(tiny_llama), store_root=c.store.root), store_root=c.store.root)
    res = json.loads(c.store.get(doc["id"]).file("results.json").read_text())
    for d, row in zip(texts.long_documents(lm.tokenizer, 128, limit=2), res["documents"]):
        ids = torch.tensor(d.ids[:128])
        kw = {"split": src.split, "tail": 48, "maps": src.maps, "probe": range(128 - 16 - 64, 128 - 16)}
        rows = set(prefill(lm, ids, "ridgefill+rows", row_share=0.2, **kw).exact_rows) - {0}
        assert row["rows_added"]["ridgefill+rows"] == len(rows) > len(
            set(prefill(lm, ids, "ridgefill+rows", **kw).exact_rows) - {0})  # 20 %, not the default 10 %

    r = cli_here("eval", tiny_llama, rel, *EVAL, "--arms", "exact", "--arms", "ridgefill", "--store", c.store.root,
                 "--json")
    assert r.returncode == 0 and sorted(json.loads(r.stdout)["summary"]["arms"]) == ["exact", "ridgefill"]


def test_eval_arms_of_a_configured_release_before_any_work():
    from ridgefill.evaluate import EvalConfig, check

    names = lambda cfg, conf: [a.name for a in check(cfg, conf)]  # noqa: E731
    default = ["exact", "ridgefill", "identity", "nofill"]
    assert names(EvalConfig(), "ridgefill") == default
    assert names(EvalConfig(), "ridgefill+kscale") == [*default, "ridgefill+kscale"]
    assert names(EvalConfig(), "ridgefill+protected") == [*default, "ridgefill+protected", "ridgefill+protected:random",
                                                          "ridgefill+protected:tail"]
    assert names(EvalConfig(arms=("exact", "ridgefill+vscale")), "ridgefill+kscale") == ["exact", "ridgefill+vscale"]


def test_the_gate_judges_the_configured_arm_by_default(configured, tiny_llama, tmp_path):
    """A gate file without `arm` judges the release's configured arm (the eval is a cache hit of the test above);
    one naming an arm judges that one; a configured arm eval will not measure is refused before any work."""
    c, rel = configured, configured.tmp / "rows"
    gate = tmp_path / "gate.toml"
    gate.write_text("[thresholds]\nkl_max = -1.0\n")
    r = cli_here("eval", tiny_llama, rel, *EVAL, "--gate", gate, "--store", c.store.root, "--json")
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: gate failed: kl_max: ridgefill+rows kl = ")
    assert json.loads(r.stdout)["gate"]["arm"] == "ridgefill+rows"
    gate.write_text('arm = "ridgefill"\n[thresholds]\nkl_max = -1.0\n')
    r = cli_here("eval", tiny_llama, rel, *EVAL, "--gate", gate, "--store", c.store.root)
    assert r.returncode == 3 and "Error: gate failed: kl_max: ridgefill kl = " in r.stderr
    gate.write_text("[thresholds]\nkl_max = 1e9\n")
    r = cli_here("eval", tiny_llama, c.release, *EVAL, "--gate", gate, "--store", c.store.root, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["gate"] == {"passed": True, "failed": [], "arm": "ridgefill"}
    evals = sorted(p.name for p in (c.store.root / "eval").iterdir())
    r = cli_here("eval", tiny_llama, rel, *EVAL, "--arms", "exact", "--arms", "ridgefill", "--gate", gate,
                 "--store", c.store.root)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"Error: gate file '{gate}': arm 'ridgefill+rows' (the release's configured arm: the file names no arm) is "
        "not among the arms eval measures (exact, ridgefill); add it with --arms (a recipe: [eval] arms)")
    assert sorted(p.name for p in (c.store.root / "eval").iterdir()) == evals


def test_check_gate_default_arm_by_hand(tmp_path):
    from ridgefill.evaluate.gate import check_gate, load_gate

    summary = {"arms": {"exact": {"needle": 90.0}, "ridgefill": {"needle": 80.0, "kl": 0.1},
                        "ridgefill+kscale": {"needle": 88.0, "kl": 0.05}}}
    rules = {"thresholds": {"needle_drop_max": 5.0}}
    assert check_gate(summary, rules) == ["needle_drop_max: ridgefill needle_drop = 10, limit 5"]
    assert check_gate(summary, rules, default_arm="ridgefill+kscale") == []
    assert check_gate(summary, {"arm": "ridgefill", **rules}, default_arm="ridgefill+kscale") != []
    gate = tmp_path / "g.toml"
    gate.write_text("[thresholds]\nkl_max = 0.5\n")
    assert "arm" not in load_gate(gate, ["exact", "ridgefill+kscale"], default_arm="ridgefill+kscale")
    with pytest.raises(BadInput, match=r"arm 'ridgefill' is not among the arms eval measures \(exact\)"):
        load_gate(gate, ["exact"])


# -------------------------------------------------------------------------------------------------- card


def test_card_states_the_configuration_and_the_runtime_call():
    m = {"model": {"name": "example/model-1", "architecture": "llama"}, "split": 2, "tail_default": 8,
         "protected_tokens": {"types": 120}}
    plain = card_mod.model_card(m)
    assert "- Configuration: `ridgefill`: the plain fill. Applied as made by `prefill(lm, ids, rel.arm, " \
           "**rel.options())` (`rel.arm` is `\"ridgefill\"`" in plain
    assert "res = prefill(lm, ids, rel.arm, **opts)" in plain
    for conf, words in (
            ({"arm": "ridgefill+rows", "sweep": "abc123", "row_share": 0.2},
             ["`ridgefill+rows`, recommended by sweep `abc123`: the fill, and the 20 % of the prompt's rows",
              '`rel.arm` is `"ridgefill+rows"`', "plus `row_share=0.2`"]),
            ({"arm": "ridgefill+kscale", "sweep": None}, ["`ridgefill+kscale`: the fill with a per-request key "
                                                          "rescale", 'plus `corrections=("kscale",)`']),
            ({"arm": "ridgefill+protected", "sweep": None}, ["protected-token table (120 token types) run every",
                                                             "plus `protected`"])):
        line = next(x for x in card_mod.model_card({**m, "configuration": conf}).splitlines()
                    if x.startswith("- Configuration: "))
        assert card_mod.RUNTIME_CALL in line
        for w in words:
            assert w in line, (w, line)


def test_card_snippet_applies_the_configuration(tmp_path, tiny_llama, lm_of, monkeypatch, capsys):
    """The card's Python snippet, run as printed on a ridgefill+rows release: it prefills with the configured arm and
    the release's row share."""
    lm = lm_of("llama")
    rel = tiny_release(lm, tmp_path / "rel", {"arm": "ridgefill+rows", "sweep": None, "row_share": 0.3})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("The ridge map predicts a late layer's input from the split state. " * 2)
    text = (rel / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = snippet.replace('"MODEL"', repr(str(tiny_llama))).replace('"DIR"', repr(str(rel)))
    run = {}
    exec(compile(code, "card-snippet", "exec"), run)
    assert capsys.readouterr().out.endswith("\n")
    res, n = run["res"], len(run["ids"])
    assert res.arm == "ridgefill+rows" and n > 6
    assert len(res.exact_rows) >= min(round(0.3 * n), n - 6)


def test_an_engine_prefix_refuses_a_configuration_it_cannot_apply(lm_of, tiny_llama, tmp_path):
    """`engine prefix` computes the prefix alone: +kscale and +rows need the tail, which the engine computes."""
    from ridgefill.engines.make import make_prefix

    lm = lm_of("llama")
    rel = tiny_release(lm, tmp_path / "rel", {"arm": "ridgefill+kscale", "sweep": None})
    (tmp_path / "prompt.txt").write_text("The ridge map predicts a late layer's input from the split state. " * 2)
    with pytest.raises(BadInput, match=r"is configured ridgefill\+kscale, which a prefix cannot apply"):
        make_prefix(Store(tmp_path / "store"), str(tiny_llama), rel, tmp_path / "prompt.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
