"""Running many processes: ``launcher`` (syncer and learners on one host, supervised),
``forkserver`` (fast learner restarts), ``chaos`` (seeded fault schedules) and ``status``
(``ddiloco status``)."""
