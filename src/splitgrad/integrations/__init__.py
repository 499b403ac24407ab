"""Other people's frameworks, each in its own module that imports its package lazily (only when called), each
tested against the real package in CI:

* :mod:`~splitgrad.integrations.transformers` -- HuggingFace transformers v5 MoE experts (the modules its
  ``@use_experts_implementation`` decorator dispatches), converted by :func:`splitgrad.convert`; experts
  sharded over expert parallelism; decoders cut into pipeline stages;
* :mod:`~splitgrad.integrations.torchtitan` -- torchtitan's models split with its own pipeline helpers, with
  splitgrad layers and ``splitgrad_pipeline_stage`` stages (its zero-bubble and CSV schedule recipes);
* :mod:`~splitgrad.integrations.megatron` -- Megatron-Core's ``DistributedDataParallel`` around splitgrad
  layers (:func:`~splitgrad.integrations.megatron.check_ddp`), and Megatron's interleaved pipeline order as a
  splitgrad :class:`~splitgrad.pipeline.Schedule`;
* :mod:`~splitgrad.integrations.dualpipe` -- DeepSeek's DualPipe: splitgrad layers put their weight-gradient
  work into DualPipe's ``WeightGradStore``.

Importing ``splitgrad.integrations`` imports none of the integrated packages. See docs/integrations.md.
"""

from __future__ import annotations
