"""q, k and v split from one projection, with their gradients gathered back without a copy.

A module projects its input once into (B, N, P·H·d) for P = 3 (q, k, v) or 2 (k, v; or q, k) and splits it into P
tensors of (B, H, N, d). Through torch's own ``chunk`` the backward of the split concatenates the P gradients into
a new (B, N, P·H·d) tensor: about 5% of a compiled method's forward + backward at N = 16k (docs/benchmarks.md,
"Where a module's time goes"). ``split_heads`` makes the same views, and its backward hands the projection the
gradients' own memory when they already lie side by side as the projection's output does. The compiled backward
writes them so (``packed_outputs``) whenever its q, k, v are such a split; other backwards' gradients are gathered
as before.
"""
import sys
import weakref
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._common import compiling, functorch_active


def split_heads(packed: Tensor, parts: int, heads: int, again: Sequence[int] = (),
                own_gradients: bool = False) -> Tuple[Tensor, ...]:
    """packed (B, N, parts·heads·d) -> parts tensors of (B, heads, N, d), views of packed, then the parts listed in
    ``again`` once more (views of their own under autograd, the same tensors without it). Differentiable; the
    backward returns the gradients' own memory where they are views of one (B, N, parts, heads, d) tensor.

    A part handed out again is for a second consumer, such as a module's output gate (q) or local term (v): its two
    gradients then reach the split apart instead of being summed by autograd, which makes the sum a new tensor (the
    gradients are not contiguous, so torch never sums them in place) and leaves the split a part to copy back. They
    are summed as autograd would, unless ``own_gradients``: the caller promises that no hook, ``retain_grad`` or
    ``autograd.grad`` input can see the parts' gradients (the parts never leave it), and the split then adds the
    second into the first in place when the first is a slot of a block a compiled backward made for this split
    (``_second_gradients_added``). The modules' own q, k and v are such parts."""
    if packed.dim() != 3 or packed.shape[-1] % (parts * heads):
        raise ValueError(f"packed must be (B, N, {parts}·heads·d) with heads={heads}; got {tuple(packed.shape)}")
    again = tuple(again)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < parts for i in again):
        raise ValueError(f"again must list parts of the split, ints in [0, {parts}); got {again}")
    if torch.is_grad_enabled() and packed.requires_grad and not (compiling() or functorch_active()):
        return _SplitHeads.apply(packed, parts, heads, again, bool(own_gradients))
    views = _views(packed, parts, heads)
    return views + tuple(views[i] for i in again)


def _views(packed: Tensor, parts: int, heads: int) -> Tuple[Tensor, ...]:
    split = packed.unflatten(-1, (parts, heads, packed.shape[-1] // (parts * heads)))  # (B, N, P, H, d)
    return tuple(split.select(2, i).transpose(1, 2) for i in range(parts))


def gathered(grads: Sequence[Optional[Tensor]]) -> Optional[Tensor]:
    """The (B, N, P·H·d) tensor whose split the grads ((B, H, N, d) each) are, without a copy, or None if they are
    not views of one such tensor (missing, another layout, other memory)."""
    first = grads[0]
    if any(g is None for g in grads) or first.dim() != 4:
        return None
    b, h, n, d = first.shape
    sb, sh, sn, sd = first.stride()
    if sd != 1 or (h > 1 and sh != d) or (n > 1 and sn < len(grads) * h * d):  # rows of the whole must not overlap
        return None
    size = first.element_size()
    for i, g in enumerate(grads):
        if (g.shape != first.shape or g.stride() != first.stride() or g.dtype != first.dtype
                or g.device != first.device or g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or g.data_ptr() != first.data_ptr() + i * h * d * size):
            return None
    return first.as_strided((b, n, len(grads) * h * d), (sb, sn, 1))


class HandedBlock:
    """A block ``packed_outputs`` made for one split's parts, as that split's backward node keeps it: weak references
    to the part views handed out, so a graph kept alive (retain_graph) or a backward that never reaches the split
    holds no memory."""
    __slots__ = ("slots",)

    def __init__(self, slots: Sequence[Tensor]):
        self.slots = tuple(weakref.ref(t) for t in slots)

    def alive(self) -> bool:
        return any(slot() is not None for slot in self.slots)


def filled_block(grads: Sequence[Optional[Tensor]], heads: int, handed: Sequence[HandedBlock]) -> Optional[Tensor]:
    """The (B, N, P·H·d) block that one of the grads is a view of, with every other part written into its place, or
    None. A part reaches the split's backward as a new tensor when autograd has summed two consumers' gradients (the
    local term's d v and attention's, the output gate's d q and attention's); copying it into the block costs one
    part, gathering all of them again costs P. A slot is written only when nothing can see it any more: the block
    is one a compiled backward handed to this very split (``packed_outputs``; any other memory may be the caller's
    own gradient), the gradient that backward wrote there is gone (autograd has summed it into the new part, and no
    hook kept it), and every part is given (a part left out may lie in another split's block)."""
    parts = len(grads)
    for i, g in enumerate(grads):
        # the part must be the very view handed out (torch keeps a tensor's Python object while its memory lives)
        entry = next((e for e in handed if g is not None and len(e.slots) == parts and e.slots[i]() is g), None)
        whole = None if entry is None else _own_block(g, i, parts, heads)
        if whole is None:
            continue
        slots = _views(whole, parts, heads)
        storage = whole.untyped_storage().data_ptr()
        moved = [j for j, (slot, part) in enumerate(zip(slots, grads)) if not _is_view(part, slot)]
        if any(grads[j] is None or entry.slots[j]() is not None or grads[j].untyped_storage().data_ptr() == storage
               or grads[j].dtype != whole.dtype or grads[j].device != whole.device for j in moved):
            return None
        for j in moved:
            slots[j].copy_(grads[j])
        return whole
    return None


def _own_block(g: Optional[Tensor], slot: int, parts: int, heads: int) -> Optional[Tensor]:
    """The (B, N, parts·H·d) view of g's storage if that storage is exactly a block of parts (B, H, N, d) tensors
    laid side by side (as ``packed_outputs`` makes them) and g is its part ``slot``, else None."""
    if g is None or g.dim() != 4 or g.shape[1] != heads:
        return None
    b, h, n, d = g.shape
    sb, sh, sn, sd = g.stride()
    width = parts * h * d
    start = g.storage_offset() - slot * h * d
    if sd != 1 or (h > 1 and sh != d) or start != 0 or g.untyped_storage().nbytes() != b * n * width * g.element_size():
        return None
    if not ((n == 1 or sn == width) and (b == 1 or sb == n * width)) and \
            not ((b == 1 or sb == width) and (n == 1 or sn == b * width)):  # (B, N, ...) or (N, B, ...) in memory
        return None
    return g.as_strided((b, n, width), (sb, sn, 1), 0)


def _is_view(part: Optional[Tensor], slot: Tensor) -> bool:
    return part is not None and part.data_ptr() == slot.data_ptr() and part.stride() == slot.stride() \
        and part.shape == slot.shape and part.dtype == slot.dtype


def packed_outputs(like: Tensor, parts: int, b: int, h: int, n: int, d: int, new,
                   inputs: Sequence[Tensor] = ()) -> Tuple[Tensor, ...]:
    """parts fresh (B, H, N, d) tensors, views of one (B, N, parts, H, d) made by ``new(like, *shape)``, so that
    ``gathered`` finds them side by side. Laid out as like's projection: positions outermost when like's batch
    entries lie within its positions (a (L, B, E) input seen batch-major), so the projection's backward reads the
    block as one matrix. When ``inputs``, the tensors whose gradients the parts are, are all the parts of one
    ``split_heads``, the block is handed to that split's backward, the only memory ``filled_block`` may write."""
    if b > 1 and n > 1 and like.stride(0) < like.stride(2):
        whole = new(like, n, b, parts, h, d).transpose(0, 1)
    else:
        whole = new(like, b, n, parts, h, d)
    views = tuple(whole.select(2, i).transpose(1, 2) for i in range(parts))
    node = like.grad_fn  # a split's backward node is its ctx
    whole_split = inputs and getattr(node, "parts", None) == parts and all(t.grad_fn is node for t in inputs)
    handed = getattr(node, "packed_blocks", None) if whole_split else None  # k, v of a q, k, v split: not its block
    if isinstance(handed, list):
        handed[:] = [entry for entry in handed if entry.alive()]
        handed.append(HandedBlock(views))
    return views


def is_split(tensors: Sequence[Tensor]) -> bool:
    """Whether these (B, H, N, d) tensors are the views ``split_heads`` makes of one projection: their gradients
    are then worth writing side by side (``packed_outputs``)."""
    first = tensors[0]
    if first.dim() != 4 or first.stride(-1) != 1 or first.stride(1) != first.shape[-1]:
        return False
    step = first.shape[1] * first.shape[-1] * first.element_size()
    return all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
               and t.data_ptr() == first.data_ptr() + i * step for i, t in enumerate(tensors))


def _references(grads: Sequence[Optional[Tensor]]) -> Tuple[int, ...]:
    """The Python references to each gradient as a backward's arguments hold them (``_alone_references``)."""
    return tuple(sys.getrefcount(g) for g in grads)


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, *grads):
        ctx.counts = _references(grads)  # taken first, as _SplitHeads.backward takes them
        return grads[0]


def _alone_references() -> int:
    """How many references a backward's gradient argument has when nothing but autograd holds it, measured on a
    gradient no hook can have seen, here and now: the count depends on the interpreter, on torch and on what is
    running (a dispatch mode that keeps op outputs adds one to every gradient), so it is taken in the same
    context as the gradients it is set against, at the cost of a backward of one value."""
    with torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        y = _Probe.apply(x)
        (y * 2).sum().backward()
        return y.grad_fn.counts[0]


def _block_of_this_split(grads: Sequence[Optional[Tensor]], handed: Sequence[HandedBlock]) -> Optional[Tensor]:
    """The (B, N, P·H·d) block the parts' gradients are, when it is one a compiled backward handed to this split
    and every part is the very view it wrote (``packed_outputs``), else None."""
    whole = gathered(grads)
    if whole is None or not any(len(e.slots) == len(grads) and all(e.slots[i]() is g for i, g in enumerate(grads))
                                for e in handed):
        return None
    return whole


def _with_again(views: Tuple[Tensor, ...], again: Sequence[int]) -> Tuple[Tensor, ...]:
    """The views, then those listed in again as new views of the same memory (a Function's outputs must be
    distinct tensors)."""
    return views + tuple(views[i].view_as(views[i]) for i in again)


class _SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, parts, heads, again, own_gradients):
        ctx.shape, ctx.parts, ctx.heads, ctx.again, ctx.own_gradients = packed.shape, parts, heads, again, own_gradients
        ctx.packed_blocks = []  # HandedBlock: where compiled backwards wrote this split's gradients (packed_outputs)
        return _with_again(_views(packed, parts, heads), again)

    @staticmethod
    def jvp(ctx, packed_tangent, *_):  # forward-mode AD: the tangents split as the values are
        return _with_again(_views(packed_tangent, ctx.parts, ctx.heads), ctx.again)

    @staticmethod
    def backward(ctx, *grads):
        # first: any other name for a gradient below would count. A graph being recorded (compiled autograd)
        # holds proxies, whose counts mean nothing: there the sums are made apart.
        references = None if compiling() else _references(grads)
        # A gradient that is itself differentiated (create_graph) must keep every part's history: as_strided on
        # the first part would drop the others', so then the parts are stacked.
        keeps_history = torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads)
        handed, ctx.packed_blocks = ctx.packed_blocks, []
        grads = _second_gradients_added(ctx, list(grads), references, handed, keeps_history)
        whole = None if keeps_history else gathered(grads)
        if whole is None and not keeps_history:
            whole = filled_block(grads, ctx.heads, handed)
        if whole is None:
            b, n, width = ctx.shape
            like = next(g for g in grads if g is not None)
            filled = [g if g is not None else like.new_zeros(like.shape) for g in grads]
            whole = torch.stack([g.transpose(1, 2) for g in filled], dim=2).reshape(b, n, width)
        return whole, None, None, None, None


def _second_gradients_added(ctx, grads: list, references: Optional[Sequence[int]], handed: Sequence[HandedBlock],
                            keeps_history: bool) -> list:
    """The parts' gradients with those of the parts handed out again (``split_heads``' again) added in. In place,
    into the first gradient's own memory, only where the caller owns the parts' gradients (``own_gradients``), the
    first is a slot of a block a compiled backward made for this split, and it has no more Python references than
    a gradient nothing but autograd holds: that last check catches a hook that kept the gradient itself, not one
    that kept a view of it, which is why the in-place sum is for callers whose parts no hook can reach. Everywhere
    else the two are summed into a new tensor, as autograd sums them."""
    parts, seconds = grads[:ctx.parts], grads[ctx.parts:]
    if not any(g is not None for g in seconds):
        return parts
    owned = ctx.own_gradients and references is not None
    block = None if keeps_history or not owned else _block_of_this_split(parts, handed)
    alone = _alone_references() if block is not None else None
    for i, second in zip(ctx.again, seconds):
        if second is None:
            continue
        first = parts[i]
        if first is None:
            parts[i] = second
        elif block is not None and references[i] <= alone and first.dtype == second.dtype:
            first.add_(second)
        else:
            parts[i] = first + second
    return parts
