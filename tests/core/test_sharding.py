import pytest

from dqsgd.core.sharding import shard_bounds, shard_sizes


@pytest.mark.parametrize("numel,world", [(0, 1), (0, 3), (1, 4), (10, 3), (12, 4), (1001, 16), (7, 7)])
def test_shards_cover_in_order_and_differ_by_at_most_one(numel, world):
    b = shard_bounds(numel, world)
    assert len(b) == world and b[0][0] == 0 and b[-1][1] == numel
    assert all(b[i][1] == b[i + 1][0] for i in range(world - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("numel,world", [(-1, 2), (3, 0), (3, True), (2.0, 2)])
def test_bad_arguments_are_refused(numel, world):
    with pytest.raises(ValueError):
        shard_bounds(numel, world)


def test_shard_sizes_cut_tensors_at_shard_edges():
    sizes = [3, 5, 2]
    assert shard_sizes(sizes, 0, 10) == (3, 5, 2)
    assert shard_sizes(sizes, 2, 7) == (1, 4)
    assert shard_sizes(sizes, 3, 8) == (5,)
    assert shard_sizes(sizes, 4, 4) == ()
    for lo, hi in shard_bounds(10, 3):
        assert sum(shard_sizes(sizes, lo, hi)) == hi - lo
    with pytest.raises(ValueError):
        shard_sizes(sizes, 5, 11)
