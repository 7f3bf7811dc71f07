"""Partial loads across nodes over NIXL.

expose  the owner's side: selected ranges of a verified copy, held for a reader to pull
pull    the reader's side: one READ of every range, each block checked
reads   a selection's bytes out of one copy, in memory or on NVMe
"""
