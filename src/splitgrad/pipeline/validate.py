"""Public path of the schedule checks: ``splitgrad.pipeline.validate`` as documented before issue 24, now an alias.

The module lives in :mod:`splitgrad.pipeline.ir.validate`. Importing this path hands out that module itself
(``splitgrad.pipeline.validate is splitgrad.pipeline.ir.validate``), so the old imports keep working and can never
drift from the new home. New code imports from the new home.
"""

from __future__ import annotations

import sys

from .ir import validate as _home

sys.modules[__name__] = _home
