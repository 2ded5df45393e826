"""dqsgd.ddp.HookState without processes: bucket bookkeeping, checkpoints, predicted sizes."""

import io
import pickle

import pytest
import torch

from dqsgd.codecs import PayloadError
from dqsgd.core.sharding import shard_bounds
from dqsgd.ddp import HookState
from dqsgd.kernels import HashRNG
from dqsgd.method.pipeline import ProtocolError
from dqsgd.topology import payloads as codec

SIZES = [4064, 127, 1270, 10]  # 5471 elements
N = sum(SIZES)


def test_shards_follow_shard_bounds_and_sizes_are_predicted() -> None:
    s = HookState("qsgd-4bit", topology="sharded")
    b = s.bucket(0, torch.zeros(N), SIZES, rank=1, world=3)
    assert b.bounds == shard_bounds(N, 3) and [m.numel for m in b.shards] == [1824, 1824, 1823]
    assert [m.layout.sizes for m in b.shards] == [None] * 3  # qsgd: one scale per shard (bucket layout)
    g = torch.randn(N, generator=torch.Generator().manual_seed(0))
    for j, ((lo, hi), m) in enumerate(zip(b.bounds, b.shards)):
        p, _ = codec.encode_shard(m, g[lo:hi], 4, b.proto.uplink_rng(0, 1, j), b.generator, None, None)
        assert p.dtype == torch.uint8 and p.numel() == m.message_bits(4) // 8
        d = codec.encode_downlink(m, g[lo:hi], 8, b.proto.downlink_rng(0, j))
        assert d.numel() == codec.downlink_size(m, 8)
        assert codec.encode_downlink(m, g[lo:hi], codec.FP32, HashRNG(1, 0, 0)).numel() == codec.downlink_size(m, 32)


def test_per_tensor_layout_restarts_in_each_shard() -> None:
    b = HookState("terngrad").bucket(0, torch.zeros(N), SIZES, rank=0, world=2)
    assert [m.layout.sizes for m in b.shards] == [(2736,), (1328, 127, 1270, 10)]


def test_reordered_bucket_keeps_policy_and_step() -> None:
    s = HookState("dqsgd")
    b = s.bucket(0, torch.zeros(N), SIZES, 0, 2)
    b.step, policy = 5, b.policy
    b2 = s.bucket(0, torch.zeros(N), SIZES[::-1], 0, 2)  # DDP's rebuilt order
    assert b2 is b and b.step == 5 and b.policy is policy and b.method.numel == N
    assert s.bucket(0, torch.zeros(N + 1), [N + 1], 0, 2).step == 0  # another size: a fresh bucket


def test_state_dict_round_trip_and_pickle() -> None:
    s = HookState("dqsgd", seed=4, total_steps=50, downlink_bits="fp32", start_iter=2)
    b = s.bucket(0, torch.zeros(N), SIZES, 0, 2)
    b.step = 3
    b.record(torch.randn(N), 2, 1000, torch.tensor(False))
    s.bytes_sent, s.iter = 123, 7
    buf = io.BytesIO()
    torch.save(s, buf)  # no process group is pickled
    buf.seek(0)
    t = torch.load(buf, weights_only=False)
    assert t.downlink_bits == 32 and t.start_iter == 2 and t.iter == 7 and t.bytes_sent == 123
    u = pickle.loads(pickle.dumps(s))
    for x in (t, u):
        c = x.bucket(0, torch.zeros(N), SIZES, 0, 2)
        assert c.step == 3 and len(c.pending) == 1
        c.catch_up(2)
        b.catch_up(2)
        assert c.policy == b.policy and c.bits == b.bits
    with pytest.raises(ValueError, match="elements"):
        v = HookState("dqsgd", seed=4, total_steps=50, downlink_bits="fp32")
        v.load_state_dict(s.state_dict())
        v.bucket(0, torch.zeros(N + 3), [N + 3], 0, 2)


def test_resume_into_a_permuted_first_bucket_warns() -> None:
    s = HookState("dqsgd")
    s.bucket(0, torch.zeros(N), SIZES[::-1], 0, 2).step = 4
    t = HookState("dqsgd")
    t.load_state_dict(s.state_dict())
    with pytest.warns(UserWarning, match="parameter order"):
        b = t.bucket(0, torch.zeros(N), SIZES, 0, 2)
    assert b.step == 4


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("method", ["qsgd-4bit", "qsgd-8bit", "dqsgd"])
def test_in_place_messages_are_the_concatenated_shard_payloads(world: int, method: str) -> None:
    """The send buffer the CPU hook encodes in place holds, byte for byte, every encode_shard payload
    followed by its flag; the padded downlink is the padded encode_downlink; decoding with the
    expected header adds the same bits as parsing it."""
    n = 8 * 1001 + 5  # not divisible by W
    b = HookState(method).bucket(0, torch.zeros(n), [n], rank=1, world=world)
    g = torch.randn(n, generator=torch.Generator().manual_seed(world))
    for bits in (2, 4, 11):
        rngs = [b.proto.uplink_rng(3, 1, j) for j in range(world)]
        send, sizes = codec.encode_messages(b.shards, b.bounds, g, bits, rngs)
        payloads = [codec.encode_shard(m, g[lo:hi], bits, r, b.generator, None, None)[0]
                    for (lo, hi), m, r in zip(b.bounds, b.shards, rngs)]
        flag = torch.tensor([codec.FLAG_NONFINITE], dtype=torch.uint8)
        views = codec.set_flags(send, sizes, codec.FLAG_NONFINITE)
        assert torch.equal(send, codec.messages(payloads, flag))
        assert all(torch.equal(v, p) for v, p in zip(views, payloads))
        for j, ((lo, hi), m) in enumerate(zip(b.bounds, b.shards)):
            want = codec.encode_downlink(m, g[lo:hi], 8, b.proto.downlink_rng(3, j))
            padded, size = codec.encode_downlink_padded(m, g[lo:hi], 8, b.proto.downlink_rng(3, j), want.numel() + 3)
            assert size == want.numel() and torch.equal(padded, codec.pad(want, want.numel() + 3))
            parsed, planned = torch.zeros(hi - lo), torch.zeros(hi - lo)
            codec.decode_accumulate_payload(payloads[j], parsed, max_numel=hi - lo)
            h = codec.decode_accumulate_payload(payloads[j], planned, max_numel=hi - lo, expect=(bits, m.norm, m.layout))
            assert h.numel == hi - lo and torch.equal(parsed.view(torch.int32), planned.view(torch.int32))


def test_received_payload_of_another_width_is_refused_as_before() -> None:
    """A payload that is valid but not of the expected width is parsed and refused by the uplink check."""
    b = HookState("qsgd-4bit").bucket(0, torch.zeros(1000), [1000], rank=0, world=2)
    m = b.shards[0]
    p, _ = codec.encode_shard(m, torch.randn(m.numel), 5, HashRNG(0, 0, 0), b.generator, None, None)
    with pytest.raises(ProtocolError, match="at 4 bits, got UNIFORM with 500 values at 5 bits"):
        codec.accumulate(m, [p], 4, torch.zeros(m.numel))
    bad = p.clone()
    bad[-1] ^= 1
    with pytest.raises(PayloadError, match="worker 0: crc mismatch"):
        codec.accumulate(m, [bad], 5, torch.zeros(m.numel))


def test_cached_sizes_follow_width_and_new_shards() -> None:
    s = HookState("terngrad", downlink_bits=3, allow_unsafe_downlink=True)  # per-tensor layout: a reordered bucket's shards have other segments
    b = s.bucket(0, torch.zeros(N), SIZES, rank=0, world=2)
    for width in (2, 5, 2):
        assert b.uplink_bytes(width) == sum(m.message_bits(width) for m in b.shards) // 8
    assert b.proto.down_sizes() == [codec.downlink_size(m, 3) for m in b.shards]
    before = b.proto.down_sizes()
    b2 = s.bucket(0, torch.zeros(N), SIZES[::-1], rank=0, world=2)
    assert b2 is b and b.proto.down_sizes() == [codec.downlink_size(m, 3) for m in b.shards] != before

def test_state_saved_under_another_config_is_refused_naming_the_keys() -> None:
    """A HookState saved at 8 bits is not loaded into a 2-bit config of the same method name."""
    from dqsgd.method.config import method_config

    saved = HookState(method_config("qsgd", bits=8)).state_dict()
    with pytest.raises(ValueError, match=r"method.bits: 8 saved, 2 here"):
        HookState(method_config("qsgd", bits=2)).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"topology: 'sharded' saved, 'allgather' here"):
        HookState(method_config("qsgd", bits=8), topology="allgather").load_state_dict(saved)
    HookState(method_config("qsgd", bits=8), start_iter=3).load_state_dict(saved)  # warm-up may change


def test_fingerprint_names_differing_and_missing_fields_with_a_fixed_size() -> None:
    """The rank fingerprint: every rank sends the same number of integers whatever its fields, and
    every rank raises naming the fields that differ (or that one rank lacks)."""
    from agree_threads import agree_all
    from dqsgd.topology.agreement import SLOTS, RankDisagreement, fingerprint

    a = {"train.lr": 0.1, "train.checkpoint_every": 4, "method.bits": 4}
    b = {"train.lr": 0.1, "train.checkpoint_every": 6, "method.bits": 4, "train.extra": 1}
    assert len(fingerprint(a)) == len(fingerprint(b)) == SLOTS
    for e in agree_all([a, b]):
        assert isinstance(e, RankDisagreement) and "train.checkpoint_every" in str(e), e
    assert all(isinstance(e, RankDisagreement) and ("does not have" in str(e) or "train.extra" in str(e))
               for e in agree_all([a, {**a, "train.extra": 1}]))
    assert agree_all([a, dict(a)]) == [None, None]  # the same everywhere: no error


def test_downlink_coding_defaults_pickles_and_guards_checkpoints() -> None:
    """The coded downlink: the uplink's coding by default, kept by pickling, part of the saved
    configuration (an older state, saved without it, meant a fixed downlink), refused where nothing is
    quantized; a coded step's spend (bits, downlink bits) survives a checkpoint."""
    coded = HookState("dqsgd-coded", total_steps=20)
    assert coded.downlink.coding == "auto" and coded.fields()["downlink_coding"] == "auto"
    assert HookState("qsgd-4bit").downlink.coding == "fixed"
    assert HookState("qsgd-4bit", downlink_coding="rans").downlink.coding == "rans"
    assert pickle.loads(pickle.dumps(HookState("qsgd-4bit", downlink_coding="ransx"))).downlink.coding == "ransx"
    with pytest.raises(ValueError, match="an fp32 downlink"):
        HookState("qsgd-4bit", downlink_bits="fp32", downlink_coding="auto")
    with pytest.raises(ValueError, match="downlink_coding must be one of"):
        HookState("qsgd-4bit", downlink_coding="huffman")
    old = HookState("qsgd-4bit").state_dict()
    del old["fields"]["downlink_coding"]
    HookState("qsgd-4bit").load_state_dict(old)  # fixed then, fixed now
    old = coded.state_dict()
    del old["fields"]["downlink_coding"]
    with pytest.raises(ValueError, match="downlink_coding: 'fixed' saved, 'auto' here"):
        HookState("dqsgd-coded", total_steps=20).load_state_dict(old)
    HookState("dqsgd-coded", total_steps=20, downlink_coding="fixed").load_state_dict(old)
    b = coded.bucket(0, torch.zeros(N), SIZES, 0, 2)
    b.record(torch.randn(N), 0, (9000, 4000), torch.tensor(False))
    c = pickle.loads(pickle.dumps(coded)).bucket(0, torch.zeros(N), SIZES, 0, 2)
    assert c.pending[0][2] == (9000, 4000)
    c.catch_up(0)
    b.catch_up(0)
    assert c.policy == b.policy and c.policy.spent == 9000 and c.policy.down_ratio > 0


@pytest.mark.parametrize("downlink_bits", ["auto", 8])
def test_coded_record_keeps_the_entropy_sample_and_learns_as_from_the_bucket(downlink_bits: object) -> None:
    """The coded budget reads G through a fixed-stride sample of ≤ 65,536 coordinates: the bucket
    keeps that sample alone, and the policy's next state is the one the whole bucket gives."""
    from dqsgd.policies.base import grad_stats

    n = 200_003  # stride 4: the sample has 50,001 coordinates
    s = HookState("dqsgd-coded", total_steps=20, downlink_bits=downlink_bits)
    b = s.bucket(0, torch.zeros(n), [n], 0, 2)
    g = torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 1.0, n)
    b.record(g, 0, 90_000, torch.tensor(False))
    kept = b.pending[0][3]
    assert kept is not None and kept.numel() == 50_001 and torch.equal(kept, g[::4])
    whole = b.proto.policy.update(b.policy, grad_stats(g, 0, 90_000, b.method.p, keep=True))
    b.catch_up(0)
    assert b.policy == whole and b.policy.entropy  # bit for bit: the same entropies, widths and spend


def test_a_policy_that_reads_all_of_g_keeps_the_bucket() -> None:
    s = HookState("adaqs")
    b = s.bucket(0, torch.zeros(N), SIZES, 0, 2)
    g = torch.randn(N)
    b.record(g, 0, 1000, torch.tensor(False))
    assert torch.equal(b.pending[0][3], g)


def test_repr_names_method_budget_topology_and_downlink() -> None:
    """A state printed in a training log says what it runs (the default object repr said nothing)."""
    assert repr(HookState("qsgd-4bit", topology="sharded", downlink_bits=8)) == (
        "<HookState method='qsgd-4bit' (4 bits), topology=sharded, downlink=8, total_steps=1000, steps=0>")
    assert "topology=allgather, downlink=none" in repr(HookState("qsgd-4bit", topology="allgather"))
    assert "target 4.5 bits/coordinate" in repr(HookState("dqsgd", total_steps=10))


def test_the_default_dqsgd_is_the_stated_budget_and_the_link_policy_is_opt_in() -> None:
    """HookState("dqsgd") / ("dqsgd-coded") run their stated budgets (the both-leg "auto" downlink on
    sharded, nothing to measure); the link policy runs only when asked for (dqsgd-link), measuring the link
    at the first call only with link_mbit 0."""
    from dqsgd.method.config import method_config

    for name, policy, target in (("dqsgd", "dqsgd-budget", 4.5), ("dqsgd-coded", "dqsgd-coded", 1.0)):
        s = HookState(name, total_steps=10)
        assert (s.config.name, s.config.policy, s.config.target_bits, s.config.link_mbit) == (name, policy, target, 0.0)
        assert s.downlink_bits == "auto" and s.link is None
    link = HookState(method_config("dqsgd-link", link_mbit=0.0))
    assert (link.config.policy, link.config.link_mbit, link.link) == ("link", 0.0, None)  # measured at the first call
    assert HookState("dqsgd-link").config.link_mbit == 100.0  # the preset states its link
