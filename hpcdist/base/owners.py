"""Who could have written a file: the one rule behind every "nobody else could have written this" check.

A file counts as written by its owner, by everyone when it is writable by others, and by its group's members when
it is group-writable, unless that group is its owner's private one (umask 002 sites). Checkpoints are loaded only
when every file passes (hpcdist.config.dirs.tree_trust_problems); records hpcdist reads back (jobs.jsonl, a task's
result) likewise (hpcdist.base.atomic.read_trusted). Standard library only: the lowest layer uses it.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat

__all__ = ["user_name", "writer_problem"]


def user_name(uid: int) -> str:
    """ "alice (uid 1001)", or "uid 4242" for a uid without a name on this host."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def writer_problem(st: os.stat_result, trusted: set[int]) -> str | None:
    """Why someone outside ``trusted`` (uids) could have written the file or directory ``st`` describes (its
    owner, or write permission for others or for a group that is not its owner's private one); None if nobody."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted:
        return f"belongs to {user_name(st.st_uid)}, not to you ({user_name(os.getuid())})"
    if mode & stat.S_IWOTH:
        return f"is writable by others (mode {mode:04o})"
    if mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        return f"is writable by group {_group_name(st.st_gid)} (mode {mode:04o})"
    return None


@functools.lru_cache(maxsize=256)
def _private_group(gid: int, uid: int) -> bool:
    """A user private group (umask 002 sites): named like its owner, whose primary group it is, with no other
    member listed; group-writable files in it are writable by the owner alone."""
    try:
        group, owner = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return group.gr_name == owner.pw_name and owner.pw_gid == gid and set(group.gr_mem) <= {owner.pw_name}


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"
