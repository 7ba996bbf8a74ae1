"""Which files k3convert reads, and how: shard names it owns or cannot write, shards and tensors the
index does not list, FIFOs and devices never opened for a blocking read (in SRC and in DST), links
inside and outside the checkpoint, read errors that name the source.

Each test is named for its defect in docs/reliability.md (D9-D11, D13, D17, D28, S9), which describes
the mechanism that fixed it; each failed before its fix.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat

import pytest
from dst_helpers import convert_cli, in_thread, release_fifo

from converter.state import records as manifest_mod
from converter.state.files import STATE_DIR
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    TABLE,
    assert_clean_error,
    assert_not_complete,
    read_json,
    rewrite_shard,
    run_cli,
    shard_names,
    write_json,
)

# ---------------------------------------- D13, D10, S9b: shard and side file names

def _rename_shard(src: str, old: str, new: str) -> None:
    os.rename(os.path.join(src, old), os.path.join(src, new))
    index = read_json(os.path.join(src, INDEX))
    index["weight_map"] = {t: (new if s == old else s) for t, s in index["weight_map"].items()}
    write_json(os.path.join(src, INDEX), index)


@pytest.mark.parametrize("name", [REPORT, MANIFEST, TABLE, "k3convert_x.safetensors", "README.md",
                                  "README.source.md", "model-2.safetensors.partial", "model-2.tmp77"])
def test_d13_shard_named_like_our_files_refused(src_copy, tmp_path, name):
    """A shard named like a file DST writes itself is refused at plan time, one line naming it."""
    _rename_shard(src_copy, shard_names(src_copy)[1], name)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(src_copy, dst), repr(name), "k3convert writes a file of that name", code=2)
    assert not os.path.exists(dst)


@pytest.mark.parametrize("length,code", [(238, 0), (247, 0), (248, 2), (255, 2)])
def test_d10_long_shard_names(src_copy, tmp_path, length, code):
    """Legal long shard names: up to 247 bytes they convert (their state files are named by a
    hash) and verify; longer ones, whose NAME.partial cannot exist, are refused in one line."""
    name = "m" * (length - len(".safetensors")) + ".safetensors"
    _rename_shard(src_copy, shard_names(src_copy)[1], name)
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    if code:
        assert_clean_error(r, "247", "rename the shard", code=2)
        return
    assert r.exit_code == 0, r.output
    assert os.path.exists(os.path.join(dst, name))
    assert all(len(f.encode()) <= 255 for f in os.listdir(os.path.join(dst, STATE_DIR)))
    assert run_cli("verify", dst).exit_code == 0


@pytest.mark.parametrize("name, shown", [(b"chat\xff.jinja", "chat\\xff.jinja"), (b"sub\xfe", "sub\\xfe")])
def test_s9b_a_side_file_name_that_is_not_utf8_is_refused_before_anything_is_written(src_copy, tmp_path,
                                                                                      name, shown):
    path = os.path.join(os.fsencode(src_copy), name)
    if name.startswith(b"sub"):                       # a folder of that name, holding an ordinary file
        os.makedirs(path)
        path = os.path.join(path, b"x.txt")
    with open(path, "wb") as f:
        f.write(b"{{ messages }}")
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(src_copy, dst), shown, "not valid UTF-8", "rename it", code=2)
    assert not os.path.exists(dst) or not [f for f in os.listdir(dst) if f.endswith(".safetensors")]


# ---------------------------------------- D9: every shard and tensor is one the index lists

def test_d9_unlisted_tensor_or_shard_refused(src_copy, tmp_path):
    """A tensor in a shard that the index does not list, and a .safetensors file the index
    does not name, are refused (one line each, naming shard and tensor), never converted or
    copied unconverted."""
    import torch

    first = shard_names(src_copy)[1]
    shutil.copy(os.path.join(src_copy, first), os.path.join(src_copy, "extra-00001.safetensors"))
    rewrite_shard(os.path.join(src_copy, first), lambda t: t.__setitem__("stray.weight", torch.zeros(4, 4)))
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    err = assert_clean_error(r, code=2, one_line=False)
    lines = err.splitlines()
    assert any(os.path.join(src_copy, first) in x and "tensor stray.weight" in x and "not in" in x for x in lines), err
    assert any("extra-00001.safetensors" in x and "does not name" in x for x in lines), err
    assert not os.path.exists(dst)


# ---------------------------------------- D11, D28: only regular files are read

def _mknull(path: str) -> None:
    try:
        os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null: reads give EOF at once
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")


@pytest.mark.parametrize("what", ["shard", "index", "config", "side-file"])
@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_d11_fifo_or_device_refused_never_waited_on(src_copy, tmp_path, what, kind):
    """A FIFO or a character device in the place of a shard, the index, the config or a side
    file is refused at plan time (exit 2, naming it and what it is), never opened."""
    rel = {"shard": shard_names(src_copy)[1], "index": INDEX, "config": "config.json",
           "side-file": "tokenizer_config.json"}[what]
    path = os.path.join(src_copy, rel)
    os.unlink(path)
    os.mkfifo(path) if kind == "fifo" else _mknull(path)
    dst = str(tmp_path / "dst")
    r = in_thread(lambda: convert_cli(src_copy, dst), 120, release_fifo(path))
    assert_clean_error(r, path, "FIFO" if kind == "fifo" else "character device", code=2)
    assert_not_complete(dst)


def test_d11_verify_does_not_hang_on_a_fifo_shard(converted, tmp_path):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    shard = os.path.join(dst, shard_names(dst)[1])
    os.unlink(shard)
    os.mkfifo(shard)
    r = in_thread(lambda: run_cli("verify", dst), 120, release_fifo(shard))
    assert r.exit_code == 5, r.output
    assert "FIFO" in r.output and os.path.basename(shard) in r.output


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_d28_inspect_names_what_the_path_is(tmp_path, kind):
    path = str(tmp_path / "thing")
    os.mkfifo(path) if kind == "fifo" else _mknull(path)
    r = in_thread(lambda: run_cli("inspect", path), 60, release_fifo(path))
    assert_clean_error(r, path, "FIFO (named pipe)" if kind == "fifo" else "character device", code=2)


JSON_FIFOS = [  # (command, where the FIFO is, the file): each JSON file these commands read
    ("verify", "dst", MANIFEST), ("verify", "dst", INDEX), ("verify", "dst", "config.json"),
    ("inspect", "dst", MANIFEST), ("inspect", "dst", INDEX), ("inspect", "dst", "config.json"),
    ("verify --source", "src", INDEX),
]


@pytest.mark.parametrize("cmd,where,name", JSON_FIFOS, ids=[f"{c}-{w}-{n}" for c, w, n in JSON_FIFOS])
def test_json_reader_refuses_a_fifo(converted, src_copy, tmp_path, cmd, where, name):
    """A FIFO in the place of a JSON file that verify or inspect reads: a non-zero exit at once,
    naming the file or saying it is a FIFO (the JSON reader never opens one for blocking reads)."""
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    path = os.path.join(dst if where == "dst" else src_copy, name)
    os.unlink(path)
    os.mkfifo(path)
    args = {"verify": ["verify", dst], "inspect": ["inspect", dst],
            "verify --source": ["verify", dst, "--source", src_copy]}[cmd]
    r = in_thread(lambda: run_cli(*args), 10, release_fifo(path))
    assert r.exception is None or isinstance(r.exception, SystemExit), (r.exception, r.output)
    if (cmd, name) == ("inspect", MANIFEST):  # inspect describes an unreadable manifest as such
        assert r.exit_code == 0 and "k3convert int4 output" in r.output, r.output
    else:
        assert r.exit_code != 0, r.output
        assert "FIFO" in r.output or name in r.output, r.output  # verify words it its own way (verify.dst.read_obj)


def test_json_reader_missing_file_is_still_absent(tmp_path):
    from converter.formats import json_input

    with pytest.raises(FileNotFoundError):
        json_input.load_file(str(tmp_path / "none.json"))
    assert manifest_mod.read_json(str(tmp_path / "none.json")) is None


# ---------------------------------------- S9: side files under links

def test_s9_a_linked_folder_inside_src_is_copied_as_regular_files(src_copy, tmp_path):
    os.makedirs(os.path.join(src_copy, "real_tok"))
    with open(os.path.join(src_copy, "real_tok", "tokenizer.json"), "w") as f:
        f.write('{"model": "x"}')
    os.symlink("real_tok", os.path.join(src_copy, "tokenizer"))
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    assert r.exit_code == 0, r.output
    for rel in ("tokenizer/tokenizer.json", "real_tok/tokenizer.json"):     # 74b0137: tokenizer/ skipped
        out = os.path.join(dst, rel)
        assert not os.path.islink(out) and not os.path.islink(os.path.dirname(out))
        assert open(out).read() == '{"model": "x"}'
    assert run_cli("verify", dst, "--source", src_copy).exit_code == 0


@pytest.mark.parametrize("target, needle", [
    ("outside", "outside the checkpoint directory"),
    (".", "a link to a folder it lies in (a loop)"),
])
def test_s9_a_linked_folder_outside_src_or_a_loop_is_refused_before_anything_is_written(src_copy, tmp_path,
                                                                                         target, needle):
    if target == "outside":
        target = str(tmp_path / "elsewhere")
        os.makedirs(target)
        with open(os.path.join(target, "tokenizer.json"), "w") as f:
            f.write("{}")
    link = os.path.join(src_copy, "tokenizer")
    os.symlink(target, link)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(src_copy, dst), f"file {link}: a link to", needle, code=2)
    assert not os.path.exists(dst) or not [f for f in os.listdir(dst) if f.endswith(".safetensors")]


# ---------------------------------------- D17: read errors name the source

def test_d17_source_read_error_names_the_source(fixture_src, tmp_path, monkeypatch):
    """EIO while reading a source shard: exit 4, the SRC file (and tensor) named, not DST's."""
    shard = os.path.join(fixture_src, shard_names(fixture_src)[1])
    real = os.preadv

    def preadv(fd, bufs, offset, *a):
        if os.readlink(f"/proc/self/fd/{fd}") == shard:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset, *a)
    monkeypatch.setattr(os, "preadv", preadv)
    dst = str(tmp_path / "dst")
    err = assert_clean_error(convert_cli(fixture_src, dst), f"file {shard}", os.strerror(errno.EIO), code=4)
    assert os.path.join(dst, os.path.basename(shard)) not in err and "tensor " in err
    assert_not_complete(dst)
