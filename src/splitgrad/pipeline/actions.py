"""Public path of the action grammar: ``splitgrad.pipeline.actions`` as documented before issue 24, now an alias.

The module lives in :mod:`splitgrad.pipeline.ir.actions`. Importing this path hands out that module itself
(``splitgrad.pipeline.actions is splitgrad.pipeline.ir.actions``), so the old imports keep working and can never
drift from the new home. New code imports from the new home.
"""

from __future__ import annotations

import sys

from .ir import actions as _home

sys.modules[__name__] = _home
