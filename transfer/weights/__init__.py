from transfer.weights.base import WeightReceiver, WeightSync, iter_buckets

__all__ = ["WeightReceiver", "WeightSync", "iter_buckets"]
