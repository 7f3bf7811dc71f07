"""How actors reach each other (``cmx.links``), under the name the actors import it by."""

from cmx.links import LocalLink, RayLink
from cmx.protocol import RAY_NAMESPACE, actor_name

__all__ = ["RAY_NAMESPACE", "LocalLink", "RayLink", "actor_name"]
