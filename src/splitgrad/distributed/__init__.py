"""Process-group plumbing shared by the layers and the parallel strategies (no strategy lives here).

* :mod:`.group_ref` -- ``GroupRef``: a process group held without keeping it alive past its destruction;
* :mod:`.wait` -- ``bounded_wait``: the one wait on a ``dist.Work``, with a time limit and an error naming
  the operation, the rank and the limit;
* :mod:`.tp_config`, :mod:`.tp_comm`, :mod:`.tp_sequence` -- the tensor-parallel config and the collectives
  the TP layers call inside their autograd Functions (public through :mod:`splitgrad.parallel.tensor`);
* :mod:`.grid` -- ``grid_groups``: the inner/outer groups of a 2-D rank grid (TP x outer, pipeline x replicas);
* :mod:`.launch` -- ``spawn``, the local launcher (public as ``splitgrad.testing.spawn``);
* :mod:`.teardown` -- ``destroy_process_group`` (public as ``splitgrad.parallel.destroy_process_group``).

``splitgrad.module`` imports the tensor-parallel parts, so this package loads with ``import splitgrad``; it
re-exports nothing, so that the launcher (``torch.multiprocessing``) and teardown load only when used.
"""

from __future__ import annotations
