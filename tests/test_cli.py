"""The CLI through its real entry point: fast --help and --version, exit codes, JSON on stdout, -q/--quiet,
shell completion, the --token warning, artifacts commands."""

import importlib.metadata
import json
import subprocess
import sys

import numpy as np
import pytest
from clirun import cli, cli_here

HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub")


here = cli_here  # the CLI in this process (tests/clirun.py)


def run_main_and_list_heavy(*args: str) -> subprocess.CompletedProcess:
    """`ridgefill ARGS` in a fresh interpreter; the last stdout line lists the heavy modules it imported."""
    code = (f"import sys; sys.argv = ['ridgefill', *{list(args)!r}]\n"
            "from ridgefill.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_help_does_not_import_torch():
    r = run_main_and_list_heavy("--help")
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    for cmd in ("capture", "solve", "quantize", "export", "verify", "artifacts"):
        assert cmd in r.stdout
    # shell completion is on, and costs --help no heavy import
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout
    # nor does a command's help, its defaults read from its config (capture/config.py)
    r = run_main_and_list_heavy("capture", "--help")
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout and "--checkpoint-every" in r.stdout


def test_version_prints_the_package_version_without_torch():
    import ridgefill

    r = run_main_and_list_heavy("--version")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"ridgefill {ridgefill.__version__}" == f"ridgefill {importlib.metadata.version('ridgefill')}"
    assert lines[1] == "HEAVY []" and r.stderr == ""


def test_shell_completion_completes_commands_and_options():
    """What the installed completion script asks the program (bash protocol): commands, then -q/--quiet too."""
    bash = {"_RIDGEFILL_COMPLETE": "complete_bash", "COMP_CWORD": "1", "COMP_WORDS": "ridgefill ca"}
    r = here(env=bash)
    assert r.returncode == 0 and r.stdout.split() == ["capture"]
    r = here(env={**bash, "COMP_CWORD": "2", "COMP_WORDS": "ridgefill verify --qu"})
    assert r.returncode == 0 and r.stdout.split() == ["--quiet"]


def test_every_command_takes_quiet():
    import typer

    from ridgefill.cli import app

    def leaves(cmd, path=()):
        for name, sub in cmd.commands.items():
            yield from leaves(sub, path + (name,)) if hasattr(sub, "commands") else [(path + (name,), sub)]

    found = dict(leaves(typer.main.get_command(app)))
    assert {"capture", "solve", "export", "verify", "push", "pull", "eval", "fold"} <= {p[-1] for p in found}
    for path, cmd in found.items():
        opts = [o for p in cmd.params for o in getattr(p, "opts", [])]
        assert "-q" in opts and "--quiet" in opts, path


def tiny_release(folder) -> None:
    from ridgefill.formats import int8, release

    rng = np.random.default_rng(0)
    codes, bits = int8.quantize((rng.standard_normal((32, 32)) * 0.05).astype(np.float32))
    maps = {3: {"codes": codes, "scale_bits": bits, "bias": np.zeros(32, np.float32)}}
    manifest = {"model": {"name": "tiny", "architecture": "llama", "num_layers": 4, "hidden_size": 32,
                          "num_kv_heads": 2, "head_dim": 8, "fingerprint": "0" * 64}, "split": 3, "tail_default": 8,
                "layers": [{"index": 3, "kind": "attention", "map": "input"}],
                "fit": {"exact_norm": 812.5, "skip_first_rows": 1}}
    release.write_release(folder, maps, manifest, "# card\n")


def defaults_as_written(function) -> dict[str, str]:
    """{parameter: its default as written in the source} of a function (a command: the one under its decorator)."""
    import ast
    import inspect
    import textwrap

    args = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function)))).body[0].args
    positional = args.posonlyargs + args.args
    written = {a.arg: ast.unparse(d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    return written | {a.arg: ast.unparse(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}


def test_option_defaults_are_their_configs():
    """Each `capture` / `eval` / `sweep` / `solve` option that names a setting defaults to the setting's value in
    CaptureConfig / EvalConfig / SweepConfig / SolveConfig, written as `D.<setting>` (D: the command's config instance), not as a literal (one
    place per default; a literal in the command would drift from the config the recipe and the benches use). A list
    option defaults to None and falls back on the config's tuple in the command's body. capture's two defaults that
    are no setting come from capture/config.py in the command and in the stage alike: the data, its constant; the
    checkpoint interval, None, its default rule (config.checkpoint_due: CHECKPOINT_EVERY, stretched where writing a
    checkpoint takes long)."""
    import dataclasses
    import inspect

    from ridgefill.capture import run as capture_stage
    from ridgefill.capture.config import CaptureConfig
    from ridgefill.cli.capture import capture
    from ridgefill.cli.eval import eval_
    from ridgefill.cli.solve import solve
    from ridgefill.cli.sweep import sweep
    from ridgefill.evaluate.config import EvalConfig
    from ridgefill.solve.config import SolveConfig
    from ridgefill.sweep.config import SweepConfig

    for command, config in ((capture, CaptureConfig()), (eval_, EvalConfig()), (sweep, SweepConfig()),
                            (solve, SolveConfig())):
        params, written = inspect.signature(inspect.unwrap(command)).parameters, defaults_as_written(command)
        named = [f.name for f in dataclasses.fields(config) if f.name in params]
        assert named, command
        for name in named:
            value = getattr(config, name)
            if isinstance(value, tuple):  # a list option: None, and the config's tuple in the body
                assert params[name].default is None, (command.__name__, name)
            else:
                assert written[name] == f"D.{name}", (command.__name__, name, written[name])
                assert params[name].default == value, (command.__name__, name)
    # every other capture option is one of these three (--split fills CaptureConfig's splits)
    capture_options = set(inspect.signature(inspect.unwrap(capture)).parameters) - {"model", "place"}
    settings = {f.name for f in dataclasses.fields(CaptureConfig)}
    assert capture_options - settings == {"data", "split", "checkpoint_every"}
    body = inspect.getsource(inspect.unwrap(capture))
    assert "tuple(split or D.splits)" in body and "list(data or DEFAULT_DATA)" in body
    assert defaults_as_written(capture)["checkpoint_every"] == defaults_as_written(capture_stage.capture)[
        "checkpoint_every"] == "None"
    assert "Default: {CHECKPOINT_EVERY:g}," in inspect.getsource(inspect.unwrap(capture))  # the help says the constant


def test_quiet_silences_info_but_not_the_result(tmp_path):
    tiny_release(tmp_path / "rel")
    loud, quiet = here("verify", tmp_path / "rel", "--json"), here("verify", tmp_path / "rel", "--json", "-q")
    assert loud.returncode == quiet.returncode == 0
    assert "ok" in loud.stderr and quiet.stderr == ""
    assert quiet.stdout == loud.stdout and json.loads(quiet.stdout)["ok"] is True
    long = here("verify", tmp_path / "rel", "--quiet")
    assert (long.returncode, long.stdout, long.stderr) == (0, "", "")
    # errors still print under -q
    r = here("verify", tmp_path / "missing", "-q")
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and r.stdout == ""
    # and the next command without -q is not quiet (the setting does not leak between runs)
    assert "ok" in here("verify", tmp_path / "rel").stderr


TOKEN = "hf_NotARealTokenButSecret0123456789"


@pytest.mark.parametrize("command", ["pull", "push", "release"])
def test_token_flag_warns_and_is_never_printed(tmp_path, command):
    """--token lands in shell history and `ps`: a warning (also under -q), never the value. The runs stop on bad
    input before any network: pull's --out is a file, push's folder and release's recipe do not exist."""
    (tmp_path / "afile").write_text("x")
    args = {"pull": ["pull", "owner/name", "--out", tmp_path / "afile"],
            "push": ["push", tmp_path / "missing", "--repo", "owner/name"],
            "release": ["release", tmp_path / "missing.toml", "--push"]}[command]
    for extra in ([], ["-q"]):
        r = here(*args, "--token", TOKEN, *extra)
        assert r.returncode == 2, r.stderr
        warning, error = r.stderr.splitlines()
        assert warning.startswith("Warning: ") and "--token" in warning and "shell history" in warning
        assert "HF_TOKEN" in warning and "hf auth login" in warning
        assert error.startswith("Error: ")
        assert TOKEN not in r.stdout + r.stderr and TOKEN[3:12] not in r.stdout + r.stderr
    r = here(*args, env={"HF_TOKEN": TOKEN})  # the environment is the recommended way: no warning
    assert r.returncode == 2 and "Warning" not in r.stderr and TOKEN not in r.stderr


def test_usage_error_exits_2():
    r = cli("capture")
    assert r.returncode == 2
    assert "Missing argument" in r.stderr


def test_unknown_builtin_is_bad_input(tmp_path):
    r = cli("capture", "builtin:nope", "--store", tmp_path)
    assert r.returncode == 2
    # one line naming the problem and the built-ins there are; nothing written
    assert r.stderr == ("Error: unknown built-in model 'builtin:nope' (known: builtin:smollm2-135m, "
                        "builtin:gemma3-270m, builtin:qwen2.5-coder-1.5b)\n")
    assert r.stdout == "" and not any(tmp_path.iterdir())


def test_debug_shows_traceback(tmp_path):
    r = cli("capture", tmp_path / "missing", "--store", tmp_path, "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.fixture(scope="module")
def store_with_capture(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "d.txt").write_text("one two three four five six seven eight nine ten. " * 20)
    (tmp / "e.txt").write_text("alpha beta gamma delta epsilon zeta eta theta. " * 20)
    (tmp / "f.txt").write_text("print('hello')\nx = 1\n" * 30)
    store = tmp / "store"
    r = cli("capture", tiny_llama, "--data", tmp / "d.txt", "--data", tmp / "e.txt", "--data", tmp / "f.txt",
            "--split", 2, "--held-out", 1, "--chunk", 64, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["stage"] == "capture" and doc["cached"] is False
    return store, doc["id"], tmp


def test_capture_rerun_is_cached_and_stdout_is_the_id(store_with_capture, tiny_llama):
    store, cid, tmp = store_with_capture
    r = cli("capture", tiny_llama, "--data", tmp / "d.txt", "--data", tmp / "e.txt", "--data", tmp / "f.txt",
            "--split", 2, "--held-out", 1, "--chunk", 64, "--store", store)
    assert r.returncode == 0
    assert r.stdout == cid + "\n"
    assert "(cached)" in r.stderr


def test_quiet_capture_rerun_prints_only_the_id(store_with_capture, tiny_llama):
    store, cid, tmp = store_with_capture
    args = ("capture", tiny_llama, "--data", tmp / "d.txt", "--data", tmp / "e.txt", "--data", tmp / "f.txt",
            "--split", 2, "--held-out", 1, "--chunk", 64, "--store", store)
    loud, quiet = here(*args), here(*args, "-q")
    assert loud.returncode == quiet.returncode == 0
    assert "(cached)" in loud.stderr and quiet.stderr == ""
    assert quiet.stdout == loud.stdout == cid + "\n"


def test_artifacts_ls_show_verify_gc(store_with_capture):
    store, cid, _ = store_with_capture
    r = cli("artifacts", "ls", "--store", store, "--json")
    assert [a["id"] for a in json.loads(r.stdout)["artifacts"]] == [cid]
    r = cli("artifacts", "show", cid[:8], "--store", store, "--json")
    assert json.loads(r.stdout)["recipe"]["splits"] == [2]
    assert cli("artifacts", "verify", cid, "--store", store).returncode == 0
    (store / "capture" / ".tmp-deadbeef-1").mkdir()
    stats = store / "capture" / cid / "stats.safetensors"
    good = stats.read_bytes()
    stats.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = cli("artifacts", "verify", "--store", store)
    assert r.returncode == 1 and "stats.safetensors: sha256 mismatch" in r.stderr
    r = cli("artifacts", "gc", "--dry-run", "--store", store, "--json")
    assert sorted(json.loads(r.stdout)["removed"]) == sorted([str(store / "capture" / ".tmp-deadbeef-1"), str(store / "capture" / cid)])
    stats.write_bytes(good)
    r = cli("artifacts", "gc", "--store", store, "--json")
    assert json.loads(r.stdout)["removed"] == [str(store / "capture" / ".tmp-deadbeef-1")]
    assert (store / "capture" / cid).is_dir()


def test_help_shows_the_optional_revision_of_a_hub_name():
    """`[@REV]` in a help text is shown, not read as rich markup and dropped."""
    import os

    env = dict(os.environ, COLUMNS="200")
    for args, want in ((["eval"], "hf://OWNER/NAME[@REV]"), (["verify"], "hf://owner/name[@rev]"),
                       (["push"], "hf://OWNER/NAME[@REV]"), (["engine", "prefix"], "hf://OWNER/NAME[@REV]"),
                       (["capture"], "a hub id OWNER/NAME[@REV]")):  # fmt: skip
        r = cli(*args, "--help", env=env)
        assert r.returncode == 0 and want in r.stdout, (args, r.stdout)
