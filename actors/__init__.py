"""The service's actors, by role: ``tiers``, ``agent``, ``dpu``, ``directory``, ``pool``,
``slices``, ``transport``; ``service`` wires them into actors on Ray."""
