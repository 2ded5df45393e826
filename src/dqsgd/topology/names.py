"""The downlink widths, written once (the topologies: :mod:`dqsgd.topology.registry`)."""

from __future__ import annotations

from dqsgd.topology.registry import HOOK_TOPOLOGIES, TOPOLOGIES, check_topology, topology_of  # noqa: F401

FP32 = 32                                     # downlink width meaning "send the averaged shard in fp32"
AUTO = "auto"                                 # downlink width chosen with the uplink's from one budget
DOWNLINK_PARITY_BITS = 8                      # the explicit default width; an "auto" budget adds its cost
BUDGETED_POLICIES = ("dqsgd-budget", "dqsgd-coded")  # the policies "auto" splits the budget of
AUTO_POLICIES = (*BUDGETED_POLICIES, "link")  # "auto": the split, or the link policy's own choice of the downlink


def check_downlink_bits(bits: object) -> int:
    """A sharded downlink width: 2..16 (stochastic uniform rounding, s = 2^(b-1) - 1) or 32 (fp32)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not (2 <= bits <= 16 or bits == FP32):
        raise ValueError(f"downlink_bits must be in [2, 16] (stochastic uniform, s = 2^(b-1) - 1) or 32 (fp32), "
                         f"got {bits!r}")
    return bits


def resolve_downlink_bits(bits: object, *, policy: str, topology: str, vote: bool) -> int | str:
    """The downlink width a run uses: ``bits`` (2..16, 32 = fp32, or ``"auto"``), or where it is
    None or 0 (not given) the method's default: ``"auto"`` for a budgeted policy on topology
    ``sharded`` (not a vote), else :data:`DOWNLINK_PARITY_BITS`. ``"auto"`` where it means nothing
    is refused (:func:`check_auto_downlink`)."""
    if bits is None or (bits == 0 and not isinstance(bits, bool)):
        sharded = topology_of(topology).sharded
        return AUTO if policy in BUDGETED_POLICIES and sharded and not vote else DOWNLINK_PARITY_BITS
    if bits == AUTO:
        check_auto_downlink(topology, vote, policy)
        return AUTO
    return check_downlink_bits(bits)


def check_auto_downlink(topology: str, vote: bool, policy: str | None = None) -> None:
    """Refuse ``downlink_bits = "auto"`` where there is no downlink width to choose or no budget to split."""
    if not topology_of(topology).sharded or vote:
        what = "a majority vote sends its signs" if vote else f"topology {topology!r} sends no quantized downlink"
        raise ValueError(f"downlink_bits = 'auto' chooses the sharded downlink's width: {what}; use topology "
                         f"'sharded' or leave downlink_bits unset")
    if policy is not None and policy not in AUTO_POLICIES:
        raise ValueError(f"downlink_bits = 'auto' splits a bit budget between the uplink and the downlink: it needs "
                         f"a budgeted policy ({', '.join(BUDGETED_POLICIES)}: the methods dqsgd, dqsgd-coded) or the "
                         f"link policy (dqsgd-link), which chooses both widths itself, not "
                         f"policy {policy!r}; give an integer width (2..16, or 32 for fp32)")


def check_downlink_target(bits: object, auto: bool) -> float:
    """``downlink_target_bits``: 0 (an 8-bit fixed downlink's cost), or the downlink's share of a
    both-leg budget in bits per coordinate and step, in (0, 16], which needs ``downlink_bits = "auto"``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 <= bits <= 16:
        raise ValueError(f"downlink_target_bits must be a number in [0, 16] (0: an 8-bit fixed downlink's cost), "
                         f"got {bits!r}")
    if bits and not auto:
        raise ValueError("downlink_target_bits is the downlink's share of a both-leg budget: it needs "
                         "downlink_bits = 'auto' (topology 'sharded', a budgeted method)")
    return float(bits)


SAFE_DOWNLINK_BITS = 4  # below this, an unbiased downlink without error feedback was seen to diverge


def check_downlink_safety(bits: int | str, feedback: bool, force: bool, *, topology: str, vote: bool,
                          spell: tuple[str, str] = ("downlink_feedback=True", "allow_unsafe_downlink=True")) -> None:
    """Refuse a downlink configuration that trains badly or means nothing (a ValueError naming the fix).

    * ``feedback`` needs a quantized downlink to feed: topology ``sharded``, a width of 2..16, not
      a majority vote (whose downlink is its exact signs).
    * A width below :data:`SAFE_DOWNLINK_BITS` without ``feedback``: the unbiased rounding's variance
      ((‖x‖∞/s)²/4 per coordinate, s = 1 at 2 bits) is then of the order of the update itself, and
      training can collapse after a good start; refused unless ``force``. ``spell``: how the caller's
      interface writes the two options (the hook's arguments, the trainer's config keys).
    """
    if bits == AUTO:  # the policy picks widths >= SAFE_DOWNLINK_BITS unless feedback is on
        return
    quantized = topology_of(topology).sharded and not vote and bits != FP32
    if feedback and not quantized:
        what = ("a majority vote sends its exact signs" if vote else "an fp32 downlink" if bits == FP32
                else f"topology {topology!r} sends no quantized downlink")
        raise ValueError(f"{spell[0]}: nothing to feed back ({what}); it applies to topology 'sharded' with "
                         f"downlink_bits 2..16")
    if quantized and bits < SAFE_DOWNLINK_BITS and not (feedback or force):
        raise ValueError(f"downlink_bits={bits} without error feedback: an unbiased {bits}-bit downlink adds noise "
                         f"of the order of the update itself and training can diverge after a good start. Set "
                         f"{spell[0]} (the shard servers keep their rounding residual), or {spell[1]} to run it as "
                         f"is, or use downlink_bits >= {SAFE_DOWNLINK_BITS}")
