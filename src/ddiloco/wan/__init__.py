"""WAN emulation on one Linux machine: regions as network namespaces with shaped links
(``topology``) and a bulk-transfer probe of their rates (``probe``)."""

from ddiloco.wan.probe import bulk_transfer
from ddiloco.wan.topology import LinkSpec, Topology, TopologyError, cleanup, namespaces_available

__all__ = [
    "LinkSpec",
    "Topology",
    "TopologyError",
    "bulk_transfer",
    "cleanup",
    "namespaces_available",
]
