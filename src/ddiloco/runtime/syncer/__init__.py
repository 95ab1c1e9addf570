"""The syncer service: ``server`` (``SyncerServer``, one ``SyncerState`` and the parts it
owns: ``control``, ``initial``, ``data`` (with ``fetch``), ``publication``,
``durability``, ``liveness``), its settings (``run_config``) and ``checkpoint`` (atomic
checkpoint files)."""
