"""The error for malformed inputs to an nn.MultiheadAttention-style call."""


class InputError(ValueError, AssertionError):
    """A malformed input (a shape, a mask's shape): a ValueError whose message names the argument and the fix, and an
    AssertionError too, which is what torch.nn.MultiheadAttention raises for the same input, so code written against
    torch that catches that keeps working with the drop-in."""
