"""Suites of a hit through ``NamespaceClient.load`` on a local Ray cluster: "service" (``hits``,
with a prefix only on NVMe: ``nvme_hits``) and "pressure" (``pressure``, a prefix larger than
HBM and DRAM; its figures are in "service" too)."""
