"""The streaming schedule's arithmetic (:mod:`dqsgd.train.fragments` explains it): the fragments' cut of
the parameter tensors, their offsets in the period, when each is due, how many exchanges each has, and
the checks of F and τ the config, the trainer and :class:`~dqsgd.train.local_sgd.LocalSGDOptimizer` share."""

from __future__ import annotations

__all__ = ["check_streaming", "due", "exchanges", "offsets", "split"]


def check_streaming(fragments: int, overlap: int, local_steps: int, tensors: int | None = None,
                    prefix: str = "", overlap_name: str = "overlap") -> None:
    """Refuse a fragment count or overlap the schedule cannot run (ValueError naming the key)."""
    for name, v, low in (("fragments", fragments, 1), (overlap_name, overlap, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{prefix}{name} must be an int >= {low}, got {v!r}")
    if fragments > local_steps:
        raise ValueError(f"{prefix}fragments = {fragments} > {prefix}local_steps = {local_steps}: each of the F "
                         f"fragments needs its own step of the H-step period (F <= H)")
    if overlap >= local_steps and (overlap > 0 or fragments > 1):
        raise ValueError(f"{prefix}{overlap_name} = {overlap} must be < {prefix}local_steps = {local_steps}: an "
                         f"exchange must complete before the same fragment's next one is issued")
    if tensors is not None and fragments > tensors:
        raise ValueError(f"{prefix}fragments = {fragments} > the model's {tensors} parameter tensors: a fragment "
                         f"is one or more whole tensors")


def split(sizes: list[int], count: int) -> list[tuple[int, int]]:
    """``count`` contiguous ranges [i, j) of the tensors ``sizes`` with element counts as equal as whole
    tensors allow: cut k falls where the running total is nearest k·total/count."""
    n, total = len(sizes), sum(sizes)
    check_streaming(count, 0, max(count, 1), n)
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    cuts = [0]
    for k in range(1, count):
        lo, hi = cuts[-1] + 1, n - (count - k)  # leave at least one tensor to each fragment
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(cum[i] * count - k * total), i)))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


def offsets(local_steps: int, count: int) -> list[int]:
    """o_f = ⌊f·H/F⌋: the step (mod H) at which fragment f is exchanged."""
    return [f * local_steps // count for f in range(count)]


def due(done_steps: int, local_steps: int, offset: int) -> bool:
    """Whether the fragment of ``offset`` is exchanged after the ``done_steps``-th inner step."""
    return done_steps > 0 and done_steps % local_steps == offset


def exchanges(steps: int, local_steps: int, offset: int) -> int:
    """How many exchanges the fragment of ``offset`` has in a run of ``steps`` steps (the policy plans
    over them): one per due step, and one at the end if the last due step is not the last step."""
    first = offset or local_steps
    if steps < first:
        return 1
    scheduled = (steps - first) // local_steps + 1
    return scheduled + int(first + (scheduled - 1) * local_steps != steps)
