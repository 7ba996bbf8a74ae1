"""What ``upload`` publishes from a DST: our card, never the source's (stating the config's own
activation); exactly the files ``verify`` accepted; no temporary, however old its name; no folder
linked from outside DST; and no FIFO opened for the source's card.

Each test is named for its defect in docs/reliability.md (D6, D14, D27, R15) or the review of the fixes
that found it; each failed before its fix. The Hub is the recording stand-in (no network).
"""
from __future__ import annotations

import os
import shutil

import pytest
from dst_helpers import convert_cli, copy_dst, in_thread, release_fifo
from hub_standin import RecordingApi

from converter.errors import VerifyFailed
from converter.hub.upload import model_card, upload, upload_files
from converter.state.files import MANIFEST
from converter.state.records import write_json
from converter.verify import verify
from tests.conftest import chunked_sha256, read_json, shard_names


def test_d6_card_states_the_configs_activation(converted, tmp_path):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    card = model_card(dst)
    assert "SiTU" in card and "activation_situ_beta" in card
    m = read_json(os.path.join(dst, MANIFEST))
    m["activation"] = {"hidden_act": "silu"}
    write_json(os.path.join(dst, MANIFEST), m)
    card = model_card(dst)
    assert "SiTU" not in card and "situ" not in card.lower().replace("situation", "")
    assert "`hidden_act: silu`" in card and "Expert activation: silu" in card


def test_d14_source_readme_is_never_published_as_ours(src_copy, tmp_path):
    """SRC's README.md (the MXFP4 model's card) is kept as README.source.md; upload writes and
    sends our card as README.md. A DST made before, holding the source's card as README.md,
    gets our card too, the source's moved aside."""
    theirs = "---\nlicense: other\n---\n# Kimi K3 (MXFP4)\n"
    with open(os.path.join(src_copy, "README.md"), "w") as f:
        f.write(theirs)
    dst = str(tmp_path / "dst")
    assert convert_cli(src_copy, dst).exit_code == 0
    assert not os.path.exists(os.path.join(dst, "README.md"))
    with open(os.path.join(dst, "README.source.md")) as f:
        assert f.read() == theirs
    for case in ("converted now", "converted before"):
        if case == "converted before":
            os.replace(os.path.join(dst, "README.source.md"), os.path.join(dst, "README.md"))
            shutil.copy(os.path.join(src_copy, "README.md"), os.path.join(dst, "README.md"))
        api = RecordingApi()
        res = upload(dst, "someone/k3-int4", api=api)
        assert res.readme == "written", case
        with open(os.path.join(dst, "README.md")) as f:
            card = f.read()
        assert card != theirs and "int4" in card and "README.source.md" in card, case
        with open(os.path.join(dst, "README.source.md")) as f:
            assert f.read() == theirs
        assert api.committed["README.md"] == card.encode()
        os.unlink(os.path.join(dst, "README.md"))


def test_d27_upload_refuses_folder_symlinks(converted, tmp_path):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the Hub")
    os.symlink(outside, os.path.join(dst, "extra"))
    with pytest.raises(VerifyFailed) as e:
        upload(dst, "someone/k3-int4", dry_run=True)
    assert "extra is a symlink" in str(e.value)


def test_upload_leaves_out_every_temporary_plan_calls_ours(converted, tmp_path):
    """A bare ``.tmp`` (older versions' temporaries) is left out like ``.tmpPID``: the listing
    and what is committed both follow plan.TEMPORARY."""
    from converter.run.plan import TEMPORARY as OURS

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    os.makedirs(os.path.join(dst, "sub"))
    left = ["config.json.tmp", "config.json.tmp77", "sub/x.json.tmp", "a[1].tmp", "s.safetensors.partial"]
    for rel in left + ["sub/keep.tmp.json"]:
        open(os.path.join(dst, rel), "wb").close()
    m = read_json(os.path.join(dst, MANIFEST))  # a side file of that name: named by the manifest, so sent
    m["files"]["sub/keep.tmp.json"] = {"bytes": 0, "digest": chunked_sha256(os.path.join(dst, "sub/keep.tmp.json"))}
    write_json(os.path.join(dst, MANIFEST), m)
    assert all(OURS.search(p) for p in left)
    sent = [p for p, _ in upload_files(dst)]
    assert "sub/keep.tmp.json" in sent and not set(left) & set(sent), sent
    api = RecordingApi()
    upload(dst, "someone/k3-int4", api=api)
    kept = sorted(api.committed)
    assert "sub/keep.tmp.json" in kept and not set(left) & set(kept), kept


def test_upload_never_waits_on_a_fifo_for_the_source_card(converted, tmp_path):
    """The manifest's source path is untrusted: a FIFO as its README.md is not opened for reading."""
    dst, src = str(tmp_path / "dst"), str(tmp_path / "src")
    shutil.copytree(converted.dst, dst)
    os.makedirs(src)
    os.mkfifo(os.path.join(src, "README.md"))
    m = read_json(os.path.join(dst, MANIFEST))
    m["source"]["path"] = src
    write_json(os.path.join(dst, MANIFEST), m)
    with open(os.path.join(dst, "README.md"), "w") as f:
        f.write("# mine\n")
    res = in_thread(
        lambda: upload(dst, "someone/k3-int4", api=RecordingApi()), 10, release_fifo(os.path.join(src, "README.md"))
    )
    assert res.readme == "kept"


def test_r15_upload_sends_exactly_the_files_verify_accepted(converted, tmp_path):
    """Temporaries are named by verify (not part of the output) and never sent; every other file
    sent is one verify accepted, and each accepted one is sent."""
    dst = copy_dst(converted, tmp_path)
    for rel in ("config.json.tmp4242", shard_names(dst)[1] + ".partial"):
        open(os.path.join(dst, rel), "wb").close()
    accepted = verify(dst, checksums=False)
    assert accepted.ok, accepted.problems
    api = RecordingApi()
    res = upload(dst, "someone/k3-int4", api=api)
    sent = sorted(api.committed)
    assert sent == sorted(accepted.files + ["README.md"]) == sorted(p for p, _ in res.files)
