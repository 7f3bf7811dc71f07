"""A node's tiers: control planes of the memory tiers and of NVMe, and what they hold by.

arena   a memory tier (HBM or DRAM): capacity, index, eviction of a shared-memory arena
grants  what a memory tier hands out: slots granted for writes, the victims in them, its info
nvme    the NVMe tier: the log's space, index, journal and eviction
books   which of those two keeps a registered tier (cmx.tiers.TierSpec.holds)
leases  who holds each pin and reservation, until when
fences  slots held out of use after a reservation ended without its holder
events  store events published to the directory shards
"""
