"""Optimizer parameter groups: no weight decay on routers, norms, biases and embeddings; router LR multiplier."""

from __future__ import annotations

from torch import nn

from .router import LimeRouter


def param_groups(
    model: nn.Module, weight_decay: float, router_lr_mult: float = 1.0, lr: float | None = None
) -> list[dict]:
    """Split ``model``'s trainable parameters into AdamW groups.

    Groups: ``decay`` (projection matrices, an untied ``lm_head``: ``weight_decay``), ``no_decay``
    (norms, biases, embeddings, so a tied ``lm_head`` too: 0, as the official code's
    ``configure_optimizers``) and ``router`` (every parameter under a router module: 0 decay, learning rate
    ``lr * router_lr_mult`` when ``lr`` is given, else an ``lr_mult`` key for the caller's scheduler).
    No decay on the routers is the paper's choice (App. A: "omitting weight decay on the LIMe router
    weights enjoys better performance") and the official code's default (train_utils.py); the router
    learning rate x10 is the paper's for 1B only (App. A, Table 3), the official config.py's at every size.
    A module may override the decay of its own parameters with a ``weight_decay_overrides`` dict
    (parameter name -> decay or not), as the HyperConnections module does. Empty groups are dropped.
    Each group carries a ``name``.
    """
    router_params = {id(p) for m in model.modules() if isinstance(m, LimeRouter) for p in m.parameters()}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    overrides = {
        id(p): decay
        for m in model.modules()
        for name, decay in getattr(m, "weight_decay_overrides", {}).items()
        if (p := getattr(m, name, None)) is not None
    }
    groups: dict[str, list] = {"decay": [], "no_decay": [], "router": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        if id(p) in router_params:
            groups["router"].append(p)
        elif id(p) in overrides:
            groups["decay" if overrides[id(p)] else "no_decay"].append(p)
        elif p.ndim < 2 or name.endswith(".bias") or "norm" in name or id(p) in embeddings:
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    result = []
    for key, params in groups.items():
        if not params:
            continue
        group = {"name": key, "params": params, "weight_decay": weight_decay if key == "decay" else 0.0}
        mult = router_lr_mult if key == "router" else 1.0
        group["lr_mult"] = mult
        if lr is not None:
            group["lr"] = lr * mult
        result.append(group)
    return result
