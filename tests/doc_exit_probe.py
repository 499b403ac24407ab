"""Appended by tests/test_docs.py to every multi-rank doc block: no gloo worker thread may outlive its last line.

Why: a gloo process group's worker threads (named ``pt_gloo_runloop``) are joined only when the group's last
reference dies. Alive after the block's last line (``destroy_process_group()`` included), they run into
interpreter shutdown, where gloo can abort the finished rank (docs/parallel.md, "A crash at exit"). The count
is load-independent: a held group's workers stay forever, while a joined worker's kernel task is gone within
moments (the short poll below only lets a thread that was already joined finish leaving ``/proc``).
"""

from __future__ import annotations


def _splitgrad_doc_exit_probe(where: str) -> None:
    import gc
    import os
    import time

    import torch.distributed as dist

    def gloo_workers() -> int:
        tasks = "/proc/self/task"
        count = 0
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/comm") as f:
                    count += f.read().strip() == "pt_gloo_runloop"
            except OSError:  # the thread left while we looked
                pass
        return count

    gc.collect()
    alive = gloo_workers()
    for _ in range(20):
        if alive == 0:
            return
        time.sleep(0.05)
        alive = gloo_workers()
    if alive == 0:
        return

    # Name what holds a process group: objects referring to one, directly or through an untracked tuple or
    # dict (which gc.get_referrers cannot see); a module's globals by the variable's name.
    def held(ref: object) -> bool:
        inner = ref.values() if isinstance(ref, dict) else ref if isinstance(ref, tuple) else (ref,)
        return any(isinstance(x, dist.ProcessGroup) for x in inner)

    holders = set()
    for obj in gc.get_objects():
        if isinstance(obj, dict) and "__name__" in obj and held(obj):
            names = [k for k, v in obj.items() if isinstance(v, dist.ProcessGroup)]
            holders.update(f"{obj['__name__']}.{name}" for name in names)
        elif any(
            held(ref) for ref in gc.get_referents(obj) if not (isinstance(ref, dict) and "__name__" in ref)
        ):
            holders.add(type(obj).__qualname__)
    raise RuntimeError(
        f"{where}: {alive} gloo worker thread(s) alive after the block's last line on rank "
        f"{os.environ.get('RANK')}: something still holds a process group (holders: {sorted(holders)}); "
        "see docs/parallel.md, 'A crash at exit'"
    )
