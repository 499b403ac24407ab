"""A transformers v5 decoder cut by ``hf_pipeline_stages`` and run by splitgrad's pipeline runtime is exact.

Why: a HF decoder layer needs the rotary position embeddings and the attention mask that the HF model builds
once per forward; each stage rebuilds them (a wrong position, a missing sliding window or a shared buffer shows
up as a different loss or gradient). Dense (Llama, Qwen3 with sliding-window layers) and MoE (Qwen3-MoE,
Mixtral) models, converted with deferred W, on 2 gloo ranks with ``zb-h1`` and ``zbv`` (2 stages per rank):
the loss and every parameter gradient against the unconverted single-process model, in float64.
"""

from __future__ import annotations

import pytest

from splitgrad.testing import spawn
from tests.integrations import hf_parallel_checks

pytestmark = pytest.mark.distributed

CASES = [("llama", "zb-h1"), ("qwen3", "zbv"), ("qwen3_moe", "zb-h1"), ("mixtral", "zbv")]


def test_hf_decoder_pipeline_matches_single_process():
    reports = spawn(hf_parallel_checks.pipeline_exact, 2, CASES, timeout=300.0, pg_timeout=120.0)
    for report in reports:
        assert [r["case"] for r in report[: len(CASES)]] == [f"{f}/{s}" for f, s in CASES]
        assert all(r["params"] > 0 and r["w_tasks"] > 0 for r in report[: len(CASES)])
    assert all(r.get("negative") for r in reports[0][: len(CASES)])
    assert reports[0][-1]["case"] == "sliding mask matters"


EP_CASES = [
    ("qwen3_moe", "immediate"),
    ("qwen3_moe", "delayed"),
    ("qwen3_moe", "in-dispatch"),
    ("mixtral", "delayed"),
]


def test_hf_experts_sharded_over_ep2_match_single_process():
    """``shard_hf_experts``: a converted Qwen3-MoE / Mixtral with its experts over EP = 2 (splitgrad's all-to-all
    dispatcher, the family's own converted experts on each rank's 2 of 4 experts): loss and every gradient equal
    the unconverted single-process model on the global batch; deferred W, at ``backward_dw`` or inside the
    dispatch all-to-all, bitwise equal to immediate; Mixtral trained as examples/hf_moe.py does (expert W inside the
    dispatch, ``ExpertDataParallel`` averaging the dense gradients)."""
    reports = spawn(hf_parallel_checks.expert_parallel_exact, 2, EP_CASES, timeout=300.0, pg_timeout=120.0)
    for report in reports:
        assert [r["case"] for r in report] == [f"{f}/{m}" for f, m in EP_CASES]
        assert all(r["sharded"] == 4 and r["negative"] for r in report)  # 4 MoE layers each
