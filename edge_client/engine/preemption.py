"""Layer-granular preemption of background micro-batches.

A training micro-batch of a 135M model takes seconds on a CPU, longer than a request can wait
for its first token. So background forward and backward passes check, at every decoder-layer
boundary, whether they must yield (a request arrived, or the slack they were given ran out) and
abort by raising `Preempted`. A request then waits at most about one layer of background work.
Callers compute gradients with `torch.autograd.grad` and apply them only on success, so an
aborted micro-batch leaves no partial gradients behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


class Preempted(Exception):
    """The background micro-batch gave way to serving."""


@contextlib.contextmanager
def preemptible(decoder_layers: list[torch.nn.Module], should_stop: Callable[[], bool]):
    """Raise Preempted at the next layer boundary (forward or backward) once `should_stop()`."""

    def check_grad(grad):
        if should_stop():
            raise Preempted("background backward pass preempted")
        return grad

    def after_layer(module, args, output):
        if should_stop():
            raise Preempted("background forward pass preempted")
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(check_grad)

    handles = [layer.register_forward_hook(after_layer) for layer in decoder_layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
