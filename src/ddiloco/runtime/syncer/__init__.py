"""The syncer service: ``server`` (``SyncerServer``, assembled from ``control``, ``data``,
``liveness`` and ``durability`` around one ``SyncerState``) and ``checkpoint`` (atomic,
checkpoint files)."""
