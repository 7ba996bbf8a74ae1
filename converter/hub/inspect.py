"""``inspect ORG/NAME``: the local inspect, on a view of the commit (converter.hub.view) written to a
temporary folder and removed after: config, index, side files and every shard's header, no shard data."""
from __future__ import annotations

import os
import tempfile
from typing import Any

from . import remote as remote, view as hub_view
from .source import HubSource


def inspect_hub(source: HubSource, token: str | None = None) -> dict[str, Any]:
    from ..inspect import inspect_path
    snap = remote.resolve(source, token)
    with tempfile.TemporaryDirectory(prefix="k3convert-inspect-") as tmp:
        view = hub_view.build(snap, os.path.join(tmp, "view"), os.path.join(tmp, "cache"), False, token)
        info = inspect_path(view.root)
        info["path"] = snap.label
        info["hub"] = {"repo": source.repo, "revision": source.revision, "commit": snap.commit,
                       "shards_fetched": 0, "headers_read": len(view.headers)}
        info["other_files"] = [f for f in info.get("other_files") or [] if f != hub_view.VIEW_RECORD]
        for s in info.get("shards") or []:
            s.pop("path", None)
    return info
