"""Multi-query associative recall (MQAR) sequences, as Zoology defines the task (Arora, Eyuboglu et al. 2023,
"Zoology: Measuring and Improving Recall in Efficient Language Models"), generated here.

A sequence of ``seq_len`` tokens opens with ``num_kv_pairs`` key-value pairs, ``k1 v1 k2 v2 ...``: keys drawn from
the lower half of the vocabulary (token 0 left out), values from the upper half, each distinct within its sequence.
The rest is the query region. Its even offsets are slots; every key is asked exactly once, in a slot drawn without
replacement with weight ``i ** (power_a - 1)`` for the i-th slot (counted from 1): with Zoology's power_a = 0.01 the
near slots are far likelier, as the gap between repeats of a bigram in text follows a power law. Every other
position holds a random token of the whole vocabulary. At a query the next-token target is the value bound to the
key; every other position's target is IGNORE (-100, what ``F.cross_entropy``'s ``ignore_index`` skips), so a model
is scored on recall alone.

    Zoology's example (vocab 12, 2 pairs, 16 tokens; . = a random token):
    inputs   2    8    4    7    .    .    4    .    .    .    .    .    2    .    .    .
    targets  -    -    -    -    -    -    7    -    -    -    -    -    8    -    -    -
"""
import torch

POWER_A = 0.01  # Zoology's power law of the query placement
IGNORE = -100   # the target of every position that is not a query
CHUNK = 1024    # sequences generated at a time: the draws of distinct keys take (CHUNK, vocab / 2) floats


def check_task(vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float = POWER_A, *,
               names=("vocab_size", "seq_len", "num_kv_pairs")) -> None:
    """Raise ValueError naming the argument (``names``: what the caller calls vocab, length and pairs, e.g. its
    command-line flags) when these settings cannot make an MQAR sequence."""
    vocab_name, seq_name, pairs_name = names
    if isinstance(num_kv_pairs, bool) or not isinstance(num_kv_pairs, int) or num_kv_pairs < 1:
        raise ValueError(f"{pairs_name} must be a positive int, got {num_kv_pairs!r}")
    if seq_len < 4 * num_kv_pairs:  # 2 tokens per pair, then a slot (every other position) per query
        raise ValueError(f"{seq_name} {seq_len} is too short for {num_kv_pairs} key-value pairs: the pairs take "
                         f"{2 * num_kv_pairs} tokens and their queries {num_kv_pairs} slots of 2 after them, so "
                         f"{seq_name} must be >= 4 x {pairs_name} = {4 * num_kv_pairs}")
    if vocab_size // 2 - 1 < num_kv_pairs:  # distinct keys in [1, vocab / 2), distinct values in [vocab / 2, vocab)
        raise ValueError(f"{vocab_name} {vocab_size} is too small for {num_kv_pairs} key-value pairs: keys come "
                         f"from [1, {vocab_name} // 2) and values from the upper half, distinct within a sequence, "
                         f"so {vocab_name} must be >= 2 x ({pairs_name} + 1) = {2 * (num_kv_pairs + 1)}")
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0 (1 places queries uniformly), got {power_a!r}")


def slot_weights(slots: int, power_a: float = POWER_A) -> torch.Tensor:
    """(slots,) float64: the unnormalised probability of each query slot, i ** (power_a - 1) for i = 1..slots."""
    return torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)


def _distinct(count: int, low: int, high: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, count): per row, ``count`` distinct tokens of [low, high) in random order (where the largest of
    ``high - low`` uniform draws fall: a uniform subset; topk, not a full sort, as count is small)."""
    return low + torch.rand(rows, high - low, generator=gen).topk(count, dim=1).indices


def mqar_examples(vocab_size: int, seq_len: int, num_kv_pairs: int, num_examples: int, seed: int,
                  power_a: float = POWER_A, dtype=torch.int32):
    """-> inputs, targets, each (num_examples, seq_len) of ``dtype``: the same sequences for the same arguments
    (a generator of its own seeded with ``seed``; the global RNG is untouched). targets[b, t] is the token that
    should follow inputs[b, t]: the bound value at a query, IGNORE elsewhere."""
    check_task(vocab_size, seq_len, num_kv_pairs, power_a)
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    gen = torch.Generator().manual_seed(seed)
    pairs, half = num_kv_pairs, vocab_size // 2
    context = 2 * pairs
    weights = slot_weights((seq_len - context) // 2, power_a)
    inputs, targets = [], []
    for start in range(0, num_examples, CHUNK):
        rows = min(CHUNK, num_examples - start)
        keys = _distinct(pairs, 1, half, rows, gen)                   # (rows, pairs)
        values = _distinct(pairs, half, vocab_size, rows, gen)        # (rows, pairs), values[:, i] bound to keys[:, i]
        slots = torch.multinomial(weights.expand(rows, -1), pairs, replacement=False, generator=gen)  # (rows, pairs)
        query_at = context + 2 * slots                                # positions of the queries of keys[:, i]
        x = torch.randint(vocab_size, (rows, seq_len), generator=gen)  # the filler
        x[:, 0:context:2], x[:, 1:context:2] = keys, values
        x.scatter_(1, query_at, keys)
        y = torch.full((rows, seq_len), IGNORE, dtype=torch.long).scatter_(1, query_at, values)
        inputs.append(x.to(dtype))
        targets.append(y.to(dtype))
    return torch.cat(inputs), torch.cat(targets)
