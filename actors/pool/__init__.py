"""A pool node (G4): pooled NVMe on a storage node.

node       the pool node's store and its calls
rebalance  each block on its owners, and only there
slices     its side of a partial load
"""
