"""Pure attention functions on (batch, heads, seq, dim) tensors: one method per module."""
