"""The client: what a serving replica calls to store, find and load KV blocks cluster-wide.

One direction, top to bottom:

    memory       ContextMemory: joins the service, opens namespaces, the node's figures
    namespaces   NamespaceClient: store, lookup, load and prefetch of token sequences
    ---------------------------------------------------------------------------------------
    matches      what a lookup finds (Match, BlockLocation); what the parts read (Reader)
    node_plane   this node's HBM and DRAM books: a local hit in one round trip
    loads        loads through this node's agent, window by window
    selections   partial loads (some layers, some KV heads)
    stores       a store straight into DRAM slots granted to the writer
    copy_out     slots into the caller's tensor, each block verified on the way

No module below the line imports one above it.
"""

from cmx.client.matches import BlockLocation, Match
from cmx.client.memory import ContextMemory
from cmx.client.namespaces import NamespaceClient
from cmx.client.stores import StoreHandle

__all__ = ["BlockLocation", "ContextMemory", "Match", "NamespaceClient", "StoreHandle"]
