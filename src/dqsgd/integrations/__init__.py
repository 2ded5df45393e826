"""Integrations of dqsgd with training frameworks (the DDP communication hook: :mod:`dqsgd.ddp`).

Nothing is imported here, so ``import dqsgd.ddp`` loads only what the hook needs.
"""
