"""Suites of the block stores in this process, without Ray: "nvme" and "dram" (``storage``,
the service's own NVMe path beside it: ``plane_io``) and "slices" (``slices``)."""
