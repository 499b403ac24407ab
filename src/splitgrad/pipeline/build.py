"""Public path of the runtime's builders: ``splitgrad.pipeline.build`` as documented before issue 24.

The module lives in :mod:`splitgrad.pipeline.runtime.build`; this alias keeps ``from splitgrad.pipeline.build
import build_runtime, pipeline_groups, sequential_stages`` working (it imports torch, as the module did). New
code imports from :mod:`splitgrad.pipeline` (``build_runtime``, ``pipeline_groups``) or
:mod:`splitgrad.pipeline.runtime`.
"""

from __future__ import annotations

from .runtime.build import PipelineGroups, build_runtime, pipeline_groups, sequential_stages

__all__ = ["PipelineGroups", "build_runtime", "pipeline_groups", "sequential_stages"]
