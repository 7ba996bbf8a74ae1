"""Whole numbers typed by people or read from the environment: ASCII digits only.

Python's ``int()`` also takes ``1_0`` (10), ``٢`` (Arabic-Indic two), ``+3`` and digits by the
thousand: a pasted character or a typo would silently become another count. Every count a user
gives (``--workers``, ``K3CONVERT_WORKERS``, ``--shards``, ``--part``, ``cuda:N``, thread
counts in the environment) is read here."""
from __future__ import annotations

import re

_DIGITS = re.compile(r"[0-9]{1,30}")  # 30 digits: beyond any count, far below int()'s 4300-digit limit


def whole(text: str) -> int | None:
    """``text`` (spaces around it allowed) as a whole number when it is 1-30 ASCII digits, else None."""
    t = text.strip(" \t")
    return int(t) if _DIGITS.fullmatch(t) else None
