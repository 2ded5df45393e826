"""What the ``dqsgd bench`` parsers and the benchmarks share, importable without torch: the hook and
model names of ``bench hook``, and the parser of comma-separated integers."""

from __future__ import annotations

HOOKS = ("none", "fp16", "powersgd-1", "qsgd-4bit sharded", "qsgd-4bit allgather", "dqsgd sharded",
         "dqsgd allgather")
MODELS = ("mlp", "cnn", "resnet18")


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (``"1e6"`` is read too)."""
    return [int(float(v)) for v in text.split(",") if v]
