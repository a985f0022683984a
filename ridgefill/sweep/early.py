"""Early layers kept between the sweep's needle passes: the exact forward of a prompt cut at the deepest split a
pass needs (`early_run`), and the early layers of the needle pass's forwards kept on disk for the configuration
pass (`EarlyCaches`), on the CPU where reading them back costs less than running them again.
"""

from __future__ import annotations

import json
from pathlib import Path

KEEP_EARLY_BYTES = 16 << 30  # the most disk the early layers kept between needle passes take (on CPU; see EarlyCaches)


def early_run(lm, ids, splits):
    """The exact forward of `ids` up to the deepest of `splits` only, as an `ExactRun` without logits: its cache
    holds the layers below that split and its states the hidden state entering each split, which is all a fill at
    those splits takes from it (`runtime.prefill_from`). For a prompt whose exact answer is already known."""
    import torch

    from ridgefill.models.hooks import StopForward, layer_inputs
    from ridgefill.runtime import ExactRun
    from transformers import DynamicCache

    ad = lm.adapter
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(ad.device)
    cache = DynamicCache(config=lm.model.config)
    layers = list(ad.layers) + [ad.base.norm]
    with torch.no_grad(), layer_inputs(layers, sorted(splits), stop=True) as seen:
        try:
            lm.model(input_ids=ids[None], use_cache=True, cache=cache, logits_to_keep=1)
        except StopForward:
            pass
    return ExactRun(ids=ids, logits=None, cache=cache, states={s: seen[s][0] for s in splits}, seconds=0.0)


class EarlyCaches:
    """The early layers of needle prompts' exact runs, kept on disk from the first pass over a prompt for the later
    ones (`<work>/early/<prompt>.safetensors`, removed once the configuration pass is done).

    A prompt's first exact forward also keeps the hidden state entering each of `splits` (the splits the
    configuration pass may measure at) and is saved up to the deepest of them: the keys and values of the layers
    below it, and those states. A later pass at some of those splits reads them back instead of running the early
    layers again (`early_run`). On a CPU that is the cheaper way: for a 4K-token SmolLM2 prompt, saving layers 0-21
    and four states (168 MB) costs up to 2 s of CPU (mostly the kernel's fresh pages for the file), reading them
    back 0.05 s, while running 18 layers again costs 5.6 s. The runs read back are the ones saved, so the fills
    built on them are bit-identical. The file is a cache snapshot as capture checkpoints write it
    (`capture.kvstate`, cut at the deepest split) with the states beside it. Only where `keeps_early` (the model
    on the CPU, a cache of keys and values alone) and within `limit` bytes (and half the free disk); a prompt not
    kept is run again, as before."""

    def __init__(self, work, lm, splits, limit: int):
        import shutil

        self.dir, self.lm = Path(work) / "early", lm
        self.splits = tuple(sorted(splits))
        self.depth = max(self.splits, default=0)
        here = next(p for p in (self.dir, *self.dir.parents) if p.exists())
        self.limit = min(limit, shutil.disk_usage(here).free // 2) if self.splits else 0
        self.used = sum(p.stat().st_size for p in self.dir.glob("*.safetensors")) if self.dir.is_dir() else 0

    def _path(self, i: int) -> Path:
        return self.dir / f"{i}.safetensors"

    def save(self, i: int, run) -> bool:
        """Keep prompt i's run (an exact run holding the states entering `splits`); False where it is not kept."""
        from ridgefill.capture import kvstate
        from ridgefill.formats import safetensors

        if not self.splits or self._path(i).is_file():
            return False
        try:
            snap = kvstate.snapshot(run.cache, layers=self.depth)
        except kvstate.NotSaved:
            return False
        tensors = snap.tensors | {f"state.{s}": kvstate.lazy(run.states[s]) for s in self.splits}
        size = sum(t.nbytes for t in tensors.values())
        if self.used + size > self.limit:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        layout = json.dumps(snap.layout, separators=(",", ":"), sort_keys=True)
        safetensors.save_streamed(self._path(i), tensors, {"cache": layout})  # (via a temporary file)
        self.used += size
        return True

    def load(self, i: int, ids, splits):
        """Prompt i's early layers as an `ExactRun` without logits (as `early_run` gives), for fills at `splits`;
        None where they were not kept."""
        import torch
        from transformers import DynamicCache

        from ridgefill.capture import kvstate
        from ridgefill.formats import safetensors
        from ridgefill.runtime import ExactRun

        if not self.splits or not set(splits) <= set(self.splits) or not self._path(i).is_file():
            return None
        f, ad = safetensors.LazyFile(self._path(i)), self.lm.adapter
        snap = kvstate.Snapshot(json.loads(f.metadata["cache"]),
                                {n: f.lazy(n) for n in f.names if n.startswith(kvstate.PREFIX)})
        cache = kvstate.restore(self.lm, snap, lambda: DynamicCache(config=self.lm.model.config), str(self.dir))
        states = {s: kvstate.tensor(f[f"state.{s}"], ad.layer_device(s)) for s in splits}
        return ExactRun(ids=torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(ad.device), logits=None, cache=cache,
                        states=states, seconds=0.0)

    def clear(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        self.used = 0


def keeps_early(lm) -> bool:
    """Whether the sweep keeps early layers on disk (EarlyCaches): a cache of keys and values alone, every layer on
    the CPU, where reading them back costs far less than running them again (an accelerator runs them faster than
    a disk gives them back)."""
    ad = lm.adapter
    return attention_only(lm) and all(ad.layer_device(l).type == "cpu" for l in range(ad.num_layers))


def attention_only(lm) -> bool:
    """A model whose cache is keys and values alone (no recurrent states), which `early_run` can cut."""
    from ridgefill.models.kinds import FULL, SLIDING

    return set(lm.adapter.layer_kinds) <= {FULL, SLIDING}
