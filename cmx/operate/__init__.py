"""Operating the service from a shell: ``cmx up``, ``status``, ``lookup``, ``block``, ``evict``,
``orphans``, ``down``; and how every process joins or starts Ray.

``up`` starts a local Ray head (unless given a cluster), the service and the admin API, and
records what it did in a small state file; the other commands talk to the admin API it printed.

| module | what |
|---|---|
| ``cli`` | the typer commands, mounted on ``cmx`` |
| ``lifecycle`` | up and down: Ray head, service, admin API actor, state |
| ``local_ray`` | the background ``ray start --head --block`` process |
| ``ray_cluster`` | joining (bounded, token authentication) or starting a cluster of one's own |
| ``store_dirs`` | stable per-node store directories: claims, orphans, collection |
| ``orphans`` | orphaned store directories across the cluster (the admin action) |
| ``state`` | the state file (admin URL, token, whether we started Ray) |
| ``client`` | a small HTTP client of the admin API |
| ``render`` | rich tables of its answers |
"""
