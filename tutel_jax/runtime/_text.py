"""Runtime configurations written as short text, for command lines: 'ep=4,dp=2,d=2' -> RuntimeConfig.

Keys (comma-separated key=value):
  ep      expert-parallel devices (mesh axis 'expert');   dp   data-parallel replicas (mesh axis 'data')
  node, local   a 2DH expert group (mesh axes 'node', 'local'; the hierarchical all_to_all on unless 2dh=0)
  r       adaptive_r (0: data parallel, experts gathered)  d    a2a_ffn_overlap_degree
  k       top_k                                            cf   capacity_factor (> 0, 0 dropless, < 0 bounded)
  2dh     0 / 1
Unset keys keep RuntimeConfig's defaults (and the gates' own k / cf).
"""

from __future__ import annotations

from ._reconfigure import RuntimeConfig

__all__ = ["parse_runtime", "RUNTIME_KEYS"]

RUNTIME_KEYS = ("ep", "dp", "node", "local", "r", "d", "k", "cf", "2dh")


def parse_runtime(text: str) -> RuntimeConfig:
    """'ep=4,dp=2,d=2' or 'node=2,local=2,dp=2' -> RuntimeConfig; ValueError naming the bad item."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in RUNTIME_KEYS:
            raise ValueError(f"bad runtime item {part!r} in {text!r}: expected key=value with key in "
                             f"{', '.join(RUNTIME_KEYS)}")
        fields[key.strip()] = value.strip()
    try:
        ints = {k: int(v) for k, v in fields.items() if k != "cf"}
        cf = float(fields["cf"]) if "cf" in fields else None
    except ValueError:
        raise ValueError(f"bad number in runtime {text!r}") from None
    switches = dict(top_k=ints.get("k"), capacity_factor=cf, adaptive_r=ints.get("r"),
                    a2a_ffn_overlap_degree=ints.get("d", 1))
    if "node" in ints or "local" in ints:
        if "ep" in ints:
            raise ValueError(f"give either ep or node + local in {text!r}")
        return RuntimeConfig.ep_2dh(ints.get("node", 1), ints.get("local", 1), data=ints.get("dp", 1),
                                    use_2dh=bool(ints.get("2dh", 1)), **switches)
    return RuntimeConfig.ep(ints.get("ep", 1), data=ints.get("dp", 1), use_2dh=bool(ints.get("2dh", 0)), **switches)
