"""The entropy-coded downlink: lossless (the same update as the fixed downlink, bit for bit), never
larger than fixed with coding auto, validated like the fixed one, charged its real bytes under a
both-leg budget (never overspent), and its defaults and refusals."""

from __future__ import annotations

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method, ProtocolError
from dqsgd.topology.bucket import BucketProtocol
from dqsgd.topology.downspec import downlink_of
from dqsgd.topology.exchange import in_process
from dqsgd.topology.downlink import resolve_downlink_coding
from dqsgd.train.trainer import Trainer

DATA = load_dataset("synthetic")


def _proto(coding: str | None, dbits: int | str = 8, feedback: bool = False, numel: int = 30_001, workers: int = 4,
           name: str = "qsgd-4bit") -> BucketProtocol:
    cfg = method_config(name)
    return BucketProtocol(cfg, numel, [numel - 1, 1], topology="sharded", workers=workers, seed=3, total_steps=10,
                          spec=downlink_of({"downlink_bits": dbits, "downlink_feedback": feedback, "downlink_coding": coding,
                                            "allow_unsafe_downlink": True}, cfg, "sharded"))


def _grads(numel: int, workers: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4 for _ in range(workers)]


@pytest.mark.parametrize("dbits", [2, 4, 8, 12])
@pytest.mark.parametrize("coding", ["auto", "rans", "ransx", "elias", "zstd"])
def test_coded_downlink_gives_the_fixed_downlinks_update_bitwise(dbits: int, coding: str) -> None:
    fixed, coded = _proto("fixed", dbits, feedback=dbits < 4), _proto(coding, dbits, feedback=dbits < 4)
    assert not fixed.coded_down and coded.coded_down
    grads = _grads(30_001, 4)
    for step in range(2):
        want = in_process(fixed, grads, 4, step)
        got = in_process(coded, grads, 4, step)
        assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (coding, dbits, step)


@pytest.mark.parametrize("dbits", [4, 8, 16])
def test_auto_coded_payload_never_exceeds_the_fixed_one(dbits: int) -> None:
    P = _proto("auto", dbits)
    grads = _grads(30_001, 4, seed=1)
    avg = [P.reduce(j, [P.encode(w, g, 4, 0, None)[0][j] for w, g in enumerate(grads)], 4) for j in range(4)]
    sizes = [P.encode_down(j, a, 0, dbits=dbits).numel() for j, a in enumerate(avg)]
    assert all(n <= cap for n, cap in zip(sizes, P.down_caps(dbits)))
    assert P.down_caps(dbits) == P.down_sizes(dbits)  # auto: the fixed size is the cap
    if dbits >= 8:  # heavy-tailed values: most codes are near 0, the coded payload is far smaller
        assert sum(sizes) < 0.8 * sum(P.down_sizes(dbits)), (sizes, P.down_sizes(dbits))


def test_error_fed_coded_downlink_keeps_the_same_residuals() -> None:
    fixed, coded = _proto("fixed", 2, feedback=True), _proto("auto", 2, feedback=True)
    avg = _grads(fixed.shards[0].numel, 1, seed=2)[0]
    res_f = res_c = None
    for step in range(3):
        pf, res_f = fixed.encode_down_fed(0, avg, step, res_f, dbits=2)
        pc, res_c = coded.encode_down_fed(0, avg, step, res_c, dbits=2)
        assert torch.equal(res_f, res_c) and pc.numel() <= pf.numel()


@pytest.mark.parametrize("coding", ["elias", "rans"])
def test_a_corrupt_coded_downlink_names_its_shard_and_server(coding: str) -> None:
    """L3: a coded downlink payload whose crc does not hold was refused as a bare 'crc mismatch',
    naming neither the shard nor the rank that sent it: now both (rank j serves shard j)."""
    from dqsgd.codecs import PayloadError

    P = _proto(coding, 8)
    avg = _grads(P.shards[0].numel, 1)[0]
    down = [P.encode_down(j, avg[: P.shards[j].numel], 0) for j in range(4)]
    down[2] = down[2].clone()
    down[2][-1] ^= 0x40  # the crc's last byte
    with pytest.raises(PayloadError, match=r"the coded downlink of shard 2 from rank 2 \(its server\): crc mismatch"):
        P.decode_down(down)


def test_a_coded_payload_of_another_width_or_length_is_refused() -> None:
    P8, P4 = _proto("auto", 8), _proto("auto", 4)
    avg = _grads(P8.shards[0].numel, 1)[0]
    pay4 = P4.encode_down(0, avg, 0, dbits=4)
    with pytest.raises(ProtocolError, match=r"shard 0 from rank 0 \(its server\): .*4 bits.*expected uniform, 8 bits"):
        P8.decode_down([pay4] + [P8.encode_down(j, avg[: P8.shards[j].numel], 0) for j in range(1, 4)])
    other = _proto("auto", 8, numel=30_005)  # shards one value longer than P8's
    with pytest.raises(ProtocolError, match="7501 values; expected .*7502 values"):
        other.decode_down([P8.encode_down(j, avg[: P8.shards[j].numel], 0) for j in range(4)])


def test_defaults_and_refusals() -> None:
    assert _proto(None, name="dqsgd-coded", dbits=8).down_coding == "auto"  # the uplink's coding
    assert _proto(None).down_coding == "fixed"
    assert resolve_downlink_coding(None, uplink_coding="auto", bits=32, vote=False, topology="sharded") == "fixed"
    assert resolve_downlink_coding("", uplink_coding="auto", bits=8, vote=True, topology="sharded") == "fixed"
    with pytest.raises(ValueError, match="an fp32 downlink"):
        resolve_downlink_coding("auto", uplink_coding="fixed", bits=32, vote=False, topology="sharded")
    with pytest.raises(ValueError, match="majority vote"):
        resolve_downlink_coding("rans", uplink_coding="fixed", bits=1, vote=True, topology="sharded")
    with pytest.raises(ValueError, match="downlink_coding must be one of"):
        resolve_downlink_coding("huffman", uplink_coding="fixed", bits=8, vote=False, topology="sharded")
    with pytest.raises(ValueError, match="no larger than fixed"):  # a both-leg budget needs auto or fixed
        m = Method(method_config("dqsgd", target_bits=4.0), 20_000, 10)
        BucketProtocol(m.config, 20_000, [20_000], topology="sharded", workers=4, seed=0, total_steps=10,
                       method=m, spec=downlink_of({"downlink_bits": "auto", "downlink_coding": "rans"}, m.config, "sharded"))


@pytest.mark.parametrize("name,target", [("dqsgd", 3.0), ("dqsgd-coded", 1.0)])
def test_a_coded_downlink_is_charged_its_real_bytes_and_never_overspends(name: str, target: float) -> None:
    """Training through the sharded simulation with both legs budgeted: the ledger's downlink bytes are
    the coded payloads', the budget holds at every step, and the policy learns the coded ratio (< 1)."""
    steps = 25
    tr = Trainer(train_config(steps=steps, topology="sharded", eval_every=1000, coded_every=0, model="mlp",
                              threads=1, downlink_coding="auto"), entry(name, target_bits=target), DATA, 0)
    P = tr.step_runner.protocol
    assert P.coded_down and tr.ledger.both_legs
    for _ in range(steps):
        v = P.down_width(tr.state.policy)
        tr.step()
        rec = tr.ledger.records[-1]
        assert rec.down_bytes <= sum(P.down_sizes(v))
        assert tr.ledger.spent_bits() <= tr.ledger.budget_bits, tr.next_step
    assert tr.state.policy.down_ratio > 0  # learned: real / predicted coded bits
    assert sum(r.down_bytes for r in tr.ledger.records) < sum(sum(P.down_sizes(8)) for _ in range(steps))


def test_trainer_refuses_a_bad_downlink_coding() -> None:
    from dqsgd.core.config_file import ConfigError

    with pytest.raises((ValueError, ConfigError), match="downlink_coding must be one of"):
        train_config(downlink_coding="huffman")
    with pytest.raises(ValueError, match="train.downlink_coding: .*an fp32 downlink"):
        Trainer(train_config(steps=2, topology="sharded", downlink_bits=32, downlink_coding="auto", threads=1),
                entry("qsgd-4bit"), DATA, 0)


@pytest.mark.slow
def test_a_both_leg_budget_of_two_coded_bits_holds_and_sends_a_thirtieth_of_fp32() -> None:
    """dqsgd-coded at 1 coded bit per coordinate up and ``downlink_target_bits = 1`` down (error-fed):
    below the cheapest pair's fixed cost (2 + 2 bits), so only coding makes it payable. Over 100 steps the
    ledger stays within C at every step and ends within 2% of it, and both legs together send at most
    1/30 of fp32's 32 + 32 bits per coordinate."""
    steps = 100
    tr = Trainer(train_config(steps=steps, topology="sharded", eval_every=1000, coded_every=0, model="mlp", threads=1,
                              downlink_feedback=True, downlink_target_bits=1.0),
                 entry("dqsgd-coded", target_bits=1.0), DATA, 0)
    for _ in range(steps):
        tr.step()
        assert tr.ledger.spent_bits() <= tr.ledger.budget_bits, tr.next_step
    assert tr.ledger.spent_bits() >= 0.98 * tr.ledger.budget_bits
    assert tr.ledger.spent_bits() / steps <= 64 * tr.numel / 30


def test_downlink_target_bits_is_checked() -> None:
    with pytest.raises(ValueError, match="needs downlink_bits = 'auto'"):
        downlink_of({"downlink_bits": 8, "downlink_target_bits": 1.0}, method_config("qsgd-4bit"), "sharded")
    with pytest.raises(ValueError, match=r"downlink_target_bits must be a number in \[0, 16\]"):
        m = Method(method_config("dqsgd", target_bits=4.0), 1000, 5)
        downlink_of({"downlink_bits": "auto", "downlink_target_bits": -1.0}, m.config, "sharded")
    m = Method(method_config("dqsgd", target_bits=4.0), 20_000, 5)
    P = BucketProtocol(m.config, 20_000, [20_000], topology="sharded", workers=4, seed=0, total_steps=5,
                       method=m, spec=downlink_of({"downlink_bits": "auto", "downlink_target_bits": 2.0,
                                                   "downlink_feedback": True}, m.config, "sharded"))
    up = Method(method_config("dqsgd", target_bits=4.0), 20_000, 5).budget_bits()
    headers = 8 * sum(P.down_sizes(2)) - 2 * 20_000
    assert P.policy.budget_bits == up + int(5 * (headers + 2.0 * 20_000))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("feedback", [False, True])
def test_coded_downlink_on_the_gpu_equals_the_cpu(feedback: bool) -> None:
    """A CUDA bucket: the uplink through the device codec, the coded downlink encoded on the host and its
    payloads decoded into the CUDA update: the CPU's update, bitwise (max norm)."""
    dbits = 2 if feedback else 8
    grads = _grads(30_001, 4, seed=5)
    want = in_process(_proto("auto", dbits, feedback), grads, 4, 1)
    got = in_process(_proto("auto", dbits, feedback), [g.cuda() for g in grads], 4, 1)
    assert got.device.type == "cuda" and torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("link", [10.0, 1e6])
def test_auto_with_a_link_rate_picks_by_time_and_keeps_the_update(link: float) -> None:
    """``link_mbit``: the downlink's auto coding is chosen by modelled time, as the uplink's; on a very fast
    link that is fixed (the cheapest to code), on a slow one a smaller coding; the update is unchanged."""
    from dqsgd.codecs.header import Coding
    from dqsgd.kernels import read_header

    cfg = method_config("qsgd-2bit-auto", link_mbit=link)
    P = BucketProtocol(cfg, 30_001, [30_001], topology="sharded", workers=4, seed=3, total_steps=10, downlink_bits=8)
    grads = _grads(30_001, 4, seed=4)
    avg = [P.reduce(j, [P.encode(w, g, 2, 0, None)[0][j] for w, g in enumerate(grads)], 2) for j in range(4)]
    pays = [P.encode_down(j, a, 0) for j, a in enumerate(avg)]
    used = {read_header(p.numpy()).coding for p in pays}
    assert used == {Coding.FIXED} if link > 1e5 else Coding.FIXED not in used, used
    assert torch.equal(P.decode_down(pays), _proto("fixed").decode_down([_proto("fixed").encode_down(j, a, 0)
                                                                         for j, a in enumerate(avg)]))


def test_the_split_reads_the_same_from_g_as_from_the_hooks_sample() -> None:
    """The DDP hook keeps only the coded policy's entropy sample of G (``read_stride``); the both-leg split
    with a coded downlink must choose from it exactly what the trainer chooses from all of G."""
    import dataclasses

    from dqsgd.policies.base import GradStats
    from dqsgd.policies.coded import read_stride

    n = 300_001
    m = Method(method_config("dqsgd-coded"), n, 10)
    P = BucketProtocol(m.config, n, [n], topology="sharded", workers=4, seed=0, total_steps=10, downlink_bits="auto",
                       method=m)
    pol = P.policy
    assert P.coded_down and read_stride(pol, n) > 1
    g = _grads(n, 1, seed=6)[0]
    down = 8 * sum(P.down_sizes(pol.init().down_bits)) // 3
    full = GradStats(0, float(g.abs().max()), float(g.norm()) / n ** 0.5, 2 * down, g, down)
    kept = dataclasses.replace(full, grad=g[:: read_stride(pol, n)].clone())
    a, b = pol.update(pol.init(), full), pol.update(pol.init(), kept)
    assert repr(a) == repr(b) and a.down_ratio > 0
