"""The inner optimizers a recipe can build: AdamW (the default) and Muon with AdamW.

``muon``: ``torch.optim.Muon`` (momentum, Newton–Schulz orthogonalised updates) for the hidden
weight matrices, AdamW for the rest (embeddings, biases, norms, and any tensor that is not a
matrix: Muon is defined for 2-D weights only). Muon's step is scaled to match AdamW's update
RMS (``adjust_lr_fn="match_rms_adamw"``), so one peak learning rate and one schedule drive both
halves. :class:`MuonWithAdamW` is the pair as one optimizer: what the training loop, the
learning-rate schedule (``param_groups``) and checkpoints (``state_dict``) see.
"""

from __future__ import annotations

import torch

from diloco.recipes.choices import check_inner_optimizer

MUON_MOMENTUM = 0.95

NOT_HIDDEN = ("head", "lm_head", "classifier", "router", "gate")
"""Module names (a component of a parameter's dotted name) of 2-D weights that are not hidden
matrices: output layers and mixture-of-experts routers stay with AdamW, as Muon's authors
advise."""


def muon_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters Muon trains: the hidden weight matrices, i.e. 2-D weights that
    are neither an embedding's (a tied output head is the embedding's weight) nor in a module
    named in :data:`NOT_HIDDEN`. Pure."""
    embedded = {
        id(p)
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding)
        for p in module.parameters(recurse=False)
    }
    return {
        id(p)
        for name, p in model.named_parameters()
        if p.dim() == 2
        and id(p) not in embedded
        and not set(name.split(".")[:-1]) & set(NOT_HIDDEN)
    }


class MuonWithAdamW:
    """``torch.optim.Muon`` on ``muon`` params and ``torch.optim.AdamW`` on the others, as one
    optimizer: ``param_groups`` lists both halves' groups (setting a group's ``lr`` sets that
    half's), ``step``/``zero_grad`` act on both, ``state_dict`` holds both under ``muon`` and
    ``adamw`` and ``load_state_dict`` takes that back."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon = muon
        self.adamw = adamw

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"}:
            raise ValueError(
                "this checkpoint's optimizer state is not Muon with AdamW "
                f"(keys {sorted(state)}): was it saved with --inner-optimizer adamw?"
            )
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_inner_optimizer(
    name: str,
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    no_decay,
):
    """The inner optimizer ``name`` (one of ``diloco.recipes.choices.INNER_OPTIMIZERS``) for ``model``: peak
    ``lr``, decoupled ``weight_decay`` except on the parameters ``no_decay(name, p)`` picks."""
    check_inner_optimizer(name)
    betas = (0.9, 0.95)
    chosen = muon_parameters(model) if name == "muon" else set()
    if name == "muon" and not chosen:
        raise ValueError(
            "--inner-optimizer muon: this model has no hidden weight matrices for Muon "
            "(2-D weights outside embeddings, output layers and routers); use adamw"
        )
    matrices, decay, plain = [], [], []
    for pname, p in model.named_parameters():
        if id(p) in chosen:
            matrices.append(p)
        else:
            (plain if no_decay(pname, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    if name == "adamw":
        return adamw
    muon = torch.optim.Muon(
        matrices,
        lr=lr,
        weight_decay=weight_decay,
        momentum=MUON_MOMENTUM,
        adjust_lr_fn="match_rms_adamw",
    )
    return MuonWithAdamW(muon, adamw)
