"""Other people's code made split-capable: each integration imports its package lazily, only when used.

* :mod:`splitgrad.integrations.torchtitan`: torchtitan's models split with its own pipeline helpers, with
  splitgrad layers and ``splitgrad_pipeline_stage`` stages (its zero-bubble and CSV schedule recipes).

Importing ``splitgrad.integrations`` imports none of the integrated packages.
"""

from __future__ import annotations
