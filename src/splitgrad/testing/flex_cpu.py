"""torchtitan's FlexAttention with a backward on CPU, for tests and CPU examples (a test double).

torch 2.13 refuses a FlexAttention backward on CPU: ``flex_attention`` checks its inputs with
``_validate_device`` and raises *"FlexAttention does not support backward on CPU"* whenever ``q``/``k``/``v``
require grad, compiled or not (and the compiled CPU backward, with the check lifted, fails in Inductor).
torch's eager ``flex_attention`` (its unfused reference implementation) has a working autograd backward on
CPU. Inside :func:`torchtitan_flex_on_cpu`:

* ``flex_attention``'s device check sees detached ``q``/``k``/``v``: every check stays except the refusal of
  a CPU backward;
* torchtitan's ``FlexAttention`` calls eager ``flex_attention`` instead of its ``torch.compile``\\ d one, with
  the same arguments, the ``BlockMask`` included;
* torchtitan builds ``BlockMask``\\ s with eager ``create_block_mask`` (its compiled one takes ~40 s to
  compile on CPU and gives the same mask).

Everything is restored on exit. On a GPU none of this is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torchtitan_flex_on_cpu"]


@contextmanager
def torchtitan_flex_on_cpu() -> Iterator[None]:
    """Within the block, torchtitan's FlexAttention runs torch's eager ``flex_attention``, backward included.

    Imports torchtitan. Not reentrant across threads (it swaps module attributes of torch and torchtitan).
    """
    import torch.nn.attention.flex_attention as flex
    import torchtitan.models.common.attention as titan_attention

    saved = (
        flex._validate_device,
        titan_attention.FlexAttention._compiled_flex_attn,
        titan_attention._compiled_create_block_mask,
    )
    validate = saved[0]

    def validate_detached(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        validate(query.detach(), key.detach(), value.detach())

    flex._validate_device = validate_detached
    titan_attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    titan_attention._compiled_create_block_mask = flex.create_block_mask
    try:
        yield
    finally:
        (
            flex._validate_device,
            titan_attention.FlexAttention._compiled_flex_attn,
            titan_attention._compiled_create_block_mask,
        ) = saved
