"""The offload agent on a DPU, and the host endpoint it reaches its host through.

agent        the agent's host parts over NIXL (``dpu_agent_parts``)
access       how an agent reaches its host's bytes: ``HostAccess``, local or remote
nixl_access  that access over NIXL, every byte through bounce buffers
bounce       the bounce buffers
host         the host's side: arenas registered with NIXL, files served
staging      the host's staging for partial loads
forbid       what a process playing a DPU cannot do
"""
