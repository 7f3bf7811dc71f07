"""The storage tiers, fastest first: each one a registered ``TierSpec``.

A tier is a kind of memory, not a place: every node has its own DRAM and NVMe; the pool is
the cluster's shared remote NVMe. What differs from one tier to another is said once, in its
spec, and the code asks the spec (``tier.spec.holds``, ``tier.rank``) where it would otherwise
ask ``tier is Tier.X``. A new tier (a CXL pool, an object store) is a spec and one
``register_tier`` call, in every process of the service, before it starts:

- ``Tier``: a tier's name, a ``str``, one object per name (so ``is`` compares, and a pickled
  one comes back as the same object). ``Tier.HBM``, ``Tier.DRAM``, ``Tier.NVME`` and
  ``Tier.POOL`` are built in; ``Tier("cxl")`` is a registered tier's, ValueError for a name
  nobody registered. Iterating ``Tier`` gives the registered tiers in rank order.
- ``TierSpec``: what the code branches on, field by field: speed order (``best_copy``, a
  load's sources), what a copy is (``holds``: a slot of a shared-memory arena, or an extent of
  a file: which books keep it, ``actors.tiers.books``, and which of the agent's moves read it),
  where it lives (``scope``: on each node beside its agent, or on the pool's nodes), its
  capacity, and the break-even priors of reading it (``cmx.policies.breakeven``).
- ``register_tier(spec)``, ``tier_spec(name)``, ``tier_specs()`` (rank order), and
  ``node_tiers(holds)``: the tiers each node runs, the ones its service starts and its
  stats gather.

What stays named is a tier's *role*, not its kind: HBM is where a load lands, DRAM where a
store lands and what a demotion leaves, NVMe below it (``cmx.policies.placement``'s chain),
the pool the cluster's replicated tier (``actors/pool``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from cmx.config import ServiceConfig

__all__ = ["Holds", "Scope", "Tier", "TierSpec", "node_tiers", "register_tier", "tier_spec",
           "tier_specs", "unregister_tier"]

GB = 1e9


class Holds(enum.Enum):
    """What a copy in a tier is, and so how it is pinned and read."""

    # A slot of a shared-memory arena (``ArenaTierService``): ``Pin`` gives its slot, read in
    # place by whoever maps the arena (the agent, and the client on the node).
    MEMORY = "memory"
    # An extent of a file (``NvmeTierService``): ``PinExtents`` gives path and offset; the
    # agent reads it with its I/O engine and verifies it, and a bad one is quarantined by
    # ``QuarantineExtents``.
    EXTENTS = "extents"


class Scope(enum.Enum):
    """Where a tier's copies live, and so who serves them."""

    NODE = "node"  # on each node: books ``cmx:<name>:<node>``, read by the node's agent
    POOL = "pool"  # on the pool's nodes (``cmx:pool:<node>``), pulled like a peer's


class _Registered(type):
    def __iter__(cls) -> Iterator[Tier]:
        return iter([s.tier for s in tier_specs()])


class Tier(str, metaclass=_Registered):
    """A registered tier's name (see the module's docstring)."""

    __slots__ = ()

    HBM: ClassVar[Tier]  # G1: GPU memory of a serving replica
    DRAM: ClassVar[Tier]  # G2: host memory arena of a node, shared with its offload agent
    NVME: ClassVar[Tier]  # G3: local NVMe of a node
    POOL: ClassVar[Tier]  # G4: pooled remote NVMe, blocks placed by rendezvous hashing

    def __new__(cls, name: str) -> Tier:
        if isinstance(name, Tier):
            return name
        if name not in _SPECS:
            raise ValueError(f"{name!r} is not a registered tier")
        return _NAMES[name]

    @property
    def value(self) -> str:
        """The name as a plain ``str`` (actor names, counters, JSON)."""
        return str.__str__(self)

    @property
    def spec(self) -> TierSpec:
        return tier_spec(self)

    @property
    def rank(self) -> float:
        """0 for the fastest tier; a larger rank is slower and larger."""
        return tier_spec(self).rank

    def __repr__(self) -> str:
        return f"Tier({str.__repr__(self)})"


@dataclass(frozen=True)
class TierSpec:
    """One tier: what the code asks of it, and nothing more."""

    name: str  # its actors' kind (``cmx:<name>:<node>``), its source class, its counters'
    rank: float  # speed order, 0 the fastest; a tier between two takes a rank between theirs
    holds: Holds
    scope: Scope
    capacity: Callable[[ServiceConfig], int]  # bytes, per node (or per pool node)
    link_here: tuple[float, float]  # break-even prior (latency s, bytes/s) read on this node
    link_peer: tuple[float, float]  # the same, read from another node
    emulated: bool = False  # device memory stood in for by host memory (HBM without a GPU)
    # An extents tier's folder: each node claims its store directory under it.
    files: Callable[[ServiceConfig], str] | None = None

    @property
    def tier(self) -> Tier:
        return Tier(self.name)

    @property
    def on_node(self) -> bool:
        return self.scope is Scope.NODE

    @property
    def in_memory(self) -> bool:
        return self.holds is Holds.MEMORY


_SPECS: dict[str, TierSpec] = {}
_NAMES: dict[str, Tier] = {}  # never shrinks: a tier registered again is the same object
_BUILT_IN = ("hbm", "dram", "nvme", "pool")


def register_tier(spec: TierSpec) -> Tier:
    """Add ``spec``; its ``Tier``. ValueError for a name or a rank taken by another tier, or
    a name that cannot be part of an actor's name."""
    if not spec.name or not spec.name.isidentifier() or spec.name in ("agent", "dir"):
        raise ValueError(f"a tier cannot be named {spec.name!r}")
    if spec.holds is Holds.EXTENTS and spec.scope is Scope.NODE and spec.files is None:
        raise ValueError(f"tier {spec.name!r} keeps extents but names no folder (files)")
    known = _SPECS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"tier {spec.name!r} is registered already")
    if clash := [s.name for s in _SPECS.values() if s.rank == spec.rank and s != spec]:
        raise ValueError(f"tier {spec.name!r} has the rank {spec.rank} of {clash[0]!r}")
    if spec.name not in _NAMES:
        _NAMES[spec.name] = str.__new__(Tier, spec.name)
    _SPECS[spec.name] = spec
    return _NAMES[spec.name]


def unregister_tier(name: str) -> None:
    """Remove a tier registered by ``register_tier`` (a test's, a plug-in unloaded); the four
    built in stay."""
    if name in _BUILT_IN:
        raise ValueError(f"the built-in tier {name!r} cannot be removed")
    _SPECS.pop(name, None)


def tier_spec(name: str) -> TierSpec:
    """The spec of tier ``name``; ValueError for one nobody registered."""
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"{name!r} is not a registered tier")
    return spec


def tier_specs() -> tuple[TierSpec, ...]:
    """Every registered tier, fastest first."""
    return tuple(sorted(_SPECS.values(), key=lambda s: s.rank))


def node_tiers(holds: Holds | None = None) -> tuple[Tier, ...]:
    """The tiers each node runs (those that keep ``holds``, if given), fastest first."""
    return tuple(s.tier for s in tier_specs()
                 if s.on_node and (holds is None or s.holds is holds))


# -- the four built in -------------------------------------------------------------------------


def _hbm_bytes(config: ServiceConfig) -> int:
    return config.hbm_bytes


def _dram_bytes(config: ServiceConfig) -> int:
    return config.dram_bytes


def _nvme_bytes(config: ServiceConfig) -> int:
    return config.nvme_bytes


def _nvme_dir(config: ServiceConfig) -> str:
    return config.nvme_dir


def _pool_bytes(config: ServiceConfig) -> int:
    return config.pool_bytes


# Break-even priors, measured on 2-core machines without a GPU (memcpy 5-13 GB/s; NIXL UCX
# between two actors 3-5 GB/s; O_DIRECT reads 0.6-1.4 GB/s) and lowered for the Ray calls
# around each move. The latencies are the control calls around a move (pin, reserve, commit,
# each a Ray call).
Tier.HBM = register_tier(TierSpec(
    "hbm", 0, Holds.MEMORY, Scope.NODE, _hbm_bytes, (0.010, 4.0 * GB), (0.040, 1.0 * GB),
    emulated=True))
Tier.DRAM = register_tier(TierSpec(
    "dram", 1, Holds.MEMORY, Scope.NODE, _dram_bytes, (0.015, 2.0 * GB), (0.040, 1.0 * GB)))
Tier.NVME = register_tier(TierSpec(
    "nvme", 2, Holds.EXTENTS, Scope.NODE, _nvme_bytes, (0.025, 0.6 * GB), (0.060, 0.4 * GB),
    files=_nvme_dir))
Tier.POOL = register_tier(TierSpec(
    "pool", 3, Holds.EXTENTS, Scope.POOL, _pool_bytes, (0.050, 0.3 * GB), (0.060, 0.3 * GB)))
