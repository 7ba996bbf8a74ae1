"""``upload``: a complete, verified DST to the Hub."""
from __future__ import annotations

import os
import sys

import click

from ..errors import ConvertError
from .params import fail


@click.command("upload")
@click.argument("dst", type=click.Path())
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private (an existing one keeps its visibility).")
@click.option("--revision", default=None, help="Branch to upload to (created if missing) [default: main].")
@click.option("--dry-run", is_flag=True, help="List the files and bytes that would be sent; no network, no writes.")
@click.option("--token", default=None, help="Hub token [default: the one saved by `hf auth login` / HF_TOKEN].")
@click.option("--verify-checksums", is_flag=True,
              help="With --dry-run: also re-hash every shard against the manifest (an upload always does).")
@click.option("--base-model", default=None, help="Base model named in the model card [default: from the source].")
@click.option("--delete-stale", is_flag=True,
              help="Delete the repository's other weight files (*.safetensors, *.bin, *.pt, *.gguf, *.index.json, "
                   "... that this upload does not write) in the same commit [default: refuse to upload beside them].")
def upload_cmd(dst, repo_id, private, revision, dry_run, token, verify_checksums, base_model, delete_stale) -> None:
    """Upload a complete, verified DST to the Hub as REPO_ID, with a model card (README.md) if it has none.

    The repo id, the token (it must be able to write to REPO_ID) and the repository (no other weight
    files in it, unless --delete-stale) are checked first; every file is checked against the
    manifest as it is read, and what is committed is those bytes. Resumable: run the same command
    again after an interruption. Exit codes: 0 done, 2 bad input, token or repository, 4 the Hub out
    of reach or DST locked, 5 DST fails verification (or changed), 130 interrupted, 1 other (a Hub error)."""
    from ..hub.card import card_preview
    from ..hub.upload import upload

    if os.path.isdir(dst):   # the first line at once: verify and the Hub take a while (a missing DST: one error)
        click.echo(f"upload {dst} -> {repo_id}: verifying DST, then "
                   + ("listing what would be sent…" if dry_run else "sending it…"))
    try:
        res = upload(dst, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                     verify_checksums=verify_checksums, base=base_model, delete_stale=delete_stale)
    except ConvertError as e:
        fail(e)
    except KeyboardInterrupt:  # T15: as README's exit codes say, not click's "Aborted!" (exit 1)
        click.echo("k3convert: interrupted; run the same command again to resume", err=True)
        sys.exit(130)
    if dry_run:
        for path, size in res.files:
            click.echo(f"{size:>16,d}  {path}")
    click.echo(f"README.md: {res.readme}" + (card_preview(res.card) if dry_run and res.card else ""))
    verb = "would upload" if dry_run else f"uploaded with HfApi.{res.method}"
    click.echo(f"{verb} {len(res.files)} files, {res.total_bytes / 1e9:.3f} GB -> {repo_id}"
               + (f" (revision {revision})" if revision else ""))
    for note in res.notes:
        click.echo(f"note: {note}")
