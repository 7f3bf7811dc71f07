"""Suite "transfer-hosts" (``xhost``): the measuring process it starts in a namespace of its own
(``xhost_run``) and the plain TCP stream it is held to (``tcp_copy``)."""
