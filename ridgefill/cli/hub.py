"""`ridgefill push DIR --repo OWNER/NAME` and `ridgefill pull OWNER/NAME[@REV] --out DIR` (Hugging Face Hub). DIR,
as everywhere a release is named, may be a Hub release `hf://OWNER/NAME[@REV]` (hub.releases.locate_release).

Without --json, stdout carries only the commit sha; the commit URL and status go to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import output, warn_token_flag

TokenOpt = Annotated[
    Optional[str],
    typer.Option("--token", show_default=False,
                 help="Hub token (default: HF_TOKEN, else the token saved by `hf auth login`). Never printed; as a flag it "
                      "lands in the shell history and the process list, so prefer HF_TOKEN or `hf auth login`."),
]


def push(
    folder: Annotated[str, typer.Argument(help="Release folder (verified before anything is uploaded), or a Hub "
                                               "release hf://OWNER/NAME\\[@REV] to copy.")],
    repo: Annotated[str, typer.Option("--repo", help="Hub model repo OWNER/NAME (created if missing).")],
    revision: Annotated[str, typer.Option("--revision", help="Branch to commit to (created if missing).")] = "main",
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Commit title.")] = None,
    token: TokenOpt = None,
) -> None:
    """Upload a release folder to the Hub as one commit (no commit if the branch already holds it)."""
    from ridgefill.hub.releases import push as run

    out = output()
    warn_token_flag(out, token)
    res = run(folder, repo, revision=revision, private=private, commit_message=commit_message, token=token, out=out)
    out.result(res, primary=res["commit"])


def pull(
    spec: Annotated[str, typer.Argument(metavar="OWNER/NAME[@REV]",
                                        help="Hub repo, optionally @branch, tag or commit sha (hf://OWNER/NAME, as RIDGEFILL_RELEASE names it, is the same).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write (created; verified before it appears).")],
    force: Annotated[bool, typer.Option("--force", help="Replace a different release in --out.")] = False,
    token: TokenOpt = None,
) -> None:
    """Download a release from the Hub: ridgefill.json, the files it lists and README.md, verified."""
    from ridgefill.hub.releases import pull as run

    out = output()
    warn_token_flag(out, token)
    res = run(spec, out_dir, token=token, force=force, out=out)
    out.result(res, primary=res["commit"])
