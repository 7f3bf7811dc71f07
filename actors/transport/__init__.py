"""Node-to-node transports: the interface and the Ray fallback (``base``), NIXL over UCX
(``nixl_ucx``), the choice between them (``factory``)."""
