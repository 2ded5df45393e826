"""A method: what one worker sends and what the server makes of it, for one flat vector.

* :mod:`~dqsgd.method.config`: the registry of named methods and their frozen, validated
  :class:`~dqsgd.method.config.MethodConfig` (quantizer, coding, bit policy, memory, aggregation);
* :mod:`~dqsgd.method.pipeline`: :class:`~dqsgd.method.pipeline.Method`, a configured method for one model
  (worker half: memory, quantize, encode; server half: decode, aggregate, downlink, policy);
* :mod:`~dqsgd.method.memory`: error-feedback memory;
* :mod:`~dqsgd.topology.ledger`: the bytes that really crossed the wire, step by step.

Nothing is imported here: ``import dqsgd.method.config`` does not load the codec kernels.
"""
