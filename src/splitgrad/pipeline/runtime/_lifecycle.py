"""Whether a runtime may still run a step: open, closed by the user, or broken by a failed step."""

from __future__ import annotations

__all__ = ["Lifecycle"]


class Lifecycle:
    """One rank's runtime state across steps.

    A failed distributed step leaves receives it posted pending in the backend, where they would take the next
    step's messages: the runtime then refuses to run again rather than pair messages wrongly.

    Args:
        owner: how errors name the runtime, e.g. ``"PipelineRuntime (pipeline rank 1)"``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.closed = False
        self.failure: str | None = None

    def check_can_step(self) -> None:
        """Raise ``RuntimeError`` after :meth:`close` or a recorded failure."""
        if self.closed:
            raise RuntimeError(f"{self.owner}: step() after close()")
        if self.failure is not None:
            raise RuntimeError(
                f"{self.owner}: a previous step failed ({self.failure}); messages it posted may still be in "
                "flight, so this runtime cannot run again. Tear down the process groups and build a new one"
            )

    def fail(self, exc: BaseException, where: str) -> None:
        """Record that a distributed step failed with ``exc`` at ``where`` (an action)."""
        self.failure = f"{type(exc).__name__} at action {where}"

    def close(self) -> bool:
        """Mark closed; False when it already was (closing is idempotent)."""
        was_open, self.closed = not self.closed, True
        return was_open
