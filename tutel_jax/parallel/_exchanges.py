"""How a dropless plan's rows cross the devices of the expert group: one registry, name -> collective.

  padded    all_to_all of [E, C, M] at the smallest static bucket >= the group's max count (never drops)
  ragged    `lax.ragged_all_to_all` (GPU/TPU; see `ragged_dropless`), the padded path beyond recv_capacity
  emulated  the ragged algorithm over an all_to_all emulation of ragged_all_to_all (a CPU test stand-in)
  auto      the first of AUTO_ORDER the backend supports
The ragged forms apply to flat expert axes with whole experts (count_per_node > 0, no 2DH); other layouts use
'padded'.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jax import lax

from ..core import DROPLESS_EXCHANGES
from ._ragged_dropless import emulated_ragged_all_to_all, ragged_supported
from ..validation import check_choice

__all__ = ["AUTO_ORDER", "EXCHANGES", "DroplessExchange", "resolve_exchange"]


@dataclasses.dataclass(frozen=True)
class DroplessExchange:
    """Attributes:
      name: the `dropless_exchange` value.
      collective: a `lax.ragged_all_to_all`-compatible function, or None for the padded all_to_all.
      supported: whether the default backend can run it (for 'auto').
    """
    name: str
    collective: Callable | None
    supported: Callable[[], bool] = lambda: True


EXCHANGES: dict[str, DroplessExchange] = {
    "padded": DroplessExchange("padded", None),
    "ragged": DroplessExchange("ragged", lax.ragged_all_to_all, ragged_supported),
    "emulated": DroplessExchange("emulated", emulated_ragged_all_to_all),
}
AUTO_ORDER = ("ragged", "padded")


def resolve_exchange(name: str, ragged_layout: bool) -> Callable | None:
    """The collective of exchange `name` (None: padded). `ragged_layout`: the layout allows a ragged exchange
    (flat expert axes, whole experts); otherwise every name means 'padded'."""
    check_choice(name, "dropless_exchange", DROPLESS_EXCHANGES)
    if not ragged_layout:
        return None
    if name == "auto":
        name = next(n for n in AUTO_ORDER if EXCHANGES[n].supported())
    return EXCHANGES[name].collective
