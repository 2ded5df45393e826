"""One rank fingerprint: do the ranks run the same configuration? Checked once, at the first step.

A configuration is a mapping of named fields (a method and its options, the topology, the codings,
the downlink width, warm-up steps, checkpoint_every, the dqsgd version, ...). Its fingerprint is a
fixed-size vector of :data:`SLOTS` integers: field ``k`` goes to slot ``crc32(k) mod SLOTS``, where
the 56-bit hashes of ``(k, value)`` are combined by XOR, so a field that differs, or that one rank
has and another lacks, changes its slot. Every rank sends the same number of integers whatever its
configuration — the check itself cannot crash an unequal collective — and receives every rank's
vector, so every rank finds the same differing slots. Where slots differ, a second exchange sends
a (name hash, value hash) pair for each field in those slots (its size first agreed by a one-integer
all-gather), so every rank raises the same :class:`RankDisagreement` naming exactly the fields that
differ — never an innocent field that only shares a slot with one.

A saved state (a hook's, FSDP's, Local SGD's, a trainer checkpoint) records the same kind of
mapping; :func:`refuse_changed` compares it with the configuration it is loaded into and names every
differing key ("method.bits: 8 saved, 2 here"), and :func:`check_state` refuses a malformed state
(missing keys, wrong types) before anything of it is loaded.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Callable, Mapping, Sequence

SLOTS = 64
_HEAD = 2  # [this rank refuses for a reason of its own, number of fields]


class RankDisagreement(RuntimeError):
    """Ranks run different configurations, or computed different results from the same bytes."""


def digest(value: Any) -> int:
    """A 56-bit hash of a JSON-able value (other values by their ``repr``)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def slot_of(name: str) -> int:
    return zlib.crc32(name.encode()) % SLOTS


def fingerprint(fields: Mapping[str, Any]) -> list[int]:
    """The fixed-size fingerprint of ``fields`` (:data:`SLOTS` integers)."""
    out = [0] * SLOTS
    for name, value in fields.items():
        out[slot_of(name)] ^= digest([name, value])
    return out


def agree(fields: Mapping[str, Any], gather: Callable[[list[int]], Sequence[Sequence[int]]], rank: int,
          refused: bool = False, what: str = "to start") -> None:
    """Compare ``fields`` across ranks; ``gather(ints)`` returns every rank's ``ints`` in rank order
    (a fixed-size all-gather). ``refused``: this rank stops for its own reason (it raises that after
    this returns); the others then stop too, saying that rank refused ``what``.

    Raises:
      RankDisagreement: on every rank alike, naming the fields whose slots differ from rank 0's.
    """
    mine = [int(refused), len(fields)] + fingerprint(fields)
    rows = [list(r) for r in gather(mine)]
    if refused:
        return
    stopped = [r for r, v in enumerate(rows) if v[0]]
    if stopped:
        raise RankDisagreement(f"rank {rank}: rank(s) {stopped} refused {what} (see their message)")
    slots = {s for s in range(SLOTS) if any(v[_HEAD + s] != rows[0][_HEAD + s] for v in rows)}
    if not slots and all(v[1] == rows[0][1] for v in rows):
        return
    named = sorted(k for k in fields if slot_of(k) in slots)
    # Second exchange: (name hash, value hash) of every field in a differing slot, padded to the most any
    # rank has (that count agreed first), so the message names exactly the fields that differ.
    most = max(r[0] for r in gather([len(named)]))
    pairs = [x for k in named for x in (digest(k), digest([k, fields[k]]))] + [-1] * (2 * (most - len(named)))
    tables = [dict(zip(r[0::2], r[1::2])) for r in gather(pairs)] if most else [{}]
    differ = {k: [r for r, t in enumerate(tables) if t.get(digest(k)) != tables[0].get(digest(k))] for k in named}
    shown = "; ".join(f"{k} (rank(s) {ranks} differ from rank 0; here {fields[k]!r})"
                      for k, ranks in differ.items() if ranks)
    mine = {digest(k) for k in named}
    if any(h != -1 and h not in mine for t in tables for h in t) or not shown:
        shown += ("; " if shown else "") + "and field(s) this rank does not have (the ranks' key sets differ)"
    raise RankDisagreement(f"rank {rank}: the ranks run different configurations: {shown}")


def tensor_digest(t: Any) -> str:
    """A hex sha256 of a tensor's dtype, shape and bytes (equal tensors, equal digest; a field value
    for :func:`agree`, e.g. the initial parameters)."""
    import torch  # here: the command line reads this module before it imports torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{flat.dtype}{tuple(t.shape)}".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:32]


def changed(saved: Mapping[str, Any], mine: Mapping[str, Any], compared: Callable[[str], bool] = lambda k: True,
            defaults: Mapping[str, Any] | None = None) -> str:
    """The keys ``compared`` keeps whose values differ between a saved state's configuration and this
    one, as ``"method.bits: 8 saved, 2 here; ..."`` ("" when none). ``defaults``: what a key an older
    state lacks stood for (a key absent from both sides and from ``defaults`` is not compared)."""
    theirs = {**(defaults or {}), **saved}
    keys = sorted(k for k in set(theirs) | set(mine) if compared(k) and k not in NOT_SAVED
                  and theirs.get(k, _ABSENT) != mine.get(k, _ABSENT))
    return "; ".join(f"{k}: {theirs.get(k, '(absent)')!r} saved, {mine.get(k, '(absent)')!r} here" for k in keys)


def refuse_changed(what: str, saved: Mapping[str, Any], mine: Mapping[str, Any],
                   compared: Callable[[str], bool] = lambda k: True, defaults: Mapping[str, Any] | None = None,
                   error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming every differing key (:func:`changed`) when ``what`` was saved under
    another configuration than ``mine``."""
    diff = changed(saved, mine, compared, defaults)
    if diff:
        raise error(f"{what} was saved under another configuration: {diff}")


_ABSENT = object()
NOT_SAVED = ("method.description",)  # words about a method, not what it sends


def check_state(state: Any, spec: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``state`` if it is a dict holding every key of ``spec`` with a value of its type(s) (``None``
    in a tuple of types: may be None); else a ValueError naming the missing or mistyped keys, raised
    before anything of the state is loaded."""
    if not isinstance(state, dict):
        raise ValueError(f"{what}: not a state dict (got {type(state).__name__})")
    missing = sorted(k for k in spec if k not in state)
    if missing:
        raise ValueError(f"{what}: malformed state, missing key(s) {missing}")
    for key, types in spec.items():
        kinds = types if isinstance(types, tuple) else (types,)
        value = state[key]
        ok = any(value is None if t is None else isinstance(value, t) and not (t is int and isinstance(value, bool))
                 for t in kinds)
        if not ok:
            names = " or ".join("None" if t is None else t.__name__ for t in kinds)
            raise ValueError(f"{what}: malformed state, {key!r} must be {names}, got {type(value).__name__}")
    return state


def shard_lengths(step: Any) -> list[int] | None:
    """The shard lengths of a step object's exchange (its ``protocol.bounds``); None for a step without
    that layout (Sketched SGD's, the sparse exchanges)."""
    bounds = getattr(getattr(step, "protocol", None), "bounds", None)
    return None if bounds is None else [hi - lo for lo, hi in bounds]


def check_residuals(saved: Any, lengths: Sequence[int] | None, what: str, name: str) -> dict[int, Any]:
    """The residuals of a saved state, ``{index: tensor}`` (the error-fed downlink's, one per shard this
    process serves), each checked before anything of the state is loaded: the index an int below
    ``len(lengths)``, the tensor 1-d, floating, of ``lengths[index]`` elements and finite; a ValueError
    naming the first that is not. ``lengths`` None: the caller knows no layout (indices and lengths are
    then not checked). A residual of the wrong length would otherwise fail at some later exchange, and a
    non-finite one would poison every later round without a word."""
    import torch

    if not isinstance(saved, dict):
        raise ValueError(f"{what}: malformed state, {name!r} must be a dict, got {type(saved).__name__}")
    for j, r in saved.items():
        if isinstance(j, bool) or not isinstance(j, int) or (lengths is not None and not 0 <= j < len(lengths)):
            span = "" if lengths is None else f" (0..{len(lengths) - 1})"
            raise ValueError(f"{what}: malformed state, {name!r} key {j!r} is not a shard index{span}")
        want = None if lengths is None else int(lengths[j])
        if not isinstance(r, torch.Tensor) or r.dim() != 1 or not r.is_floating_point() \
                or (want is not None and r.numel() != want):
            got = f"a {r.dim()}-d {r.dtype} tensor of {r.numel()} elements" if isinstance(r, torch.Tensor) \
                else type(r).__name__
            size = "" if want is None else f" of {want} elements"
            raise ValueError(f"{what}: malformed state, {name!r}[{j}] must be a 1-d floating tensor{size}, got {got}")
        if not bool(torch.isfinite(r).all()):
            raise ValueError(f"{what}: malformed state, {name!r}[{j}] holds NaN or Inf")
    return dict(saved)
