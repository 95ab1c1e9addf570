"""The learner side: ``client`` (``SyncerClient``, the connection to a syncer), ``hook``
(``DecoupledLearner``, the public hook on a user's model and optimizer) and ``main`` (the
``ddiloco learner`` command for built-in models and torchrun islands)."""
