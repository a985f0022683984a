"""A minimal second reader for the release formats `ridgefill-maps/2`, `ridgefill-maps/1` and `ridgefill-maps/3`.

Written from docs/format.md alone (Files, Tensors, Manifest, Verifying, Applying a map), without the project's
own reader, to show that the spec is enough for a runtime author; the conformance tests run it beside the
project's reader. Standard library and numpy only: the safetensors bytes are parsed here.

    python examples/reader/ridgefill_reader.py FOLDER    # "ok: <n> layers" (exit 0) or "refused: <why>" (exit 2)

`read_release(folder)` checks the rules of "Verifying" in their order and returns
`(manifest, {layer: (W float32 [d_out, d_in], b float32 [d_out])})`, or raises `Refused` with one line that
starts with the file at fault and quotes the manifest field or tensor at fault. `map_kinds(manifest)` says what
each map predicts: "input" (x_hat, every map of a `/1` release) or "kv" (the layer's keys, before RoPE and QK-norm,
then its values). `states(manifest)` says what each map reads: the layers whose entering states sit side by side in
its input `x` (`[split]` in `/1` and `/2`, where `x` is `h_S`; the manifest's `states` in `/3`, the split first).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import sys

import numpy as np

V1, V2, V3 = "ridgefill-maps/1", "ridgefill-maps/2", "ridgefill-maps/3"  # /3: /2 plus `states`
FORMATS = (V1, V2, V3)
MANIFEST, MAPS, README = "ridgefill.json", "maps.safetensors", "README.md"
PROTECTED, CORRECTIONS = "protected.safetensors", "corrections.safetensors"
EXTRA = (("protected_tokens", PROTECTED), ("corrections.state", CORRECTIONS))  # the optional tensor files
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # a header may name any; rule 10 refuses
NUMPY = {"I8": "<i1", "I32": "<i4", "BF16": "<u2", "F32": "<f4"}       # the dtypes a release may hold
KINDS = {"int8": {"codes": "I8", "scales": "BF16", "bias": "BF16"},
         "f32": {"weight": "F32", "bias": "F32"}, "bf16": {"weight": "BF16", "bias": "BF16"}}
CONFIGURATIONS = ("ridgefill", "ridgefill+rows", "ridgefill+kscale", "ridgefill+protected")
MAP_TENSOR = re.compile(r"layer\.(0|[1-9][0-9]*)\.(codes|scales|bias|weight)")
MISSING = object()


class Refused(Exception):
    """The folder is not a valid release; the message is one line naming the file (and field or tensor) at fault."""


def refuse(file, why):
    raise Refused(f"{esc(file)}: {why}")


def need(ok, file, why):
    if not ok:
        refuse(file, why)


def one_line(text: str) -> str:  # JSON escapes control characters; U+2028/9 break lines too
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def esc(s) -> str:
    return one_line(json.dumps(str(s), ensure_ascii=False)[1:-1])


def q(s) -> str:
    return f"'{esc(s)}'"


def show(v) -> str:
    text = "absent" if v is MISSING else one_line(json.dumps(v, ensure_ascii=False))
    return text if len(text) <= 80 else text[:77] + "..."


def as_int(x):
    """An integer as a JavaScript reader sees one (12 and 12.0 alike), else None."""
    return int(x) if type(x) is int or (type(x) is float and x.is_integer()) else None


def get(obj, dotted):
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return MISSING
        obj = obj[key]
    return obj


def lkind(path):
    """'file', 'dir', 'link', 'other', or None when absent; a link is never followed."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return "link" if stat.S_ISLNK(mode) else "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def read_bytes(path, name) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        refuse(name, f"unreadable ({esc(e.strerror)})")


def strict_json(text, file, what):
    """JSON with no key twice in one object and no NaN or infinity (nor an overflowing 1e999)."""
    def pairs(items):
        seen = set()
        for k, _ in items:
            if k in seen:
                raise ValueError(f"the key {q(k)} appears twice in one object")
            seen.add(k)
        return dict(items)

    def number(s):
        if not math.isfinite(float(s)):
            raise ValueError(f"{s} is not a finite number")
        return float(s)

    def constant(name):
        raise ValueError(f"{name} is not a JSON number")
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_float=number, parse_constant=constant)
    except (ValueError, RecursionError) as e:
        refuse(file, f"{what} ({esc(e)})")


def same(a, b) -> bool:
    """Rule 8's comparison by value: numbers as numbers, booleans only to booleans, containers element-wise."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def differences(m, f, path=""):
    """[(dotted path, manifest value, facts value)]: objects are descended, anything else compared whole."""
    if not (isinstance(m, dict) and isinstance(f, dict)):
        return [] if same(m, f) else [(path, m, f)]
    out = []
    for k in set(m) | set(f):
        p = f"{path}.{k}" if path else k
        out += differences(m[k], f[k], p) if k in m and k in f else [(p, m.get(k, MISSING), f.get(k, MISSING))]
    return out


def parse_safetensors(data: bytes, file):
    """-> (metadata, {name: (dtype, shape, raw bytes)}); the tensors' byte ranges must tile the data exactly."""
    def bad(ok, why):
        need(ok, file, f"unreadable header ({why})")
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    bad(0 < n <= len(data) - 8, "no 8-byte length followed by that many header bytes")
    try:
        header = strict_json(data[8:8 + n].decode("utf-8"), file, "unreadable header")  # a name twice: a key twice
    except UnicodeDecodeError:
        refuse(file, "unreadable header (not UTF-8)")
    bad(isinstance(header, dict), "not a JSON object")
    meta = header.pop("__metadata__", {})
    bad(isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()),
        "'__metadata__' is not an object of strings")
    body, tensors, end = memoryview(data)[8 + n:], {}, 0
    sizes = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
    for name, t in header.items():
        t = t if isinstance(t, dict) else {}
        dtype, shape, span = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        bad(dtype in ITEMSIZE and sizes(shape) and sizes(span) and len(span) == 2,
            f"{q(name)} has no valid dtype, shape and data_offsets")
        size = math.prod(shape) * ITEMSIZE[dtype]
        bad(span[1] - span[0] == size, f"{q(name)} spans {span[1] - span[0]} bytes, not {size}")
        tensors[name] = (dtype, tuple(shape), body[span[0]:span[1]])
    for start, stop, name in sorted((t["data_offsets"] + [name]) for name, t in header.items()):
        bad(start == end, f"{'a gap before' if start > end else 'an overlap at'} {q(name)}")
        end = stop
    bad(end == len(body), f"the tensors cover {end} of {len(body)} data bytes")
    return meta, tensors


def array(entry) -> np.ndarray:
    """A tensor as numpy; BF16 becomes float32 (its bits are the top half of a float32)."""
    dtype, shape, raw = entry
    a = np.frombuffer(raw, dtype=NUMPY[dtype]).reshape(shape)
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else a


def read_release(folder):
    at = lambda name: os.path.join(os.fspath(folder), name)
    # 1. the manifest
    kind = lkind(at(MANIFEST))
    need(kind == "file", MANIFEST, {None: "missing", "link": "is a symbolic link"}.get(kind, "is not a regular file"))
    try:
        manifest = strict_json(read_bytes(at(MANIFEST), MANIFEST).decode("utf-8"), MANIFEST, "invalid JSON")
    except UnicodeDecodeError:
        refuse(MANIFEST, "not UTF-8")
    need(isinstance(manifest, dict), MANIFEST, "not a JSON object")
    fmt = manifest.get("format", MISSING)
    need(fmt in FORMATS, MANIFEST, f"'format' is {show(fmt)}, not '{V1}', '{V2}' or '{V3}'")
    # 2. files
    files = manifest.get("files")
    need(isinstance(files, dict) and files, MANIFEST, "'files' is not a non-empty object")
    for name, digest in files.items():
        need(name not in ("", ".", "..") and name == name.strip() and not any(c in name for c in "/\\:\0"),
             MANIFEST, f"'files' entry {q(name)} is not a bare file name")
        need(name not in (README, MANIFEST, ".gitattributes", ".cache"), MANIFEST, f"'files' may not list {q(name)}")
        need(isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest), MANIFEST,
             f"'files' value of {q(name)} is not 64 lowercase hex digits")
    need(MAPS in files, MANIFEST, f"'files' does not list '{MAPS}'")
    # 3. the tensor files the manifest names, all listed, and nothing listed unnamed
    pfiles = get(manifest, "projector.files")
    need(pfiles == [MAPS], MANIFEST, f"'projector.files' is {show(pfiles)}, not [\"{MAPS}\"]")
    named = {n: "projector.files" for n in pfiles}
    for field, fname in EXTRA:
        if get(manifest, field) is not MISSING:
            need(get(manifest, field + ".file") == fname, MANIFEST,
                 f"'{field}.file' is {show(get(manifest, field + '.file'))}, not '{fname}'")
            need(fname not in named, MANIFEST, f"'{fname}' is named by both 'projector.files' and '{field}.file'")
            named[fname] = f"{field}.file"
    for name, field in named.items():
        need(name in files, MANIFEST, f"{q(name)} is named by the manifest ({q(field)}) but not listed in 'files'")
    for name in sorted(set(files) - set(named)):
        refuse(MANIFEST, f"'files' lists {q(name)}, which no tensor file field of the manifest names")
    # 4. listed files are regular files; 5. nothing unlisted but README.md and what `hf download` leaves
    for name in sorted(files) + [README]:
        kind = lkind(at(name))
        need(kind == "file" or (name == README and kind is None), name, {
            None: "listed in 'files' but missing", "link": "is a symbolic link"}.get(kind, "is not a regular file"))
    for entry in sorted(os.listdir(os.fspath(folder))):
        kind = lkind(at(entry))
        need(entry in files or entry in (MANIFEST, README) or (entry, kind) == (".gitattributes", "file") or (
            (entry, kind) == (".cache", "dir") and os.listdir(at(entry)) == ["huggingface"]
            and lkind(at(os.path.join(entry, "huggingface"))) == "dir"),
            entry, "is a symbolic link" if kind == "link" else "is not listed in 'files'")
    # 6. hashes
    data = {name: read_bytes(at(name), name) for name in sorted(files)}
    for name in sorted(files):
        digest = hashlib.sha256(data[name]).hexdigest()
        need(digest == files[name], name, f"its sha256 is {digest} but 'files' records {files[name]}")
    # 7. maps.safetensors and its facts
    parsed = {MAPS: parse_safetensors(data[MAPS], MAPS)}
    meta = parsed[MAPS][0]
    need(meta.get("format") == fmt, MAPS, f"'format' metadata is {show(meta.get('format', MISSING))}, "
                                          f"not the manifest's '{fmt}'")
    need("ridgefill.facts" in meta, MAPS, "no 'ridgefill.facts' metadata (written before facts were recorded: "
                                          "export it again)")
    facts = strict_json(meta["ridgefill.facts"], MAPS, "'ridgefill.facts' is not valid JSON")
    need(isinstance(facts, dict), MAPS, "'ridgefill.facts' is not a JSON object")
    # 8. the manifest says what the facts say
    diffs = differences({k: v for k, v in manifest.items() if k not in ("files", "eval")}, facts)
    if diffs:
        path, mine, recorded = min(diffs, key=lambda d: d[0])
        refuse(MANIFEST, f"{q(path)} is {show(mine)} but {MAPS} records "
                         f"{'no such field' if recorded is MISSING else show(recorded)}")
    # 9. the other tensor files belong to this release
    for field, fname in EXTRA:
        recorded = get(manifest, field + ".sha256")
        need(fname not in named or recorded == files[fname], fname, f"its sha256 is not the one the facts record "
             f"({q(field + '.sha256')} is {show(recorded)}): a tensor file of another release")
    # 10. the tensors
    parsed.update({name: parse_safetensors(data[name], name) for name in named if name != MAPS})
    for name, (meta, _) in parsed.items():
        need(meta.get("format") == fmt, name,
             f"'format' metadata is {show(meta.get('format', MISSING))}, not the manifest's '{fmt}'")
    for name, (_, tensors) in parsed.items():
        for t, (dtype, _, _) in sorted(tensors.items()):
            need(dtype in NUMPY, name, f"tensor {q(t)} has dtype {dtype}, not one of I8, I32, BF16, F32")
    check_configuration(manifest)
    check_exact_norm(manifest)
    maps = tensor_checks(manifest, parsed, pfiles, named)
    check_applied(manifest)  # 11
    check_states(manifest)  # 12
    check_map_kinds(manifest)
    if fmt != V1:
        check_widths(manifest, maps, pfiles)
    check_bounds(manifest, maps, pfiles)  # 13
    return manifest, maps


def check_applied(manifest):
    """Rule 11: the facts a runtime applies the release with. Integers as a JavaScript reader sees them."""
    layers_n = as_int(get(manifest, "model.num_layers"))
    need(layers_n is not None and layers_n > 0, MANIFEST,
         f"'model.num_layers' is {show(get(manifest, 'model.num_layers'))}, not a positive integer")
    split = as_int(manifest.get("split"))
    need(split is not None and 1 <= split < layers_n, MANIFEST,
         f"'split' is {show(manifest.get('split', MISSING))}, not an integer in [1, {layers_n})")
    tail = as_int(manifest.get("tail_default"))
    need(tail is not None and 1 <= tail <= 2**31 - 1, MANIFEST,
         f"'tail_default' is {show(manifest.get('tail_default', MISSING))}, not an integer in [1, 2**31 - 1]")
    skip = get(manifest, "fit.skip_first_rows")
    v1 = manifest["format"] == V1
    need(skip is not MISSING or v1, MANIFEST, "'fit.skip_first_rows' is missing")
    need((skip is MISSING and v1) or (as_int(skip) is not None and skip >= 0), MANIFEST,
         f"'fit.skip_first_rows' is {show(skip)}, not an integer >= 0")
    for key in ("name", "fingerprint"):
        value = get(manifest, f"model.{key}")
        need(isinstance(value, str) and value, MANIFEST, f"'model.{key}' is {show(value)}, not a non-empty string")
    calibration = get(manifest, "fit.calibration_sha256")
    need(calibration is MISSING or (isinstance(calibration, list) and all(isinstance(x, str) for x in calibration)),
         MANIFEST, f"'fit.calibration_sha256' is {show(calibration)}, not a list of strings")
    if not v1:  # compared index by index: a list as long as a forged num_layers would be no check at all
        indices = [as_int(e.get("index")) if isinstance(e, dict) else None for e in manifest["layers"]]
        need(len(indices) == layers_n - split and all(i == split + k for k, i in enumerate(indices)), MANIFEST,
             f"'layers' runs over {show(indices)}, not {split}..{layers_n - 1} ascending")


def check_bounds(manifest, maps, pfiles):
    """Rule 13: no map writes more than 2**24 for an input it fills (norm <= fit.exact_norm; in /3 the norm of the
    stacked states x, the same arithmetic): for every row i of every map, ||W_i|| exact_norm + |b_i| <= 2**24
    (computed here in float64)."""
    norm = float(get(manifest, "fit.exact_norm"))
    for layer, (weight, bias) in sorted(maps.items()):
        w = weight.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            bound = float(np.max(np.sqrt((w * w).sum(axis=1)) * norm + np.abs(bias.astype(np.float64))))
        need(bound <= 2.0**24, pfiles[0], f"layer {layer}'s map writes up to {bound:.3g} for a row of norm "
                                          f"'fit.exact_norm' {norm:g}, past 2**24")


def check_states(manifest):
    """Rule 12's `states`: none in /1 and /2; in /3 a list [split, l1, ..., lk] of integers, k >= 1, the l distinct
    and 0 <= l < split. Its length is checked before any entry is looked at, as the spec asks: a forged list of 10**6
    entries is refused by its length. Runs after rule 11, so the split is an integer in [1, num_layers)."""
    got, fmt = manifest.get("states", MISSING), manifest["format"]
    if fmt != V3:
        need(got is MISSING, MANIFEST, f"'states' is in a '{fmt}' release (maps that read earlier states are '{V3}')")
        return
    split = as_int(manifest["split"])
    want = f"not [{split}, l, ...]: the split first, then one or more distinct layers l with 0 <= l < {split}"
    need(isinstance(got, list), MANIFEST, f"'states' is {show(got)}, {want}")
    need(len(got) <= split + 1, MANIFEST, f"'states' has {len(got)} entries, more than 'split' + 1 = {split + 1}")
    layers = [as_int(x) for x in got]
    need(len(layers) >= 2 and layers[0] == split, MANIFEST, f"'states' is {show(got)}, {want}")
    need(all(l is not None and 0 <= l < split for l in layers[1:]), MANIFEST, f"'states' is {show(got)}, {want}")
    need(len(set(layers)) == len(layers), MANIFEST, f"'states' is {show(got)}, which names a layer twice")


def states(manifest):
    """The layers whose entering states a map reads, side by side, of a release that reads: /3's `states`, else the
    split alone."""
    if manifest["format"] == V3:
        return [as_int(x) for x in manifest["states"]]
    return [as_int(manifest["split"])]


def check_map_kinds(manifest):
    """Rule 12, before the widths: `map` only in /2 and /3, where it is "input" or "kv", never "kv" on a Gated
    DeltaNet layer; the KV shape a positive integer number of heads and dims."""
    layers = manifest["layers"]
    if manifest["format"] == V1:
        for i, e in enumerate(layers):
            need(not (isinstance(e, dict) and "map" in e), MANIFEST, f"'layers[{i}].map' is not in '{V1}'")
        return
    for key in ("hidden_size", "num_kv_heads", "head_dim"):
        n = get(manifest, f"model.{key}")
        need(as_int(n) is not None and n > 0, MANIFEST, f"'model.{key}' is {show(n)}, not a positive integer")
    for i, e in enumerate(layers):
        need(set(e) <= {"index", "kind", "map"}, MANIFEST,
             f"'layers[{i}]' has the keys {show(sorted(e))}, not index, kind and map")
        need(e.get("map", MISSING) in ("input", "kv"), MANIFEST,
             f"'layers[{i}].map' is {show(e.get('map', MISSING))}, not \"input\" or \"kv\"")
        need(not (e["map"] == "kv" and e["kind"] == "linear_attention"), MANIFEST,
             f"'layers[{i}].map' is \"kv\" on a linear_attention layer")


def map_kinds(manifest):
    """{layer: "input" | "kv"} of a release that reads."""
    return {as_int(e["index"]): e.get("map", "input") for e in manifest["layers"]}


def check_widths(manifest, maps, pfiles):
    """Rule 12's widths (/2, /3): d_in is model.hidden_size times the number of states the maps read (one in /2);
    d_out is hidden_size (input) or 2 kv_heads head_dim (kv)."""
    d = as_int(get(manifest, "model.hidden_size"))
    d_in = d * len(states(manifest))
    kv = 2 * as_int(get(manifest, "model.num_kv_heads")) * as_int(get(manifest, "model.head_dim"))
    part = "codes" if get(manifest, "projector.dtype") == "int8" else "weight"
    for layer, kind in sorted(map_kinds(manifest).items()):
        want = [kv if kind == "kv" else d, d_in]
        got = list(maps[layer][0].shape)
        need(got == want, pfiles[0], f"tensor 'layer.{layer}.{part}' is {got}, not {want} for {kind} map")


def check_configuration(manifest):
    """Rule 10's `configuration`: absent, or {"arm", "sweep"} (+ "row_share" for ridgefill+rows) as the spec says."""
    conf = manifest.get("configuration", MISSING)
    if conf is MISSING:
        return
    need(isinstance(conf, dict), MANIFEST, f"'configuration' is {show(conf)}, not an object")
    arm = conf.get("arm", MISSING)
    need(arm in CONFIGURATIONS, MANIFEST, f"'configuration.arm' is {show(arm)}, not one of {', '.join(CONFIGURATIONS)}")
    keys = {"arm", "sweep", "row_share"} if arm == "ridgefill+rows" else {"arm", "sweep"}
    need(set(conf) == keys, MANIFEST, f"'configuration' has the keys {show(sorted(conf))}, not {show(sorted(keys))}")
    sweep = conf["sweep"]
    need(sweep is None or (isinstance(sweep, str) and sweep.strip() != ""), MANIFEST,
         f"'configuration.sweep' is {show(sweep)}, not a string or null")
    share = conf.get("row_share", 0.5)
    need(type(share) in (int, float) and 0 < share < 1, MANIFEST,
         f"'configuration.row_share' is {show(share)}, not a number in (0, 1)")
    need(arm != "ridgefill+protected" or "protected_tokens" in manifest, MANIFEST,
         "'configuration.arm' is ridgefill+protected, but the release has no 'protected_tokens'")


def check_exact_norm(manifest):
    """Rule 10's `fit.exact_norm`: a positive number (the split-state norm above which a prefix row runs exactly); a
    release without it was exported before the field existed."""
    norm = get(manifest, "fit.exact_norm")
    need(norm is not MISSING, MANIFEST, "'fit.exact_norm' is missing (exported before the field existed: export it "
                                        "again)")
    need(type(norm) in (int, float) and 0 < norm < math.inf, MANIFEST,
         f"'fit.exact_norm' is {show(norm)}, not a positive number")


def tensor_checks(manifest, parsed, pfiles, named):
    """Rule 10 after the dtypes; returns the decoded maps."""
    kind, g = get(manifest, "projector.dtype"), get(manifest, "projector.group_size")
    need(kind in KINDS, MANIFEST, f"'projector.dtype' is {show(kind)}, not int8, f32 or bf16")
    need(kind != "int8" or (as_int(g) is not None and g > 0), MANIFEST,
         f"'projector.group_size' is {show(g)}, not a positive integer")
    where = {}  # map tensor -> the file that holds it
    for name in pfiles:
        for t in sorted(parsed[name][1]):
            need(MAP_TENSOR.fullmatch(t), name, f"tensor {q(t)} is not named layer.<l>.(codes|scales|bias|weight)")
    for name in pfiles:
        for t in sorted(parsed[name][1]):
            need(t not in where, name, f"tensor {q(t)} is also in {q(where.get(t))}")
            where[t] = name
    layers = manifest.get("layers")
    entries = [(as_int(e.get("index")), e.get("kind")) if isinstance(e, dict) else (None, None)
               for e in (layers if isinstance(layers, list) else [None])]
    indices = sorted(i for i, _ in entries if i is not None)
    need(entries and all(i is not None and i >= 0 and isinstance(k, str) for i, k in entries)
         and len(set(indices)) == len(entries), MANIFEST,
         "'layers' is not a non-empty list of {\"index\": l, \"kind\": k} with distinct l >= 0")
    holder = {}  # layer -> the first file holding a tensor of it
    for t, name in sorted(where.items()):
        holder.setdefault(int(MAP_TENSOR.fullmatch(t)[1]), name)
    for layer in sorted(set(holder) - set(indices)):
        refuse(holder[layer], f"holds tensors of layer {layer}, which 'layers' does not list")
    for layer in indices:
        need(layer in holder, MANIFEST, f"'layers' lists layer {layer} but no tensor file holds its map")
    want, maps = KINDS[kind], {}
    for layer in indices:
        for t in sorted(where):
            need(MAP_TENSOR.fullmatch(t)[1] != str(layer) or MAP_TENSOR.fullmatch(t)[2] in want, where[t],
                 f"tensor {q(t)} does not belong in {kind} maps")
        for part, dtype in want.items():
            t, rank = f"layer.{layer}.{part}", 1 if part == "bias" else 2
            need(t in where, holder[layer], f"tensor {q(t)} is missing")
            got, shape, _ = parsed[where[t]][1][t]
            need(got == dtype and len(shape) == rank, where[t], f"tensor {q(t)} is {got} {list(shape)}, "
                                                              f"not {dtype} of rank {rank}")
    for layer in indices:
        names = {part: f"layer.{layer}.{part}" for part in want}
        maps[layer] = decode(layer, kind, as_int(g), {p: (where[t], parsed[where[t]][1][t]) for p, t in names.items()})
    if PROTECTED in named:
        tensors = parsed[PROTECTED][1]
        entry = tensors.get("protected_token_ids", (None, ()))
        need(len(tensors) == 1 and entry[0] == "I32" and len(entry[1]) == 1, PROTECTED,
             "is not one I32 vector 'protected_token_ids'")
        ids = array(entry).astype(np.int64)
        need(not ((ids < 0).any() or (np.diff(ids) <= 0).any()), PROTECTED,
             "tensor 'protected_token_ids' is not strictly ascending ids >= 0")
    if CORRECTIONS in named:
        linear = sorted(i for i, k in entries if k == "linear_attention")
        recorded = get(manifest, "corrections.state.layers")
        need(same(recorded, linear), MANIFEST, f"'corrections.state.layers' is {show(recorded)} but the "
                                               f"linear_attention layers of 'layers' are {show(linear)}")
        tensors, own = parsed[CORRECTIONS][1], [f"layer.{i}.state_offset" for i in linear]
        for t in sorted(set(tensors) - set(own)):
            refuse(CORRECTIONS, f"tensor {q(t)} is not the state offset of a linear_attention layer of 'layers'")
        for t in own:
            need(t in tensors, CORRECTIONS, f"tensor {q(t)} is missing")
            need(tensors[t][0] == "F32" and len(tensors[t][1]) == 3, CORRECTIONS, f"tensor {q(t)} is not F32 of rank 3")
            need(np.isfinite(array(tensors[t])).all(), CORRECTIONS, f"tensor {q(t)} holds NaN or infinity")
    return maps


def decode(layer, kind, g, found):
    """One layer's map as float32 W [d_out, d_in], b [d_out] ("Applying a map"); found: {part: (file, tensor)}."""
    def fault(ok, part, why):
        need(ok, found[part][0], f"tensor 'layer.{layer}.{part}' {why}")
    t = {part: array(entry) for part, (_, entry) in found.items()}
    if kind == "int8":
        (d_out, d_in), groups = t["codes"].shape, -(-t["codes"].shape[1] // g)
        fault(t["scales"].shape == (d_out, groups), "scales",
              f"has shape {list(t['scales'].shape)}, not [{d_out}, {groups}]")
        fault(np.isfinite(t["scales"]).all() and (t["scales"] > 0).all(), "scales",
              "holds a scale that is not finite and positive")
        fault(not (t["codes"] == -128).any(), "codes", "holds the code -128")
        weight = t["codes"].astype(np.float32) * t["scales"][:, np.arange(d_in) // g]  # exact in float32
    else:
        weight = t["weight"].astype(np.float32)
    bias = t["bias"].astype(np.float32)
    fault(bias.shape == weight.shape[:1], "bias", f"has length {bias.shape[0]}, not d_out = {weight.shape[0]}")
    fault(np.isfinite(weight).all(), "scales" if kind == "int8" else "weight", "holds NaN or infinity")
    fault(np.isfinite(bias).all(), "bias", "holds NaN or infinity")
    return weight, bias


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python examples/reader/ridgefill_reader.py FOLDER", file=sys.stderr)
        return 1
    try:
        _, maps = read_release(args[0])
    except Refused as e:
        print(f"refused: {e}")
        return 2
    print(f"ok: {len(maps)} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
