"""Untrusted names (issue 8 §5): nothing outside SRC is read, nothing outside DST is written.

Shard names in the index, tensor names and the files of SRC (symlinks included) come from
whoever made the checkpoint; a DST left by an earlier run may hold planted links. Each test
builds a sentinel tree beside SRC and DST (``outside/``, plus the file a ``../`` name reaches),
runs the CLI in this process and checks three things besides the exit and message:

* the sentinel tree is unchanged, entry for entry (no new, changed or removed file, dir or link);
* no file under the test's directory outside SRC and DST was opened, listed, created, renamed
  or removed, as Python's audit hooks (PEP 578: ``open``, ``os.scandir``, ``shutil.copyfile``,
  ``os.rename``, ...) saw it, with links resolved at the moment of the call;
* SRC is unchanged and nothing in it was opened for writing.

Decisions pinned here: a link inside SRC that resolves outside SRC is refused (exit 2), except a
Hugging Face cache snapshot's links into its own repository's ``blobs/``; a symlinked folder
inside SRC is not followed (its files are not copied, see test_symlinked_folder_not_followed);
``-o`` may be a symlink to a directory (the output goes to the directory it points to, as for
any path; it is refused only when it resolves into SRC, or SRC into it); planted links in a DST
are never written through: a stale one is replaced, a symlinked ``.k3convert`` or lock file is
refused (exit 4).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from contextlib import contextmanager

import pytest
import torch

from converter.errors import BadInput, OutputError
from converter.formats.safetensors_io import Layout, OutTensor, ShardWriter
from converter.state.files import STATE_DIR
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    assert_clean_error,
    assert_not_complete,
    ct_mxfp4_encode,
    load_shard,
    read_json,
    rewrite_shard,
    run_cli,
    sha256,
    shard_names,
    sync_index,
    tree_hash,
    write_json,
)

BAD, OUT = BadInput.exit_code, OutputError.exit_code

# ------------------------------------------------------------------ what the tool touches

_FOLLOW = {"open", "os.scandir", "os.listdir", "shutil.copyfile", "os.truncate", "os.chmod", "os.utime"}
_ENTRY = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_log: list[tuple[str, str, bool]] | None = None  # (event, resolved path, writes) while watching


def _resolve(p: object, follow: bool) -> str | None:
    if not isinstance(p, (str, bytes, os.PathLike)):
        return None  # a file descriptor: its open was seen already
    p = os.path.abspath(os.fsdecode(p))
    if follow:
        return os.path.realpath(p)
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))


def _audit(event: str, args: tuple) -> None:
    """Record file system calls, resolving links now (a planted link may be gone afterwards)."""
    if _log is None or (event not in _FOLLOW and event not in _ENTRY):
        return
    if event == "open":
        flags = args[2] if isinstance(args[2], int) else 0
        no_follow = flags & os.O_NOFOLLOW or (flags & os.O_CREAT and flags & os.O_EXCL)
        _log.append((event, _resolve(args[0], not no_follow), bool(flags & _WRITE_FLAGS)))
    elif event == "shutil.copyfile":
        _log.append((event, _resolve(args[0], True), False))
        _log.append((event, _resolve(args[1], True), True))
    elif event in ("os.rename", "os.link"):
        _log.append((event, _resolve(args[0], False), True))
        _log.append((event, _resolve(args[1], False), True))
    elif event == "os.symlink":
        _log.append((event, _resolve(args[1], False), True))
    else:
        _log.append((event, _resolve(args[0] if args else None, event in _FOLLOW),
                     event not in ("os.scandir", "os.listdir")))


sys.addaudithook(_audit)  # permanent once added; a no-op outside watching()


@contextmanager
def watching():
    global _log
    _log = []
    try:
        yield _log
    finally:
        _log = None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def entries(root: str) -> dict[str, str]:
    """Every entry under root (not following links): relpath -> 'dir', 'link:TARGET' or content sha256."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            out[rel] = ("link:" + os.readlink(p) if stat.S_ISLNK(st.st_mode) else
                        "dir" if stat.S_ISDIR(st.st_mode) else sha256(p))
    return out


class Scene:
    """SRC, DST and a sentinel tree beside them; ``run`` watches one CLI call."""

    def __init__(self, area, src: str, dst: str | None = None):
        self.area = os.path.realpath(str(area))
        self.src, self.dst = src, dst or os.path.join(self.area, "dst")
        self.outside = os.path.join(self.area, "outside")
        os.makedirs(os.path.join(self.outside, "dir"), exist_ok=True)
        for rel, text in {"secret.txt": "do not read\n", ".hidden": "nor this\n", "target.bin": "precious\n",
                          "dir/tokenizer.json": '{"outside": true}\n'}.items():
            with open(os.path.join(self.outside, rel), "w") as f:
                f.write(text)
        self.log: list = []

    def shard_copy_at(self, path: str, shard: str | None = None) -> str:
        """A valid shard (a byte copy of one of SRC's) at ``path``: what a vulnerable tool would read."""
        shard = shard or shard_names(self.src)[0]
        shutil.copyfile(os.path.join(self.src, shard), path)
        return path

    def _area_except(self) -> dict[str, str]:
        inner = {os.path.realpath(self.src), os.path.realpath(self.dst)}
        return {k: v for k, v in entries(self.area).items()
                if not any(_within(os.path.join(self.area, k), r) for r in inner)}

    def run(self, *args: str):
        """``k3convert ARGS`` (SRC and DST as named by the caller), recording what it touches."""
        self._before, self._src_before = self._area_except(), tree_hash(self.src)
        with watching() as log:
            result = run_cli(*args)
        self.log = list(log)
        return result

    def convert(self, *extra: str):
        return self.run("mxfp4-to-int4", self.src, "-o", self.dst, "--progress", "none", *extra)

    def assert_contained(self) -> None:
        """Sentinels unchanged; nothing outside SRC/DST touched; nothing in SRC written; SRC unchanged."""
        now = self._area_except()
        changed = sorted(k for k in now.keys() | self._before.keys() if now.get(k) != self._before.get(k))
        assert not changed, f"changed outside SRC and DST: {changed}"
        roots = [os.path.realpath(self.src), os.path.realpath(self.dst), _resolve(self.dst, False),
                 *self.extra_roots()]
        srcs = [os.path.realpath(self.src)] + self.extra_roots()
        strays = [(e, p) for e, p, _ in self.log if p and _within(p, self.area) and not any(_within(p, r) for r in roots)]
        assert not strays, f"touched outside SRC/DST: {strays}"
        written = [(e, p) for e, p, w in self.log if w and p and any(_within(p, r) for r in srcs)]
        assert not written, f"wrote into SRC: {written}"
        assert tree_hash(self.src) == self._src_before, "source modified"

    def extra_roots(self) -> list[str]:
        return []

    def read(self, path: str) -> bool:
        """Whether the last run opened ``path`` (resolved)."""
        return any(e == "open" and p == os.path.realpath(path) for e, p, _ in self.log)


def outputs(root: str) -> dict[str, str]:
    """Content hashes of a conversion's output files: shards, config, index, side files, table."""
    return {k: v for k, v in tree_hash(root).items()
            if k not in (MANIFEST, REPORT) and not k.startswith(STATE_DIR + os.sep)}


def assert_plain_tree(root: str) -> None:
    """No symlink anywhere in root and no file with another name elsewhere (hard link)."""
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            assert not stat.S_ISLNK(st.st_mode), f"{os.path.join(d, name)} is a symlink"
            assert stat.S_ISDIR(st.st_mode) or st.st_nlink == 1, f"{os.path.join(d, name)} has other names"


def assert_complete_like(dst: str, reference: str) -> None:
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is True
    assert outputs(dst) == outputs(reference)
    assert_plain_tree(dst)


def redirect_shard(src: str, name: object, shard: str) -> None:
    """Point every index entry of ``shard`` at ``name``."""
    path = os.path.join(src, INDEX)
    index = read_json(path)
    assert shard in index["weight_map"].values()
    index["weight_map"] = {t: (name if s == shard else s) for t, s in index["weight_map"].items()}
    write_json(path, index)


# ------------------------------------------------------------------ shard names in the index



@pytest.mark.parametrize("name, plant", [
    ("../evil.safetensors", "{area}/evil.safetensors"),
    ("{area}/outside/evil.safetensors", "{area}/outside/evil.safetensors"),
    ("sub/dir.safetensors", "{src}/sub/dir.safetensors"),
    ("..", None),
    (".", None),
    ("", None),
    (".hidden.safetensors", "{src}/.hidden.safetensors"),
    ("evil\0.safetensors", None),
    ("..\\evil.safetensors", "{src}/..\\evil.safetensors"),
    ("evil\n.safetensors", "{src}/evil\n.safetensors"),
    ("\ud800.safetensors", None),
    (7, None),
    (None, None),
    (["model-00001-of-00003.safetensors"], None),
    ({"a": 1}, None),
], ids=["dotdot", "absolute", "subdir", "parent", "dot", "empty", "hidden", "nul", "backslash", "newline",
        "surrogate", "number", "null", "list", "object"])
def test_index_shard_name_refused(src_copy, tmp_path, name, plant):
    scene = Scene(tmp_path, src_copy)
    shard = shard_names(src_copy)[0]
    if isinstance(name, str):
        name = name.format(area=scene.area)
    if plant:
        plant = plant.format(area=scene.area, src=src_copy)
        os.makedirs(os.path.dirname(plant), exist_ok=True)
        scene.shard_copy_at(plant, shard)
    redirect_shard(src_copy, name, shard)
    index = os.path.join(src_copy, INDEX)
    for args in (("mxfp4-to-int4", src_copy, "-o", scene.dst, "--progress", "none"), ("inspect", src_copy)):
        r = scene.run(*args)
        assert_clean_error(r, f"file {index}", repr(name), "plain file name", code=BAD)
        assert not os.path.exists(scene.dst)
        scene.assert_contained()
        if plant:
            assert not scene.read(plant)


# ------------------------------------------------------------------ links in SRC

@pytest.mark.parametrize("rel", ["config.json", INDEX, "model-00002-of-00003.safetensors", "chat_template.jinja",
                                 "tokenizer.json"])
def test_link_out_of_src_refused(src_copy, tmp_path, rel):
    """A file of SRC (config, index, shard or side file) that is a symlink to a file outside SRC:
    the target is a valid copy, so a tool that followed the link would convert without a word."""
    scene = Scene(tmp_path, src_copy)
    path = os.path.join(src_copy, rel)
    target = os.path.join(scene.outside, "linked-" + rel)
    if os.path.exists(path):
        shutil.move(path, target)
    else:
        shutil.copyfile(os.path.join(scene.outside, "dir/tokenizer.json"), target)
    os.symlink(os.path.relpath(target, src_copy), path)
    r = scene.convert()
    assert_clean_error(r, f"file {path}", os.path.realpath(target), "outside the checkpoint directory", code=BAD)
    assert not scene.read(target)
    scene.assert_contained()
    assert_not_complete(scene.dst)
    assert not os.path.lexists(os.path.join(scene.dst, rel))


def test_symlinked_folder_out_of_src_is_refused(src_copy, tmp_path):
    """A folder of SRC that is a symlink out of it: refused in one line before anything is written
    (until issue 25 S9 it was skipped without a word); nothing in it is read or copied."""
    scene = Scene(tmp_path, src_copy)
    link = os.path.join(src_copy, "extra")
    os.symlink(os.path.join(scene.outside, "dir"), link)
    scene.shard_copy_at(os.path.join(scene.outside, "dir", "model-00009-of-00009.safetensors"))
    r = scene.convert()
    assert_clean_error(r, f"file {link}: a link to the folder", "outside the checkpoint directory", code=2)
    scene.assert_contained()
    assert not os.path.lexists(os.path.join(scene.dst, "extra"))
    assert_not_complete(scene.dst)


# ------------------------------------------------------------------ Hugging Face cache snapshots

REV = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(root: str, files_from: str) -> str:
    """A hub cache as huggingface_hub lays it out: blobs by hash, a snapshot of relative links,
    refs/main naming the revision. Returns the snapshot folder."""
    base = os.path.join(root, "models--org--name")
    snap = os.path.join(base, "snapshots", REV)
    os.makedirs(os.path.join(base, "blobs"))
    os.makedirs(snap)
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(REV)
    for name in sorted(os.listdir(files_from)):
        digest = sha256(os.path.join(files_from, name))
        shutil.copyfile(os.path.join(files_from, name), os.path.join(base, "blobs", digest))
        os.symlink(os.path.join("..", "..", "blobs", digest), os.path.join(snap, name))
    return snap


class HubScene(Scene):
    def extra_roots(self) -> list[str]:
        return [os.path.realpath(os.path.join(self.src, "..", "..", "blobs"))]


def test_hf_cache_snapshot_converts_like_plain_copy(fixture_src, tmp_path, converted):
    from huggingface_hub import scan_cache_dir, snapshot_download

    hub = str(tmp_path / "hub")
    snap = hf_cache(hub, fixture_src)
    # huggingface_hub itself reads it as a clean cache and resolves the snapshot offline
    assert snapshot_download("org/name", cache_dir=hub, local_files_only=True) == snap
    info = scan_cache_dir(hub)
    assert not info.warnings and [r.repo_id for r in info.repos] == ["org/name"]
    scene = HubScene(tmp_path, snap)
    r = scene.convert()
    assert r.exit_code == 0, r.output
    scene.assert_contained()
    assert all(scene.read(os.path.join(snap, s)) for s in shard_names(snap))  # the watch sees the reads
    assert_complete_like(scene.dst, converted.dst)
    ref_report = {k: v for k, v in read_json(os.path.join(converted.dst, REPORT)).items() if k != "source"}
    assert {k: v for k, v in read_json(os.path.join(scene.dst, REPORT)).items() if k != "source"} == ref_report
    digests = {n: s["digest"] for n, s in read_json(os.path.join(converted.dst, MANIFEST))["shards"].items()}
    assert {n: s["digest"] for n, s in read_json(os.path.join(scene.dst, MANIFEST))["shards"].items()} == digests


@pytest.mark.parametrize("how", ["other-repo", "blobs-link"])
def test_hf_cache_link_leaving_the_repo_refused(fixture_src, tmp_path, how):
    """Only the snapshot's own repository's blobs/ is allowed: not another repository's, and not
    a blobs/ that is itself a link elsewhere."""
    hub = str(tmp_path / "hub")
    snap = hf_cache(hub, fixture_src)
    blobs = os.path.join(hub, "models--org--name", "blobs")
    scene = HubScene(tmp_path, snap)
    if how == "other-repo":
        other = os.path.join(hub, "models--evil--repo", "blobs")
        os.makedirs(other)
        link = os.path.join(snap, "config.json")
        target = os.path.join(other, os.path.basename(os.readlink(link)))
        shutil.move(os.path.realpath(link), target)
        os.unlink(link)
        os.symlink(os.path.join("..", "..", "..", "models--evil--repo", "blobs", os.path.basename(target)), link)
    else:
        target = os.path.join(scene.outside, "blobs")
        shutil.move(blobs, target)
        os.symlink(target, blobs)
        link = os.path.join(snap, "config.json")
    r = scene.convert()
    assert_clean_error(r, f"file {link}", "outside the checkpoint directory", code=BAD)
    assert_not_complete(scene.dst)
    if how == "blobs-link":
        scene.extra_roots = lambda: []  # blobs/ now lies in the sentinel area: nothing there may be read
    assert not scene.read(os.path.realpath(link))
    scene.assert_contained()


# ------------------------------------------------------------------ planted links in a DST being resumed

@pytest.fixture(scope="module")
def partial_dst(fixture_src, tmp_path_factory) -> str:
    """DST after a run that converted shard 1 only: the next run continues into it."""
    dst = str(tmp_path_factory.mktemp("partial") / "dst")
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--progress", "none", "--shards", "1")
    assert r.exit_code == 0, r.output
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is False
    return dst


S2 = "model-00002-of-00003.safetensors"


@pytest.mark.parametrize("rel, kind, code", [
    (S2 + ".partial", "symlink", 0),
    (S2 + ".partial", "dangling", 0),
    (S2 + ".partial", "hardlink", 0),
    (S2, "symlink", 0),
    ("config.json", "symlink", 0),
    (INDEX, "dangling", 0),
    ("chat_template.jinja.tmp", "symlink", 0),
    ("chat_template.jinja.tmp", "hardlink", 0),
    ("config.json.tmp{pid}", "symlink", 0),
    (f"{STATE_DIR}/{S2}.done.json.tmp{{pid}}", "dangling", 0),
    (f"{STATE_DIR}/{S2}.lock", "dangling", OUT),
    (STATE_DIR, "moved", OUT),
], ids=["partial-symlink", "partial-dangling", "partial-hardlink", "shard-symlink", "config-symlink",
        "index-dangling", "side-tmp-symlink", "side-tmp-hardlink", "json-tmp-symlink", "state-tmp-dangling",
        "lock-dangling", "state-dir-symlink"])
def test_planted_link_in_dst_not_written_through(fixture_src, partial_dst, tmp_path, converted, rel, kind, code):
    """A DST from an earlier run of the same conversion, with a link planted where the tool
    writes. Stale links are replaced (the conversion completes, the outside file is untouched);
    a symlinked state folder or lock file is refused."""
    scene = Scene(tmp_path, fixture_src)
    shutil.copytree(partial_dst, scene.dst, symlinks=True)
    path = os.path.join(scene.dst, rel.format(pid=os.getpid()))
    target = os.path.join(scene.outside, "target.bin" if kind != "dangling" else "created.bin")
    if kind == "moved":
        target = os.path.join(scene.outside, "state")
        shutil.move(path, target)
    if os.path.lexists(path):
        os.unlink(path)
    os.link(target, path) if kind == "hardlink" else os.symlink(target, path)
    r = scene.convert()
    scene.assert_contained()
    if code:
        assert_clean_error(r, f"file {scene.dst}" if kind == "moved" else f"file {path}", code=code)
        assert_not_complete(scene.dst)
    else:
        assert r.exit_code == 0, r.output
        assert_complete_like(scene.dst, converted.dst)


def test_side_file_folder_linked_out_of_dst_refused(src_copy, tmp_path):
    """A side file in a sub-folder of SRC, and in the DST being resumed that sub-folder is a
    symlink out of DST: nothing is written there; exit 4 naming it."""
    os.makedirs(os.path.join(src_copy, "tokenizer"))
    with open(os.path.join(src_copy, "tokenizer", "vocab.json"), "w") as f:
        f.write('{"a": 1}\n')
    scene = Scene(tmp_path, src_copy)
    assert scene.convert("--shards", "1").exit_code == 0
    os.symlink(os.path.join(scene.outside, "dir"), os.path.join(scene.dst, "tokenizer"))
    r = scene.convert()
    assert_clean_error(r, f"file {scene.dst}", "tokenizer/vocab.json", "outside DST", code=OUT)
    assert_not_complete(scene.dst)
    scene.assert_contained()


def test_state_dir_symlink_refused_by_finalize(fixture_src, partial_dst, tmp_path):
    """``k3convert finalize DST`` on a DST whose .k3convert is a symlink out of it."""
    scene = Scene(tmp_path, fixture_src)
    shutil.copytree(partial_dst, scene.dst, symlinks=True)
    target = os.path.join(scene.outside, "state")
    shutil.move(os.path.join(scene.dst, STATE_DIR), target)
    os.unlink(os.path.join(target, "manifest.lock"))
    os.symlink(target, os.path.join(scene.dst, STATE_DIR))
    r = scene.run("finalize", scene.dst)
    scene.assert_contained()
    assert_clean_error(r, f"file {scene.dst}", STATE_DIR, code=OUT)


def test_shard_writer_never_opens_partial_through_a_link(tmp_path):
    """The last line of defence: ShardWriter's O_NOFOLLOW refuses a symlinked ``.partial``."""
    target = tmp_path / "outside.bin"
    target.write_bytes(b"precious")
    (tmp_path / "x.safetensors.partial").symlink_to(target)
    layout = Layout([OutTensor("t", "U8", (4,))], {"format": "pt"})
    with pytest.raises(OSError) as e:
        ShardWriter(str(tmp_path / "x.safetensors"), layout)
    assert e.value.errno == errno.ELOOP
    assert target.read_bytes() == b"precious"


# ------------------------------------------------------------------ -o given as a symlink

def test_output_symlink_to_directory_is_followed(fixture_src, tmp_path, converted):
    """``-o LINK`` where LINK -> a directory: a user may point -o at a symlinked folder (another
    disk); the output lands in that folder and LINK stays a link."""
    real = tmp_path / "real-out"
    real.mkdir()
    link = tmp_path / "dst"
    link.symlink_to(real)
    scene = Scene(tmp_path, fixture_src, str(link))
    r = scene.convert()
    assert r.exit_code == 0, r.output
    scene.assert_contained()
    assert os.path.islink(link)
    assert_complete_like(str(real), converted.dst)


@pytest.mark.parametrize("into", ["src", "src/sub"])
def test_output_symlink_into_source_refused(src_copy, tmp_path, into):
    os.makedirs(os.path.join(src_copy, "sub"), exist_ok=True)
    link = tmp_path / "dst"
    link.symlink_to(tmp_path / into)
    scene = Scene(tmp_path, src_copy, str(link))
    r = scene.convert()
    assert_clean_error(r, f"file {link}", "must not contain each other", code=OUT)
    scene.assert_contained()
    assert os.listdir(os.path.join(src_copy, "sub")) == []


# ------------------------------------------------------------------ tensor names

def test_tensor_names_never_become_paths(src_copy, tmp_path, converted):
    """Tensor names like ``../../x`` or ``/abs`` (copied tensors and a converted MXFP4 module)
    are kept as names: every state file and table is per shard, so DST holds exactly the files of
    a normal conversion and nothing appears anywhere else."""
    odd = ["../../pwned", "a/b/../../../c.weight", "/abs/x.bias", "..\\win.bias"]
    module = "../../evil/model.layers.1.mlp.experts.9.w1"
    packed, scale = ct_mxfp4_encode(torch.randn(64, 64) * 0.02)
    shard = shard_names(src_copy)[0]

    def add(t: dict) -> None:
        for i, n in enumerate(odd):
            t[n] = torch.full((4, 8), float(i), dtype=torch.bfloat16)
        t[module + ".weight_packed"], t[module + ".weight_scale"] = packed, scale

    rewrite_shard(os.path.join(src_copy, shard), add)
    sync_index(src_copy)
    scene = Scene(tmp_path, src_copy)
    r = scene.convert()
    assert r.exit_code == 0, r.output
    scene.assert_contained()
    assert set(tree_hash(scene.dst)) == set(tree_hash(converted.dst))
    out, _ = load_shard(os.path.join(scene.dst, shard))
    for i, n in enumerate(odd):
        assert torch.equal(out[n], torch.full((4, 8), float(i), dtype=torch.bfloat16))
    assert out[module + ".weight_packed"].dtype == torch.int32 and out[module + ".weight_packed"].shape == (64, 8)
    assert out[module + ".weight_shape"].tolist() == [64, 64]
    assert read_json(os.path.join(scene.dst, INDEX))["weight_map"][module + ".weight_scale"] == shard
