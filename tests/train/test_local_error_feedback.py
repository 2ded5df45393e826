"""Error feedback on Local SGD pseudo-gradients (the error-fed outer update of SparseLoCo / MuLoCo).

Per worker w and round r, with Δ_{w,r} the round's pseudo-gradient and e_{w,-1} = 0:

    p = Δ_{w,r} + e_{w,r-1},   q = Q(p) (what is sent; its decoded value),   e_{w,r} = p − q.

Telescoping, Σ_r q_{w,r} = Σ_r Δ_{w,r} − e_{w,R-1}: what a worker sent over the run is what it moved,
less the last residual. These tests check that identity through the step object the rounds use (the
per-worker residuals it returns and the average it applies), and that the residual stays bounded
(each residual is the rounding error of one message, not an accumulation).
"""

import torch

from dqsgd.method.config import method_config
from dqsgd.method.pipeline import Method
from dqsgd.topology.step import step_for
from dqsgd.core.rng import QUANT, generator
from dqsgd.transport import SimTransport

W, D, ROUNDS = 4, 300, 40
EPS = torch.finfo(torch.float32).eps


def rounds(ef: bool) -> tuple[list[dict[int, torch.Tensor]], list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """ROUNDS exchanges of seeded pseudo-gradients at 2 bits on `ps` (fp32 downlink: Δ̂ is the exact
    mean of the decoded uplinks): the deltas, the applied averages and the residuals after each round."""
    config = method_config("qsgd-2bit", error_feedback=ef)
    method = Method(config, D, ROUNDS, [D])
    runner = step_for(method, "ps", [D], W, 0)
    state = method.init_state(W, runner.policy)
    gens = {w: generator(0, QUANT, w) for w in range(W)}
    g = torch.Generator().manual_seed(7)
    deltas, applied, residuals = [], [], []
    t = SimTransport(W, "ps")
    for r in range(ROUNDS):
        delta = {w: torch.randn(D, generator=g) * (1 + w) for w in range(W)}
        ex = runner.run(t, delta, state, r, gens)
        state = ex.state
        deltas.append(delta)
        applied.append(ex.update.clone())
        residuals.append({w: state.residuals[w] for w in range(W)})
    return deltas, applied, residuals


def test_sent_sum_is_delta_sum_minus_last_residual_per_worker_and_on_average() -> None:
    deltas, applied, residuals = rounds(ef=True)
    last = residuals[-1]
    for w in range(W):
        total = torch.stack([d[w] for d in deltas]).double().sum(0)
        # per round, q_{w,r} = Δ_{w,r} + e_{w,r-1} − e_{w,r} exactly up to the rounding of the two float32
        # subtractions (each |error| <= eps/2 of its result); summed: Σ q = ΣΔ − e_last
        prev = torch.zeros(D, dtype=torch.float64)
        sent = torch.zeros(D, dtype=torch.float64)
        bound = torch.zeros(D, dtype=torch.float64)
        for d, e in zip(deltas, residuals):
            p = d[w].double() + prev
            q = p - e[w].double()
            sent += q
            bound += EPS * (p.abs() + e[w].double().abs())
            prev = e[w].double()
        assert torch.all((sent - (total - last[w].double())).abs() <= bound)
    # the averages the outer step applied: Σ_r Δ̂_r = (1/W) Σ_w (Σ_r Δ_{w,r} − e_{w,last})
    applied_sum = torch.stack(applied).double().sum(0)
    want = sum(torch.stack([d[w] for d in deltas]).double().sum(0) - last[w].double() for w in range(W)) / W
    scale = sum(torch.stack([d[w] for d in deltas]).double().abs().sum(0) for w in range(W)) / W
    assert torch.all((applied_sum - want).abs() <= 8 * EPS * (scale + sum(last[w].double().abs() for w in range(W))))


def test_each_residual_is_one_rounding_error_not_an_accumulation() -> None:
    """QSGD-2bit (max-norm scale m = ‖p‖∞, s = 1 level: each coordinate rounds stochastically to 0 or
    ±m) leaves |e_i| <= m / s = ‖Δ_r + e_{r-1}‖∞ in every round: the residual is the rounding error of one
    message, bounded by that message's scale, whatever the rounds before it sent. Without feedback the
    state keeps no residual at all."""
    deltas, _, residuals = rounds(ef=True)
    for w in range(W):
        prev = torch.zeros(D)
        for d, e in zip(deltas, residuals):
            m = float((d[w] + prev).abs().max())
            assert float(e[w].abs().max()) <= m * (1 + 4 * EPS)
            prev = e[w]
    _, _, plain = rounds(ef=False)
    assert all(e[w] is None for e in plain for w in range(W))
