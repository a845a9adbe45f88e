"""Lower layer: moves rollout data (column dicts) and weights between pools.

It imports nothing from ``rl``: rollout data arrive as column dicts, engines are reached
through the small ``WeightReceiver`` protocol that the caller passes in.
"""
