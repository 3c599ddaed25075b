"""Settings shared by several processes of a run: the recipe, where learners train, and how
they reach the syncer (P and H, which every process must agree on, are the protocol's:
``diloco.wire.protocol.ProtocolConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.recipes.choices import INNER_OPTIMIZERS, check_inner_optimizer
from diloco.runtime.schema import option


@dataclass(kw_only=True, frozen=True)
class RecipeConfig:
    """What is trained: the same on the syncer, every learner and the evaluator."""

    recipe: str = option("shakespeare")
    """Model recipe: ``shakespeare`` (the 0.82M-parameter byte-level GPT), ``tiny`` (a 2-layer
    one for tests), ``hf-gpt2`` (transformers' GPT-2), ``moe`` (mixture of experts),
    ``digits`` (a CNN on scikit-learn's digits); docs/recipes.md. It gives the model, its
    layout and its initial parameters."""
    data: str | None = option(None, metavar="FILE")
    """Train a text recipe on this UTF-8 file instead of Shakespeare's plays."""
    seed: int = option(0)
    """Seed of the initial model and of the data streams."""
    inner_lr: float | None = option(None, type=float)
    """Peak learning rate of the inner optimizer (default: the recipe's, 3e-3 for the text
    recipes); every learner or data-parallel rank uses it."""

    inner_optimizer: str = option("adamw", choices=INNER_OPTIMIZERS)
    """The inner optimizer of every learner or data-parallel rank: ``adamw``, or ``muon``
    (``torch.optim.Muon`` for the hidden weight matrices, AdamW for the rest, one learning
    rate; ``diloco.recipes.optimizers``)."""

    def __post_init__(self) -> None:
        check_inner_optimizer(self.inner_optimizer)
        if self.inner_lr is not None and not self.inner_lr > 0:
            raise ValueError(f"--inner-lr must be > 0 (got {self.inner_lr})")


DEVICES = ("cpu", "cuda", "auto")


@dataclass(kw_only=True, frozen=True)
class DeviceConfig:
    """Where a learner trains (``diloco learner``, and every learner of ``diloco run``)."""

    device: str = option("cpu", choices=DEVICES)
    """Train on ``cpu``, ``cuda`` (the local rank's GPU under torchrun, else GPU 0) or
    ``auto`` (CUDA when there is one)."""
    bf16: bool = option(False)
    """Run the forward pass and the loss under bf16 autocast (the parameters, gradients and
    optimizer state stay fp32)."""


@dataclass(kw_only=True, frozen=True)
class ClientSecurityConfig:
    """How a process reaches the syncer: the shared token and TLS (docs/security.md)."""

    token_file: str | None = option(None, metavar="FILE")
    """File holding the shared secret token (default: ``$DILOCO_TOKEN`` if set)."""
    tls_ca: str | None = option(None, metavar="PEM")
    """CA bundle to verify the syncer with; enables TLS."""
    tls_cert: str | None = option(None, metavar="PEM")
    """Client certificate for mutual TLS."""
    tls_key: str | None = option(None, metavar="PEM")
    """Private key of ``--tls-cert``."""


@dataclass(kw_only=True, frozen=True)
class ServerSecurityConfig:
    """Who may reach the syncer: the shared token, TLS and an allow-list (docs/security.md)."""

    token_file: str | None = option(None, metavar="FILE")
    """File holding the shared secret token (default: ``$DILOCO_TOKEN`` if set); required to
    bind a non-loopback address."""
    tls_cert: str | None = option(None, metavar="PEM")
    """Certificate (chain) the syncer presents; enables TLS."""
    tls_key: str | None = option(None, metavar="PEM")
    """Private key of ``--tls-cert``."""
    tls_client_ca: str | None = option(None, metavar="PEM")
    """CA bundle: require client certificates signed by it (mutual TLS)."""
    allow_learners: str | None = option(None, metavar="ID,ID,...")
    """Only these learner ids (and observer ids) may join."""
    learner_tokens: bool = option(False)
    """Require each learner's own token (``diloco learner-token ID``, derived from the shared
    secret): a call may then act only as the id its token was made for, and the shared
    secret itself only asks for ``Status``."""


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "DILOCO_LOG_LEVEL"
"""Carries ``--log-level`` to the processes a command starts (``diloco run``'s children)."""


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """What a command's process logs on stderr (every configured command's option)."""

    log_level: str = option("warning", choices=LOG_LEVELS, metavar="|".join(LOG_LEVELS))
    """The least severe record of the library's loggers (``diloco.*``) printed on stderr:
    ``info`` adds a learner's joins and progress and the refusals it raises, ``debug``
    every lost link. The processes the command starts inherit it."""
