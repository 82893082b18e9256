"""What the guard watches of the model besides its gradients: the training forward passes, a clock
every rank compares so that a rank that skipped an optimizer step is named rather than paired with
the others' next step; and the set of trained parameters, so that ownership is inferred again when it
grows (a block unfrozen, a param group added, a module swapped) rather than judged against a stale map.

A parameter frozen after inference needs no new map: its gradient stops coming, which the measuring
reads as an absent gradient, as the clip call does. So only the parameters frozen at inference are
read per step, not every parameter of the model."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

_trained = operator.attrgetter("requires_grad")


class ModelWatch:
    """Counts the model's forward passes under autograd, and tells whether its trained parameters or
    the optimizer's param groups differ from when `mark` was last called."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        follow: bool,
        on_forward: Callable[[], None] | None = None,
    ) -> None:
        from torch.nn.modules import module as modules

        self.model, self.optimizer, self.follow = model, optimizer, follow
        self.forwards = 0
        """Forward passes of the model with autograd on, since the guard was attached."""
        self._on_forward = on_forward
        self._params: list[torch.nn.Parameter] = []
        self._frozen: list[torch.nn.Parameter] = []
        """The parameters not trained when `mark` was last called."""
        self._ids = 0
        self._dirty = True
        self._handles: list[RemovableHandle] = [model.register_forward_pre_hook(self._forward)]
        if follow:
            # any module of the process: only marks the parameter list to be read again
            self._handles.append(modules.register_module_parameter_registration_hook(self._registered))
            self._handles.append(modules.register_module_module_registration_hook(self._registered))
        self._marked = 0
        self.mark()

    def _forward(self, module: Any, args: Any) -> None:
        import torch

        if torch.is_grad_enabled():
            self.forwards += 1
            if self._on_forward is not None:
                self._on_forward()

    def _registered(self, *args: Any) -> None:
        self._dirty = True

    def signature(self) -> int:
        """A hash of which parameters the model holds, whether one frozen at `mark` is trained now, and
        which the optimizer steps (0 when not following: the pieces were given, not inferred)."""
        if not self.follow:
            return 0
        if self._dirty:
            self._params = list(self.model.parameters())
            self._ids = hash(tuple(map(id, self._params)))
            self._dirty = False
        # each group's list and its length: a group added, a list replaced or grown (not read per parameter)
        stepped = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        return hash((self._ids, any(map(_trained, self._frozen)), stepped))

    def changed(self) -> bool:
        """Whether the parameters changed since `mark`."""
        return self.follow and self.signature() != self._marked

    def mark(self) -> None:
        """Ownership was inferred for the parameters as they are now."""
        self.signature()  # the parameter list read again where it changed
        self._frozen = [param for param in self._params if not param.requires_grad]
        self._marked = self.signature()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
