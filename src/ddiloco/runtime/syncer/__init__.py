"""The syncer service: ``server`` (``SyncerServer``, assembled from ``control``, ``data``
and ``durability`` around one ``SyncerState``, owning ``liveness``) and ``checkpoint`` (atomic,
checkpoint files)."""
