"""Public path of the simulator: ``splitgrad.pipeline.simulate`` as documented before issue 24, now an alias.

The module lives in :mod:`splitgrad.pipeline.ir.simulate`. Importing this path hands out that module itself
(``splitgrad.pipeline.simulate is splitgrad.pipeline.ir.simulate``), so the old imports keep working and can never
drift from the new home. New code imports from the new home.
"""

from __future__ import annotations

import sys

from .ir import simulate as _home

sys.modules[__name__] = _home
