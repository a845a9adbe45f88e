"""Reward functions for tests (importable by workers through ``_target_``)."""


def length_reward(response: str, label: str) -> float:
    """Longer finished answers score higher: gives a random model non-zero advantages."""
    return len(response) / 40
