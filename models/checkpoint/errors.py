"""Errors raised by checkpoint I/O."""

from __future__ import annotations

import os


class SpecError(ValueError):
    """A list of :class:`~megagraph.models.checkpoint.spec.WeightSpec` is inconsistent (bad dtype,
    duplicate name, quantized weight without its scale, ...)."""


class CheckpointError(ValueError):
    """A checkpoint on disk does not match what was asked for, or is damaged.

    ``file``: the file at fault (shard, index, or the checkpoint directory), ``tensor``: the first tensor
    concerned (or ``None``), ``reason``: what is wrong.  ``problems`` holds every problem found as
    ``(file, tensor, reason)`` when several were collected before raising (the message lists the first
    few).
    """

    def __init__(
        self,
        file: str | os.PathLike | None,
        reason: str,
        *,
        tensor: str | None = None,
        problems: list[tuple[str | None, str | None, str]] | None = None,
    ):
        self.file = None if file is None else os.fspath(file)
        self.tensor = tensor
        self.reason = reason
        self.problems = list(problems) if problems else [(self.file, tensor, reason)]
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.file or "<checkpoint>"
        head = f"{where}: tensor {self.tensor!r}: {self.reason}" if self.tensor else f"{where}: {self.reason}"
        if len(self.problems) <= 1:
            return head
        lines = [f"{len(self.problems)} problems; first: {head}"]
        for f, t, r in self.problems[1:8]:
            lines.append(f"  - {f or '<checkpoint>'}: " + (f"tensor {t!r}: " if t else "") + r)
        if len(self.problems) > 8:
            lines.append(f"  ... and {len(self.problems) - 8} more")
        return "\n".join(lines)
