"""A process group held without keeping it alive past ``dist.destroy_process_group()``.

Why: a gloo group runs its collectives on worker threads that only the destruction of the group's last
reference joins; ``destroy_process_group()`` drops torch's own references and nothing more. An object that
still holds the group (a runtime, a layer, a ``PipelineGroups`` in the user's globals, an autograd node's
context) keeps the workers running into interpreter shutdown, where gloo may abort a finished rank
(docs/parallel.md, "A crash at exit"). torch's registry holds every group made by ``init_process_group`` or
``new_group`` until it is destroyed, so splitgrad's objects need no reference of their own: the default group
is looked up at each use and any other registered group is held weakly. A group torch does not know (built
directly from a backend class) is held strongly, since nothing else would keep it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["GroupRef"]


def _registered(group: dist.ProcessGroup) -> bool:
    """True when torch's registry (what ``destroy_process_group()`` clears) holds ``group``."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class GroupRef:
    """Where to find a process group at use: the default group, a registered group (weakly), or another.

    Args:
        group: the process group; None or ``dist.group.WORLD`` mean the default group.
        owner: who holds it, for error messages (``"PipelineComm.group"``).
    """

    __slots__ = ("_get", "is_default", "owner")

    def __init__(self, group: dist.ProcessGroup | None, *, owner: str) -> None:
        self.owner = owner
        self.is_default = group is None or group is dist.group.WORLD
        self._get: Callable[[], dist.ProcessGroup | None] | None
        if self.is_default:
            self._get = None
        elif _registered(group):
            self._get = weakref.ref(group)
        else:
            self._get = lambda: group  # nobody else holds it: a strong reference, as passed

    def get(self) -> dist.ProcessGroup:
        """The group; raises ``RuntimeError`` naming the owner once it was destroyed."""
        group = dist.group.WORLD if self._get is None else self._get()
        if group is None:
            what = "the default group" if self._get is None else "its process group"
            raise RuntimeError(
                f"{self.owner}: {what} was destroyed (dist.destroy_process_group()); "
                "build a new one after initialising a new process group"
            )
        return group

    def get_or_none(self) -> dist.ProcessGroup | None:
        """The group, or None for the default group (what torch's collectives take as the default)."""
        return None if self.is_default else self.get()
