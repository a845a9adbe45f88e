from transfer.data.base import Columns, RolloutStore, StoreRef, columns_nbytes

__all__ = ["Columns", "RolloutStore", "StoreRef", "columns_nbytes"]
