"""The offload agent: one per node, built from parts (``core`` wires them).

shared     what the parts share: the node's tiers, the peers, the counters
host       where the parts touch the host's bytes: arenas and NVMe files
loads      loads into HBM, each block from its fastest copy
fetch      loads from other nodes (a peer, the pool)
stores     a writer's blocks into DRAM, committed, then placed
nvme       NVMe writes (the tier actor keeps the books)
demote     evicted blocks one tier down
peers      serving other nodes' loads
pool       writes to the pool
slices     partial loads (some layers, some KV heads)
scheduler  the work queues and the staging budget
"""
