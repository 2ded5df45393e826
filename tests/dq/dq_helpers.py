"""Helpers shared by the Double Quantization tests (imported by name: pytest puts tests/dq on sys.path)."""

from collections import Counter

from dqsgd.dq.problem import ProblemSpec

SPEC = ProblemSpec("synthetic", "logreg", l2=1e-4, seed=0)


def check_exactly_once(res) -> None:
    """The set of (worker, seq) the master handled equals the set the workers sent, without
    duplicates; gradients are applied or rejected (stale), each exactly once; m per epoch."""
    handled = [(r.worker, r.seq) for r in res.messages]
    sent = [(w, seq) for w, log in enumerate(res.worker_sent) for seq, _ in log]
    assert len(handled) == len(set(handled)) and Counter(handled) == Counter(sent)
    kinds = {(w, seq): k for w, log in enumerate(res.worker_sent) for seq, k in log}
    assert all(kinds[(r.worker, r.seq)] == r.kind for r in res.messages)
    for log in res.worker_sent:  # seqs are 0..k-1: nothing sent was skipped
        assert [s for s, _ in log] == list(range(len(log)))
    applied = Counter(r.epoch for r in res.messages if r.kind == "grad" and r.applied)
    assert sum(applied.values()) == res.updates
    if res.reached is None and not res.diverged and not res.cfg.max_updates:
        assert all(v == res.m for v in applied.values()) and len(applied) == res.cfg.epochs
