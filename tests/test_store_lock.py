"""Two processes building the same artifact into one store: one builds, the other waits and finds the cache hit;
what a killed build leaves is cleaned by the next build of the same id and by gc, never a live build's."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from ridgefill.artifacts import Store, recipe_id
from clirun import cli

RECIPE = {"stage": "capture", "test": "lock"}
RID = recipe_id(RECIPE)

# One stage as the store sees it: a cache miss, then a build that takes `hold` seconds (and touches `started` once
# it is inside the build, holding the lock).
WORKER = """
import sys, time
from pathlib import Path
from ridgefill.artifacts import Store

root, started, hold = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
st = Store(root)
recipe = {"stage": "capture", "test": "lock"}
hit = st.cached("capture", recipe)
if hit is not None:
    print("HIT", hit.id, flush=True)
    sys.exit(0)
with st.build("capture", recipe) as b:
    b.work.mkdir(exist_ok=True)
    (b.work / "state").write_text("resumable")
    (b.path / "data.bin").write_bytes(b"x" * 1000)
    started.with_suffix(".part").write_text(str(b.path))
    started.with_suffix(".part").rename(started)  # whole, or not there
    time.sleep(hold)
    art = b.commit(summary={"built_by": __import__("os").getpid()})
print("BUILT", art.id, flush=True)
"""


def held(path) -> bool:
    """Whether a live process holds an flock on the file (tried without waiting, from this process)."""
    import fcntl

    if not path.exists():
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def start(tmp_path, name, hold):
    flag = tmp_path / f"started-{name}"
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "store"), str(flag), str(hold)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, flag


def wait_for(flag, proc, timeout=20.0):
    t = time.monotonic()
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t < timeout, "the build never started"
        time.sleep(0.02)
    return flag.read_text()


def test_two_processes_one_build(tmp_path):
    """Started at once: exactly one builds; the other says it waits for that pid on this host, then reports the
    cache hit; both exit 0 and the artifact verifies."""
    a, _ = start(tmp_path, "a", 1.5)
    b, _ = start(tmp_path, "b", 1.5)
    outs = {p.pid: p.communicate(timeout=60) + (p.returncode,) for p in (a, b)}
    assert [rc for _, _, rc in outs.values()] == [0, 0], outs
    kinds = sorted(o.split()[0] for o, _, _ in outs.values())
    assert kinds == ["BUILT", "HIT"], outs
    builder = next(pid for pid, (o, _, _) in outs.items() if o.startswith("BUILT"))
    waiter = next(pid for pid in outs if pid != builder)
    assert {o.split()[1] for o, _, _ in outs.values()} == {RID}
    err = outs[waiter][1]
    assert f"ridgefill: capture/{RID} is being built by pid {builder} on {socket.gethostname()} (since " in err
    assert err.count("waiting for it to finish") == 1, err
    st = Store(tmp_path / "store")
    art = st.get(RID)
    assert st.problems(art) == [] and art.manifest["summary"]["built_by"] == builder
    assert sorted(p.name for p in (tmp_path / "store" / "capture").iterdir()) == [RID]  # no lock, tmp or work left


def killed_build(tmp_path, name) -> str:
    """A build killed with SIGKILL while it holds the lock; returns its temporary folder."""
    p, flag = start(tmp_path, name, 60)
    tmp = wait_for(flag, p)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=20)
    return tmp


def test_killed_build_is_cleaned_by_the_next_build_of_the_same_id(tmp_path):
    tmp = killed_build(tmp_path, "a")
    d = tmp_path / "store" / "capture"
    assert os.path.isdir(tmp) and (d / f".lock-{RID}").is_file() and (d / f".work-{RID}").is_dir()
    assert not held(d / f".lock-{RID}")  # the kernel let go of the dead process's lock
    st = Store(tmp_path / "store")
    assert st.cached("capture", RECIPE) is None
    with st.build("capture", RECIPE) as b:
        assert not os.path.exists(tmp)  # a killed run's folder for this id is gone before the build starts
        assert (b.work / "state").read_text() == "resumable"  # its resumable state is not
        art = b.commit()
    assert sorted(p.name for p in d.iterdir()) == [RID] and st.problems(art) == []


def test_gc_removes_what_killed_builds_left(tmp_path):
    tmp = killed_build(tmp_path, "a")
    d = tmp_path / "store" / "capture"
    st = Store(tmp_path / "store")
    assert sorted(map(str, st.gc(dry_run=True))) == sorted([tmp, str(d / f".lock-{RID}")])
    assert os.path.isdir(tmp) and (d / f".lock-{RID}").is_file()  # dry run: nothing removed
    r = cli("artifacts", "gc", "--work", "--store", tmp_path / "store", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["removed"]) == sorted([tmp, str(d / f".lock-{RID}"), str(d / f".work-{RID}")])
    assert list(d.iterdir()) == []


def test_gc_leaves_a_live_build_alone(tmp_path):
    p, flag = start(tmp_path, "a", 60)
    try:
        tmp = wait_for(flag, p)
        d = tmp_path / "store" / "capture"
        assert Store(tmp_path / "store").gc(include_work=True) == []
        assert os.path.isdir(tmp) and (d / f".work-{RID}").is_dir()
        kept = []
        assert Store(tmp_path / "store").gc(include_work=True, kept=kept) == []
        assert sorted(str(k) for k, _ in kept) == sorted([tmp, str(d / f".work-{RID}")])
        assert {h["pid"] for _, h in kept} == {p.pid}
        r = cli("artifacts", "gc", "--work", "--store", tmp_path / "store")
        assert r.returncode == 0 and f"kept {tmp}: pid {p.pid} on {socket.gethostname()}" in r.stderr, r.stderr
        assert os.path.isdir(tmp) and (d / f".work-{RID}").is_dir() and held(d / f".lock-{RID}")
    finally:
        p.kill()
        p.wait(timeout=20)


def test_two_capture_commands_at_once(tmp_path, tiny_llama):
    """The real CLI on a tiny model: two `ridgefill capture` into one store at the same time both exit 0 with the
    same id, one of them from the cache."""
    (tmp_path / "d.txt").write_text("one two three four five six seven eight nine ten. " * 20)
    (tmp_path / "e.txt").write_text("alpha beta gamma delta epsilon zeta eta theta. " * 20)
    args = [sys.executable, "-m", "ridgefill", "capture", str(tiny_llama), "--data", str(tmp_path / "d.txt"),
            "--data", str(tmp_path / "e.txt"), "--split", "2", "--held-out", "1", "--chunk", "32",
            "--checkpoint-every", "0", "--store", str(tmp_path / "store"), "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert [rc for _, _, rc in outs] == [0, 0], [e for _, e, _ in outs]
    docs = [json.loads(o) for o, _, _ in outs]
    assert docs[0]["id"] == docs[1]["id"]
    assert sorted(d["cached"] for d in docs) == [False, True]
    assert "(cached)" in outs[[d["cached"] for d in docs].index(True)][1]
    st = Store(tmp_path / "store")
    assert st.problems(st.get(docs[0]["id"])) == []
    assert sorted(p.name for p in (tmp_path / "store" / "capture").iterdir()) == [docs[0]["id"]]


def test_a_run_refused_after_its_cache_miss_leaves_nothing(tmp_path):
    """A stage that fails between its cache miss (which takes the lock) and its build, e.g. on bad input found
    late: the process lets go at exit, and neither a lock file nor an empty stage folder stays behind."""
    code = ("import sys\nfrom ridgefill.artifacts import Store\n"
            "st = Store(sys.argv[1])\nassert st.cached('capture', {'stage': 'capture', 'test': 'lock'}) is None\n"
            "raise SystemExit(2)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert not (tmp_path / "store").exists()
    a, _ = start(tmp_path, "a", 0)  # and the next run builds without waiting
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0 and out.split() == ["BUILT", RID] and "waiting" not in err


def test_a_command_that_fails_after_its_cache_miss_lets_go_of_the_lock(tmp_path, tiny_llama):
    """In-process (as a notebook or a test runs commands): `solve` on a capture whose file was damaged fails after
    its cache miss took the solve's lock; once the command is over nothing holds it, so another process would not
    wait for it forever."""
    from clirun import cli_here
    from ridgefill.models import resolve_model

    st = Store(tmp_path / "store")
    ref = resolve_model(str(tiny_llama), store_root=st.root)
    with st.build("capture", {"stage": "capture", "model": ref.fingerprint, "splits": [2]}) as b:
        (b.path / "stats.safetensors").write_bytes(b"x" * 10)
        cap = b.commit(info={"model_spec": str(tiny_llama), "model": {"name": ref.name, "revision": None}})
    (cap.path / "stats.safetensors").write_bytes(b"y" * 10)
    r = cli_here("solve", cap.id, "--store", st.root)
    assert r.returncode == 1 and "stats.safetensors: sha256 mismatch" in r.stderr, r.stderr
    assert list(st.root.glob("*/.lock-*")) == [] and not (st.root / "solve").exists()  # nothing written
