"""A stack of (attention, feed-forward) residual pairs, run plainly or reversibly, forward or one token at a time.

Sequential: x <- x + f(x); x <- x + g(x).
Reversible (RevNet, Gomez et al. 2017): the input is duplicated into two streams, y1 = x1 + f(x2),
y2 = x2 + g(y1), and the output is the mean of the streams. With ``memory_efficient=True`` (the default) no
activation is stored: the backward recomputes each block's input from its output, replaying the random state
recorded in the forward so dropout masks match. ``memory_efficient=False`` runs the same function under plain
autograd (reference for tests). A context tensor (encoder output) gets its gradient from the recomputation too.
"""
from typing import Callable, List, Optional

import torch
from torch import nn


def _rng_state(device: torch.device):
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _run_with_rng(fn, state, *args, **kwargs):
    """Re-run ``fn`` with the random state it saw in the forward (same dropout masks)."""
    cpu, gpu = state
    devices = [torch.cuda.current_device()] if gpu is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu)
        return fn(*args, **kwargs)


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, context, stack, kwargs_for):
        x1, x2 = x.chunk(2, dim=-1)
        states = []
        for (f, g), kind in zip(stack.layers, stack.kinds):
            fk, gk = kwargs_for(kind, context)
            fs = _rng_state(x.device)
            x1 = x1 + f(x2, **fk)
            gs = _rng_state(x.device)
            x2 = x2 + g(x1, **gk)
            states.append((fs, gs))
        out = torch.cat([x1, x2], dim=-1)
        ctx.stack, ctx.kwargs_for, ctx.states = stack, kwargs_for, states
        ctx.save_for_backward(out, context)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, context = ctx.saved_tensors
        ctx_leaf = None
        if context is not None:
            ctx_leaf = context.detach().requires_grad_(ctx.needs_input_grad[1])
        y1, y2 = (t.detach() for t in out.chunk(2, dim=-1))
        dy1, dy2 = grad.chunk(2, dim=-1)
        blocks = list(zip(ctx.stack.layers, ctx.stack.kinds, ctx.states))
        for (f, g), kind, (fs, gs) in reversed(blocks):
            fk, gk = ctx.kwargs_for(kind, ctx_leaf)
            with torch.enable_grad():
                y1.requires_grad_(True)
                gy1 = _run_with_rng(g, gs, y1, **gk)
                torch.autograd.backward(gy1, dy2)
            with torch.no_grad():
                x2 = y2 - gy1
                dx1 = dy1 + y1.grad
            with torch.enable_grad():
                x2.requires_grad_(True)
                fx2 = _run_with_rng(f, fs, x2, **fk)
                torch.autograd.backward(fx2, dx1)
            with torch.no_grad():
                x1 = y1 - fx2
                dx2 = dy2 + x2.grad
            y1, y2, dy1, dy2 = x1.detach(), x2.detach(), dx1, dx2
        ctx_grad = ctx_leaf.grad if ctx_leaf is not None and ctx_leaf.requires_grad else None
        return torch.cat([dy1, dy2], dim=-1), ctx_grad, None, None


class LayerStack(nn.Module):
    """layers: list of (f, g) module pairs; kinds: a tag per pair that ``kwargs_for`` maps to keyword arguments."""

    def __init__(self, layers: List[List[nn.Module]], kinds: List[str], reversible: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList(pair) for pair in layers)
        self.kinds = list(kinds)
        self.reversible = reversible
        self.memory_efficient = True

    def forward(self, x, kwargs_for: Callable, context: Optional[torch.Tensor] = None):
        """kwargs_for(kind, context) -> (kwargs for f, kwargs for g)."""
        if not self.reversible:
            for (f, g), kind in zip(self.layers, self.kinds):
                fk, gk = kwargs_for(kind, context)
                x = x + f(x, **fk)
                x = x + g(x, **gk)
            return x
        x = torch.cat([x, x], dim=-1)
        if self.memory_efficient and torch.is_grad_enabled():
            # The layers' weights get their gradients inside the Function's backward, but autograd records the
            # Function only if one of its tensor inputs needs a gradient: with frozen embeddings (or a raw input)
            # the weights would silently get none. A fresh leaf that asks for one keeps the Function recorded.
            if not (x.requires_grad or (context is not None and context.requires_grad)) and any(
                    p.requires_grad for p in self.parameters()):
                x = x.detach().requires_grad_()
            x = _ReversibleFunction.apply(x, context, self, kwargs_for)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            for (f, g), kind in zip(self.layers, self.kinds):
                fk, gk = kwargs_for(kind, context)
                x1 = x1 + f(x2, **fk)
                x2 = x2 + g(x1, **gk)
            x = torch.cat([x1, x2], dim=-1)
        return torch.stack(x.chunk(2, dim=-1)).mean(dim=0)

    def prefill(self, x, caches: list, kwargs_for: Callable, context=None):
        """``forward`` (no autograd) that fills ``caches`` (one dict per layer function) as ``step`` would."""
        return self._cached_pass(x, caches, kwargs_for, context, lambda fn, y, cache, kw: fn.prefill(y, cache, **kw))

    def step(self, x, caches: list, t: int, kwargs_for: Callable, context=None):
        """One position: x (B, dim); ``caches`` holds one dict per layer function; kwargs_for(kind, context)
        gives the step keyword arguments (padding_t, context, context_padding)."""
        return self._cached_pass(x, caches, kwargs_for, context, lambda fn, y, cache, kw: fn.step(y, cache, t, **kw))

    def _cached_pass(self, x, caches: list, kwargs_for: Callable, context, call: Callable):
        """The layer loop of prefill and step: call(fn, input, cache, kwargs) runs one layer function."""
        if not caches:
            caches.extend({} for _ in range(2 * len(self.layers)))
        x1 = x2 = x
        for i, ((f, g), kind) in enumerate(zip(self.layers, self.kinds)):
            fk, gk = kwargs_for(kind, context)
            if self.reversible:
                x1 = x1 + call(f, x2, caches[2 * i], fk)
                x2 = x2 + call(g, x1, caches[2 * i + 1], gk)
            else:
                x1 = x1 + call(f, x1, caches[2 * i], fk)
                x1 = x1 + call(g, x1, caches[2 * i + 1], gk)
        return (x1 + x2) / 2 if self.reversible else x1
