"""Streaming Local SGD (dqsgd.train.streaming, dqsgd.train.fragments): one fragment without overlap is the
unfragmented rounds bitwise; each fragment is exchanged once every H steps at its offset and its result
applied τ steps later; an exchange carries exactly its fragment's bytes; the merge keeps the workers'
progress; the simulated clock hides a link time shorter than τ steps; a run resumes exactly anywhere,
an exchange in flight included; bad settings are refused with the key named."""

import io

import pytest
import torch
from synthetic_runs import entry, train_config

from dqsgd.data import load_dataset
from dqsgd.train.config import ConfigError, TrainConfig
from dqsgd.train.fragments import merge
from dqsgd.train.schedule import exchanges, offsets, split
from dqsgd.train.streaming import StreamingRounds
from dqsgd.train.trainer import Trainer
from dqsgd.transport import SimTransport

DATA = load_dataset("synthetic")


def trainer(topology: str = "sharded", method: str = "qsgd-4bit", **kw) -> Trainer:
    cfg = train_config(**{"topology": topology, "momentum": 0.9, **kw})
    return Trainer(cfg, entry(method), DATA, 0, SimTransport(cfg.workers, topology))


def run(tr: Trainer) -> list:
    return [tr.step() for _ in range(tr.cfg.steps - tr.next_step)]


def records(tr: Trainer) -> list:
    return [(r.step, r.bits, r.up_bytes, r.down_bytes, r.rank_up, r.rank_down, r.coded_up) for r in tr.ledger.records]


@pytest.mark.parametrize("topology,method,kw", [
    ("sharded", "qsgd-4bit", {}),
    ("ps", "dqsgd", dict(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)),
    ("sharded", "qsgd-2bit", dict(inner_optimizer="adamw", lr=0.003)),
])
def test_one_fragment_without_overlap_is_the_unfragmented_rounds_bitwise(topology: str, method: str, kw: dict) -> None:
    kw = dict(local_steps=6, steps=20, **kw)
    plain = trainer(topology, method, **kw)
    streaming = trainer(topology, method, **kw)
    streaming.local = StreamingRounds(streaming, 0.9, 1, 0)  # the streaming path, forced at F = 1, τ = 0
    a, b = run(plain), run(streaming)
    assert type(plain.local).__name__ == "LocalRounds"
    assert torch.equal(plain.flat_params(), streaming.flat_params())
    assert records(plain) == records(streaming) and [r.step for r in plain.ledger.records] == [5, 11, 17, 19]
    assert [(r.loss, r.bits, r.up_bytes, r.down_bytes) for r in a] == [(r.loss, r.bits, r.up_bytes, r.down_bytes) for r in b]
    assert streaming.ledger.budget_bits == plain.ledger.budget_bits
    assert b[-1].sim_time_s == pytest.approx(a[-1].sim_time_s, rel=1e-12)


def spy(tr: Trainer) -> list[tuple[int, int, int]]:
    """(fragment, issued after step c, completed at step n) of every exchange."""
    seen: list[tuple[int, int, int]] = []
    finish = tr.local.finish

    def wrapped(p, out):  # type: ignore[no-untyped-def]
        seen.append((p.frag.index, p.issued, tr.next_step))
        return finish(p, out)

    tr.local.finish = wrapped  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("fragments,overlap", [(4, 2), (3, 0), (2, 5)])
def test_each_fragment_is_exchanged_once_every_h_steps_at_its_offset(fragments: int, overlap: int) -> None:
    h, steps = 8, 37
    tr = trainer(local_steps=h, steps=steps, fragments=fragments, overlap_steps=overlap)
    seen = spy(tr)
    run(tr)
    assert offsets(h, fragments) == [f * h // fragments for f in range(fragments)]
    for f, fr in enumerate(tr.local.frags):
        issued = [c for g, c, _ in seen if g == f]
        scheduled = [c for c in range(1, steps + 1) if c % h == fr.offset]
        assert issued == scheduled + ([steps] if scheduled[-1] != steps else [])  # + the flush at the end
        assert all(b - a == h for a, b in zip(scheduled, scheduled[1:]))
        assert len(issued) == fr.done == fr.method.total_steps == exchanges(steps, h, fr.offset)
        for g, c, n in seen:
            if g == f:  # applied τ steps later (the run's last step completes everything)
                assert n + 1 == min(c + overlap, steps)
    assert [n for _, _, n in seen] == [r.step for r in tr.ledger.records]  # one record per exchange, in order
    sizes = [p.numel() for p in tr.params]
    cuts = split(sizes, fragments)
    assert [(fr.lo, fr.hi) for fr in tr.local.frags] == cuts and cuts[0][0] == 0 and cuts[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


def balanced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of seven 1024-element tensors and a 160-element head (bias-free layers 16 <-> 64 wide)."""
    d = DATA.train.x[0].numel()
    assert d == 64

    def build(name, data):  # type: ignore[no-untyped-def]
        widths = [64, 16, 64, 16, 64, 16, 64, 16]
        mods: list[torch.nn.Module] = [torch.nn.Flatten()]
        for a, b in zip(widths, widths[1:]):
            mods += [torch.nn.Linear(a, b, bias=False), torch.nn.Tanh()]
        return torch.nn.Sequential(*mods, torch.nn.Linear(16, 10, bias=False))

    monkeypatch.setattr("dqsgd.train.trainer.build_model", build)


@pytest.mark.parametrize("topology", ["ps", "sharded"])
def test_an_exchange_carries_exactly_its_fragments_bytes_and_the_peak_falls_with_f(
        monkeypatch: pytest.MonkeyPatch, topology: str) -> None:
    balanced(monkeypatch)
    peaks, totals = {}, {}
    for f in (1, 4):
        tr = trainer(topology, "qsgd-4bit", local_steps=8, steps=32, fragments=f, overlap_steps=0 if f == 1 else 1)
        if f == 1:
            tr.local = StreamingRounds(tr, 0.9, 1, 0)  # the unfragmented rounds (bitwise, test above), spied on
        seen = spy(tr)
        run(tr)
        frags = tr.local.frags
        by_fragment: dict[int, set] = {}
        for (g, _, _), rec in zip(seen, tr.ledger.records):
            method = frags[g].method
            if topology == "ps":  # fixed coding: the exact size of a 4-bit message of the fragment
                assert rec.up_bytes == [method.max_payload_bytes(4)] * tr.cfg.workers
            by_fragment.setdefault(g, set()).add((tuple(rec.up_bytes), tuple(rec.rank_up), tuple(rec.rank_down)))
        assert all(len(v) == 1 for v in by_fragment.values())  # each fragment's exchanges: the same bytes
        peaks[f] = max(max(a + b for a, b in zip(r.rank_up, r.rank_down)) for r in tr.ledger.records)
        totals[f] = sum(sum(r.rank_up) + sum(r.rank_down) for r in tr.ledger.records)
        per = {g: sum(a + b for a, b in zip(*next(iter(v))[1:])) for g, v in by_fragment.items()}
        assert totals[f] == sum(exchanges(32, 8, fr.offset) * per[fr.index] for fr in frags)  # each exchange counted
        # the fp32 reference counts the coordinates each exchange carried, not the whole model each time
        assert tr.ledger.fp32_up_bytes() == 4 * 4 * sum(exchanges(32, 8, fr.offset) * (fr.b - fr.a) for fr in frags)
        assert tr.ledger.mean_bits() == 4.0
        if f > 1:
            assert [fr.b - fr.a for fr in frags] == [2048, 2048, 1024, 2208]  # cuts nearest k·d/F
    # Every coordinate is sent once per H steps either way: F x lower peak per exchange, up to the headers.
    assert peaks[4] * 4 >= peaks[1] and peaks[4] * 4 <= peaks[1] * 1.5, peaks


def test_merge_keeps_the_progress_since_the_snapshot() -> None:
    g = torch.Generator().manual_seed(1)
    synced, snap, local = (torch.randn(50, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.equal(merge(local, None, synced), synced)
    got = merge(local, snap, synced)
    assert torch.equal(got, synced + (local - snap))
    assert torch.allclose(got - synced, local - snap, atol=1e-12, rtol=0)  # the τ steps' progress, kept
    assert torch.equal(merge(snap, snap, synced), synced)  # no progress: the synchronized fragment


def test_overlap_keeps_the_inner_steps_taken_during_the_exchange() -> None:
    """With τ > 0 a worker's fragment after the merge = θ_f' + its progress since the snapshot (so the next
    pseudo-gradient counts the τ steps): checked on the trainer's own vectors at a completion."""
    tr = trainer("ps", "sgd", local_steps=8, steps=16, fragments=2, overlap_steps=3)
    rounds = tr.local
    checked = []
    apply = rounds.apply

    def wrapped(p, update, *a, **k):  # type: ignore[no-untyped-def]
        before = {w: v[p.frag.a: p.frag.b].clone() for w, v in rounds.local.items()}
        apply(p, update, *a, **k)
        synced = rounds.start[p.frag.a: p.frag.b]
        assert torch.equal(tr.flat_params()[p.frag.a: p.frag.b], synced)  # the model holds θ_f'
        for w, v in rounds.local.items():
            if p.snapshot is not None:
                assert torch.equal(v[p.frag.a: p.frag.b], synced + (before[w] - p.snapshot[w]))
                checked.append(bool((before[w] - p.snapshot[w]).abs().sum() > 0))

    rounds.apply = wrapped  # type: ignore[method-assign]
    run(tr)
    assert checked and any(checked)


def test_the_simulated_clock_hides_a_link_shorter_than_the_overlap() -> None:
    """Fixed compute times (σ = 0, no stalls): blocking, every exchange adds its link time; with τ = 3 steps
    of compute longer than each link time, only the end's exchanges (the last in flight, the flush) do."""
    kw = dict(local_steps=8, steps=16, fragments=2, compute_s=0.1, compute_sigma=0.0, stall_prob=0.0,
              link_mbps=10.0, link_latency_s=0.001)
    times = {}
    for tau in (0, 3):
        tr = trainer("sharded", "qsgd-4bit", overlap_steps=tau, **kw)
        res = run(tr)
        comm = [tr.timer.model.comm_s(max(a + b for a, b in zip(r.rank_up, r.rank_down)), tr.timer.rounds)
                for r in tr.ledger.records]
        assert max(comm) < 0.3  # shorter than τ steps of compute
        times[tau] = (res[-1].sim_time_s, comm)
    (blocking, comm0), (overlapped, comm3) = times[0], times[3]
    assert blocking == pytest.approx(16 * 0.1 + sum(comm0), rel=1e-12)
    assert overlapped == pytest.approx(16 * 0.1 + comm3[-2] + comm3[-1], rel=1e-12)
    assert overlapped < blocking


@pytest.mark.parametrize("cut,kw", [
    (5, dict(method="qsgd-4bit", fragments=2, overlap_steps=3)),    # fragment 1 in flight (issued after step 4)
    (10, dict(method="dqsgd", fragments=3, overlap_steps=2, outer_optimizer="nesterov", outer_lr=0.7,
              outer_momentum=0.9)),
    (10, dict(method="qsgd-2bit-ef", fragments=4, overlap_steps=1)),
    (18, dict(method="ef-signsgd", fragments=1, overlap_steps=4, topology="ps")),
])
def test_resume_mid_schedule_is_exact_with_an_exchange_in_flight(cut: int, kw: dict) -> None:
    kw = {"local_steps": 8, "steps": 26, "topology": "sharded", **kw}
    method = kw.pop("method")
    m = entry("qsgd-2bit", error_feedback=True) if method == "qsgd-2bit-ef" else entry(method)
    cfg = train_config(**{"momentum": 0.9, **kw})

    def make() -> Trainer:
        return Trainer(cfg, m, DATA, 0, SimTransport(cfg.workers, cfg.topology))

    full = make()
    run(full)
    part = make()
    for _ in range(cut):
        part.step()
    assert part.local.pending, "the cut should fall while an exchange is in flight"
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    buf.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(resumed)
    assert torch.equal(full.flat_params(), resumed.flat_params())
    assert records(full) == records(resumed)
    assert full.timer.elapsed == resumed.timer.elapsed
    other = Trainer(TrainConfig(**{**cfg.__dict__, "fragments": 2 if cfg.fragments != 2 else 4}), m, DATA, 0,
                    SimTransport(cfg.workers, cfg.topology))
    buf.seek(0)
    with pytest.raises(ValueError, match="fragments"):
        other.load_state_dict(torch.load(buf, weights_only=True))


def test_bad_settings_are_refused_with_the_key_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for kw, msg in [(dict(local_steps=4, fragments=5), "fragments = 5 > local_steps = 4"),
                    (dict(local_steps=4, overlap_steps=4), "overlap_steps = 4 must be < local_steps = 4"),
                    (dict(local_steps=4, fragments=0), "fragments must be an int >= 1"),
                    (dict(local_steps=4, overlap_steps=-1), "overlap_steps must be an int >= 0"),
                    (dict(local_steps=4, fragments=2, local_period="adaptive"), "need local_period = 'fixed'"),
                    (dict(overlap_steps=1), "overlap_steps = 1 must be < local_steps = 1")]:
        with pytest.raises(ConfigError, match=msg):
            TrainConfig(**kw)
    assert TrainConfig(local_steps=4, fragments=2).local  # streaming is Local SGD
    with pytest.raises(ValueError, match="fragments = 7 > the model's 6 parameter tensors"):
        trainer(local_steps=8, fragments=7)
    with pytest.raises(ValueError, match="backup workers"):
        Trainer(train_config(local_steps=8, fragments=2, backup_workers=1, topology="ps"), entry("qsgd-4bit"), DATA, 0,
                SimTransport(4, "ps"))
    with pytest.raises(ValueError, match="fragments = 3 > the model's 2"):
        split([5, 5], 3)


def test_budget_of_the_fragments_is_never_overspent() -> None:
    tr = trainer("sharded", "dqsgd", local_steps=4, steps=40, fragments=2, overlap_steps=1, downlink_bits=8)
    budgets = [fr.method.budget_bits() for fr in tr.local.frags]
    assert tr.ledger.budget_bits == sum(budgets) > 0
    for _ in range(40):
        tr.step()
        assert tr.ledger.spent_bits() <= tr.ledger.budget_bits
    assert len({r.bits for r in tr.ledger.records}) > 1
    assert tr.ledger.spent_bits() >= 0.9 * tr.ledger.budget_bits  # and nearly spent


def test_a_non_finite_fragment_exchange_is_skipped_and_its_workers_restart_from_the_model() -> None:
    tr = trainer("sharded", "qsgd-4bit", local_steps=8, steps=24, fragments=2, overlap_steps=2, on_nonfinite="skip")
    gradient = tr.worker_gradient

    def poisoned(worker, step, l2=True):  # type: ignore[no-untyped-def]
        g, loss = gradient(worker, step, l2)
        return (g * float("nan"), loss) if (worker, step) == (1, 9) else (g, loss)

    tr.worker_gradient = poisoned  # type: ignore[method-assign]
    seen = spy(tr)
    with pytest.warns(RuntimeWarning, match="fragment .* is NaN or Inf"):
        run(tr)
    assert tr.skipped >= 1 and torch.isfinite(tr.flat_params()).all()
    assert len(tr.ledger.records) == len(seen) - tr.skipped  # a skipped exchange is not recorded
    for v in tr.local.local.values():
        assert torch.isfinite(v).all()  # every fragment's workers restarted from θ or were merged finitely


def test_local_sgd_optimizer_refuses_bad_streaming_settings_before_any_collective() -> None:
    from dqsgd.local import LocalSGDOptimizer

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, msg in [(dict(fragments=5), "fragments = 5 > local_steps = 4"),
                    (dict(overlap=4), "overlap = 4 must be < local_steps = 4"),
                    (dict(fragments=True), "fragments must be an int >= 1")]:
        with pytest.raises(ValueError, match=msg):
            LocalSGDOptimizer(inner, model, 4, "qsgd-4bit", **kw)
