"""DST's state on disk: whether a run may use DST (someone else's folder, a different conversion,
one in use), its preparation under the DST lock (``prepare_dst``), and the clean-up of what killed runs
left. Several runs (batch jobs) may share a DST as long as their shard selections are disjoint."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from typing import Any, Mapping

from ..errors import OutputError
from ..formats import checkpoint as ckpt
from ..safepath import contains, lock_file, try_lock
from ..state.atomic import discard
from ..state.files import MANIFEST, REPORT, STATE_DIR, TENSOR_TABLE
from ..state.locks import LOCKS, MANIFEST_LOCK, READ_LOCK, DstLock, writing
from ..state.manifest import Status
from ..state.records import read_json, write_json
from .identity import (
    HINTS,
    IDENTITY,
    identity_difference,
    named,
    recorded_identity,
    run_identity,
    source_change,
    stamped,
    state_path,
)
from .options import Options
from .outputs import expected
from .plan import TEMPORARY, Plan
from .sources import hint


def refuse_linked_state(dst: str) -> None:
    """DST's state folder is read and written: through a planted link it would be elsewhere."""
    if os.path.islink(state_path(dst)):
        raise OutputError(f"{STATE_DIR} is a symlink: refusing to write through it", file=dst)


def _remove(path: str) -> None:
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def _wipe(dst: str) -> None:
    """Empty DST for --overwrite, keeping the lock files (other runs may be waiting on them)."""
    for name in os.listdir(dst):
        if name != STATE_DIR:
            _remove(os.path.join(dst, name))
    for name in os.listdir(state_path(dst)):
        if name not in LOCKS:
            _remove(state_path(dst, name))


def _clean_temporaries(dst: str, plan: Plan, options: Options) -> None:
    """Drop what killed runs left: only called with no other run using DST, so none of it can be
    work in progress. Only this tool's own temporaries: anything in its state folder, and in DST
    ``NAME.partial`` of a shard and ``NAME.tmpPID`` of a file a run writes there (the plan's
    outputs, what the manifest records as written, the manifest itself). A user's
    ``notes/eval.tmp`` or ``run.partial`` is theirs (T4)."""
    state = state_path(dst)
    for f in os.listdir(state):
        if TEMPORARY.search(f):
            discard(os.path.join(state, f))
    want = expected(plan, options.scale_rule)
    ours = want.names | set(DERIVED) | {MANIFEST} | recorded_files(dst)
    clean_dead_temporaries(dst, [s.name for s in plan.shards], ours)


def reopen(dst: str) -> None:
    """A shard is about to be (re)done: first DST must stop claiming to be complete, so that a
    kill during the redo cannot leave a "complete" manifest with a shard missing."""
    with lock_file(state_path(dst, MANIFEST_LOCK)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with writing(dst):  # an upload reading DST is never given a half-redone one (S14)
            reset_complete(dst)


DERIVED = (ckpt.INDEX, "config.json", REPORT, TENSOR_TABLE)  # written by finalize from the shard records


def reset_complete(dst: str) -> None:
    """If the manifest says complete (or cannot be read, so may), make it say partial (an unreadable
    one is removed: finalize writes it anew), then remove what finalize derives (``DERIVED``):
    meanwhile no loader takes DST for a checkpoint, and no report describes shards that may go.
    Called with manifest.lock held."""
    path = os.path.join(dst, MANIFEST)
    try:
        manifest = read_json(path)
    except OutputError:  # corrupt: no advice to give, the run rewrites it (T13)
        manifest = None
        discard(path)
        if os.path.lexists(path):
            raise OutputError("is corrupt and cannot be removed", file=path) from None
    else:
        if not isinstance(manifest, dict) or manifest.get("complete") is False:
            return
        manifest.update(complete=False, status=Status.PARTIAL)
        manifest.pop("finished_at", None)
        write_json(path, manifest)
    for name in DERIVED:
        p = os.path.join(dst, name)
        try:
            if os.path.lexists(p):
                os.unlink(p)
        except OSError as e:
            raise OutputError(f"cannot remove: {e.strerror}", file=p) from None


_FOREIGN = "exists, is not empty and holds no k3convert state: choose a new directory"


def entries(dst: str) -> list[str]:
    """What DST holds besides our state folder."""
    return [f for f in os.listdir(dst) if f != STATE_DIR]


def usable_dst(plan: Plan, dst: str) -> None:
    """What refuses DST before anything of ours is put there (the run and --dry-run alike): a
    directory holding neither our state folder nor our manifest is someone else's."""
    if contains(plan.src, dst) or contains(dst, plan.src):
        raise OutputError(f"DST and SRC ({plan.src}) must not contain each other", file=dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or not os.access(dst, os.W_OK | os.X_OK)):
        raise OutputError("is not a writable directory", file=dst)
    if os.path.isdir(dst) and not os.path.lexists(state_path(dst)) and not os.path.isfile(os.path.join(dst, MANIFEST)) \
            and entries(dst):
        raise OutputError(_FOREIGN, file=dst)  # (a run started at the same moment may just have made the


def unrecorded(dst: str) -> str:
    """Why a DST of ours without a run record cannot be continued, in words (T12, T13)."""
    state = [f for f in os.listdir(state_path(dst)) if f not in LOCKS] if os.path.isdir(state_path(dst)) else []
    if not state and os.path.isfile(os.path.join(dst, MANIFEST)):  # (locks: this run may just have made it)
        return (f"a k3convert output without its {STATE_DIR} state folder, copied without it? "
                "verify and upload take it as it is")
    return f"no run record {STATE_DIR}/{IDENTITY}"


def judge_dst(plan: Plan, dst: str, options: Options, ident: Mapping[str, Any], old: Mapping[str, Any] | None,
              unreadable: str | None = None) -> tuple[str | None, dict[str, Any]]:
    """Whether DST (its recorded identity ``old``, None if none; ``unreadable``: why that record
    cannot be read) continues this conversion: None, or what differs, which --overwrite replaces
    (else refused, exit 4); and the source hints to record. The one decision of the run and of
    --dry-run. Every refusal's advice works when followed: output of ours that cannot be continued
    (a corrupt or missing run record, a copy without the state folder) is replaced by --overwrite."""
    hints = {s.name: hint(s.path) for s in plan.shards}
    if old is None:
        if unreadable is None and not entries(dst):
            return None, hints
        what: str | None = unreadable or unrecorded(dst)
        if not options.overwrite:
            raise OutputError(f"holds k3convert output that cannot be continued ({what}): "
                              "use --overwrite to replace it", file=dst)
        return what, hints
    what = identity_difference(old, ident)
    if what is None:
        what, hints = source_change(dst, plan, old)
    if what is not None and not options.overwrite:
        raise OutputError(f"holds a different conversion ({what}), recorded by {named(old)}: "
                          "use --overwrite to replace it", file=dst)
    return what, hints


def in_use(dst: str, what: str, old: Mapping[str, Any] | None) -> OutputError:
    return OutputError(f"holds a different conversion ({what}) that another k3convert run is using "
                       f"(recorded by {named(old)}): refusing to replace it", file=dst)


def held(path: str) -> bool:
    """Whether another process holds a flock on the lock file ``path`` (absent: no). Probed
    exclusively without waiting and released at once; nothing is created."""
    try:
        f = try_lock(path)
    except OSError:
        return False
    if f is None:
        return True
    f.close()
    return False


def prepare_dst(plan: Plan, dst: str, options: Options) -> DstLock:
    """Create DST, or check that it continues this very conversion (else refuse/replace).

    Returns the DST lock, held: run.json is read, compared and written under it, and the
    caller claims its shards before letting it go (``DstLock.join``), so runs started at once
    agree on one identity or all but one are refused, naming the run that recorded it."""
    usable_dst(plan, dst)
    ident = run_identity(plan, options)
    try:
        refuse_linked_state(dst)
        os.makedirs(state_path(dst), exist_ok=True)
        refuse_linked_state(dst)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror}", file=dst) from None
    lock = DstLock(state_path(dst))
    try:
        old, unreadable = recorded_identity(dst)
        what, hints = judge_dst(plan, dst, options, ident, old, unreadable)
        if what is not None:
            if not lock.alone():
                raise in_use(dst, what, old)
            with writing(dst):
                _wipe(dst)
            old = None
        if lock.alone():
            _clean_temporaries(dst, plan, options)
        if old is None:
            write_json(state_path(dst, IDENTITY), stamped(ident, hints))
        elif old.get(HINTS) != hints:  # the content was re-read and still matches (cp -al, chmod)
            write_json(state_path(dst, IDENTITY), {**old, HINTS: hints})
    except OSError as e:
        lock.close()
        raise OutputError(f"cannot write: {e.strerror}", file=e.filename or dst) from None
    except BaseException:
        lock.close()
        raise
    return lock


def refuse_while_read(dst: str) -> None:
    """The run's refusal when an upload reads DST (``locks.writing``, exit 4), for the dry run:
    its read lock taken and released at once, only where a lock file is already there."""
    if os.path.exists(state_path(dst, READ_LOCK)):
        with writing(dst):
            pass


_DEAD = re.compile(r"tmp\d*")  # the tail of a temporary's name (atomic.temp_name; plan.TEMPORARY)


def clean_dead_temporaries(dst: str, shards: list[str], written: set[str]) -> None:
    """Remove what killed runs left of the files finalize writes (``NAME.tmpPID``, any pid) and of
    the shards (``NAME.partial``). Safe without DST to itself: finalize writes those names only
    under manifest.lock, held here, and every shard is done, so no run is writing one."""
    ours: dict[str, set[str]] = {}
    for rel in written:
        ours.setdefault(os.path.dirname(rel), set()).add(os.path.basename(rel))  # the manifest: DST itself
    root = os.path.realpath(dst)
    for folder, names in ours.items():
        inside = os.path.normpath(os.path.join(root, folder))
        if not contains(root, inside) or os.path.realpath(os.path.join(dst, folder)) != inside:
            continue  # outside DST, or through a link (names in a manifest are untrusted)
        try:
            entries = os.listdir(os.path.join(dst, folder))
        except OSError:
            continue
        for e in entries:
            stem, _, tail = e.rpartition(".")
            if stem in names and _DEAD.fullmatch(tail) or not folder and stem in shards and tail == "partial":
                discard(os.path.join(dst, folder, e))


def recorded_files(dst: str) -> set[str]:
    """The files beside the shards that DST's manifest says an earlier finalize wrote."""
    try:
        m = read_json(os.path.join(dst, MANIFEST))
    except OutputError:  # a corrupt manifest is replaced; what it named is not known
        return set()
    files = m.get("files") if isinstance(m, dict) else None
    return {n for n in files if isinstance(n, str)} if isinstance(files, dict) else set()
