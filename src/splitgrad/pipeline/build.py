"""Public path of the runtime's builders: ``splitgrad.pipeline.build`` as documented before issue 24, now an alias.

The module lives in :mod:`splitgrad.pipeline.runtime.build`. Importing this path hands out that module itself
(``splitgrad.pipeline.build is splitgrad.pipeline.runtime.build``), so the old imports keep working and can never
drift from the new home. New code imports from the new home.
"""

from __future__ import annotations

import sys

from .runtime import build as _home

sys.modules[__name__] = _home
