"""Helpers of the tests of the benchmark and the tools beside it (test_benchmark_tool.py, test_benchmark_peers.py,
test_ab_and_profile_tools.py)."""
import pytest
import torch

QUICK = ["--quick", "--threads", "1"]


@pytest.fixture(scope="module", autouse=True)
def keep_global_torch_state():
    """The benchmark pins threads and seeds torch's RNG in-process; other test modules must not inherit that."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        yield
    torch.set_num_threads(threads)


def by_key(result):
    return {r["key"]: r for r in result["records"]}
