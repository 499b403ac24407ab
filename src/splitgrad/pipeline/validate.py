"""Public path of the schedule checks: ``splitgrad.pipeline.validate`` as a module, as documented before issue 24.

The module lives in :mod:`splitgrad.pipeline.ir.validate`; this alias keeps ``from splitgrad.pipeline.validate
import channel_order_problems`` working. New code imports from :mod:`splitgrad.pipeline.ir`.
"""

from __future__ import annotations

from .ir.validate import channel_order_problems, check_structure, find_problems, render_listing, validate

__all__ = ["channel_order_problems", "check_structure", "find_problems", "render_listing", "validate"]
