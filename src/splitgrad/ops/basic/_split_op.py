"""What the deferrable basic ops (``BasicLinear``, ``GroupedLinear``) share: TE ops' names for the split contract."""

from __future__ import annotations

from ...core import SplitModule
from ..op import BasicOperation

__all__ = ["SplitOperation", "split_repr"]


class SplitOperation(BasicOperation, SplitModule):
    """A basic op whose weight gradients follow :class:`~splitgrad.core.SplitModule`'s contract.

    TE's ops call the modules' ``fuse_wgrad_accumulation`` ``accumulate_into_main_grad``; both names read the
    same switch here.
    """

    @property
    def accumulate_into_main_grad(self) -> bool:
        """TE ops' name of ``fuse_wgrad_accumulation``."""
        return self.fuse_wgrad_accumulation

    def finish_init(self, *, delay_wgrad_compute: bool, accumulate_into_main_grad: bool) -> None:
        """Initialise the parameters (``reset_parameters``), then create the store; last step of ``__init__``.

        The store marks the parameters, so they must exist (and be registered) first.
        """
        self.reset_parameters()
        self.init_split(
            delay_wgrad_compute=delay_wgrad_compute, fuse_wgrad_accumulation=accumulate_into_main_grad
        )


def split_repr(op: object) -> str:
    """The ``delay_wgrad_compute=..., accumulate_into_main_grad=...`` tail of a deferrable op's repr.

    Args:
        op: a :class:`SplitOperation` or a composite op delegating to one (``ops.Linear``).
    """
    return (
        f"delay_wgrad_compute={op.need_backward_dw()}, "
        f"accumulate_into_main_grad={op.accumulate_into_main_grad}"
    )
