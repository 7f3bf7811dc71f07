"""A typed call to an actor: the request names its method once, carries its arguments as
fields, and says the type of its answer.

``link.call(name, Pin(keys=keys, owner=owner))`` reads as what it does, and mypy checks both
sides of it: the fields at construction (keyword arguments of a frozen dataclass) and the
answer's type through the request's type parameter. The link calls ``request.method`` on the
actor with the fields as keyword arguments, so the actor's methods stay plain methods, tested
without Ray; ``served_by`` names the classes whose method each request calls, and
``tests/unit/test_doors.py`` holds every request's fields to those methods' parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["Pending", "Request"]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Request(Generic[R_co]):
    """One call of ``method`` with this request's fields as its keyword arguments, answered
    with an ``R_co``. Subclasses are frozen dataclasses."""

    method: ClassVar[str]
    served_by: ClassVar[tuple[str, ...]]  # dotted names of the classes whose method it calls

    def kwargs(self) -> dict[str, Any]:
        """The method's keyword arguments: the fields as they are, nothing copied."""
        return dict(vars(self))

    def __str__(self) -> str:
        return self.method


@dataclass(frozen=True)
class Pending(Generic[R]):
    """A call started and not yet waited for: what ``submit`` hands back to ``result``."""

    request: Request[R]
    ref: Any  # the link's own: a Ray ObjectRef, or an answer already at hand
