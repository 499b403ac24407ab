"""Public path of the simulator: ``splitgrad.pipeline.simulate`` as a module, as documented before issue 24.

The module lives in :mod:`splitgrad.pipeline.ir.simulate`; this alias keeps ``import
splitgrad.pipeline.simulate`` and ``from splitgrad.pipeline.simulate import SimulationResult`` working. New code
imports from :mod:`splitgrad.pipeline` or :mod:`splitgrad.pipeline.ir`.
"""

from __future__ import annotations

from .ir.simulate import Costs, SimulationResult, check_w_memory, simulate, stage_costs

__all__ = ["Costs", "SimulationResult", "check_w_memory", "simulate", "stage_costs"]
