"""``GroupRef``: a process group held without keeping it alive past ``dist.destroy_process_group()``.

It lives in ``splitgrad.functional.group_ref`` because the tensor-parallel config (``functional/tp_config.py``,
below ``module/``) holds its group through it; re-exported here, next to the other parallel holders.
"""

from __future__ import annotations

from ..functional.group_ref import GroupRef

__all__ = ["GroupRef"]
