"""The pure algorithm core: fragmentation, schedule, merge policy, merge rules, outer
optimizer, codecs and the syncer state machine. No sockets, threads or clocks inside.

Submodules are imported on demand so that torch-free users (``ddiloco.sim``) can import
``ddiloco.algorithm.policy`` without torch.
"""
