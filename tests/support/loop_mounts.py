"""One ext4 image seen through two loop devices in turn, at one mount point: what another node, an
NFS/autofs remount or a reboot that renumbers devices shows of a shared file system (another
st_dev, the same inodes, times and bytes). Root only; skipped, saying why, elsewhere."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def two_mounts(tmp_path):
    """One ext4 image mounted at one place through two loop devices in turn (as another node, a
    remount or a reboot sees a shared file system: another st_dev, the same inodes and times).
    Yields (mount point, remount): remount() swaps the first loop device for a second one (ro)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: loop devices and mount")
    if not shutil.which("losetup") or not shutil.which("mkfs.ext4") or not os.path.exists("/dev/loop-control"):
        pytest.skip("needs losetup, mkfs.ext4 and /dev/loop-control")
    image, mnt = str(tmp_path / "fs.img"), str(tmp_path / "mnt")
    os.makedirs(mnt)
    with open(image, "wb") as f:
        f.truncate(96 << 20)
    _sh("mkfs.ext4", "-q", "-F", image)
    devices: list[str] = []
    try:
        devices.append(_sh("losetup", "-f", "--show", image))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"no loop device: {e.stderr.strip()}")
    try:
        _sh("mount", devices[0], mnt)
    except subprocess.CalledProcessError as e:
        _sh("losetup", "-d", devices[0])
        pytest.skip(f"cannot mount: {e.stderr.strip()}")

    def remount() -> None:
        _sh("umount", mnt)
        devices.append(_sh("losetup", "-f", "--show", "-r", image))  # the first is still attached: another one
        _sh("mount", "-o", "ro", devices[-1], mnt)

    try:
        yield mnt, remount
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
        for d in devices:
            subprocess.run(["losetup", "-d", d], capture_output=True)
