"""The syncer service: ``server`` (gRPC handlers, data-port dispatch, liveness, durable
publication around one ``SyncerState``) and ``checkpoint`` (atomic checkpoint files)."""
