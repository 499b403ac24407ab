"""The schedule IR: actions and schedules as data, their validation, and the simulator that times them.

Torch-free: a schedule is built, checked and simulated without a process or a tensor. :mod:`~.actions` holds
the grammar (``Action``, ``OverlapAction``, ``Schedule``, ``parse_action``), :mod:`~.validate` the checks
(completeness, order, deadlock), :mod:`~.simulate` the timing and memory model; the engine both share
(``_engine``) runs a schedule under the blocking model once, for any per-action durations. :mod:`~.replay`
holds the round-robin loop the passes and generators use to re-time a fixed per-rank order. The most used
names are exported from :mod:`splitgrad.pipeline` itself.
"""
