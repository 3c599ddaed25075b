"""Which of a model's parameters are embedding tables (merged by weighted mean, not RDA).

An embedding's rows are touched only by the tokens a learner saw, so the deltas of two
learners are sparse in different rows and RDA's direction average would shrink them; the
weighted mean keeps each row's update (``diloco.algorithm.merge``). What counts as an
embedding is read from the model's modules, not from parameter names (a name rule misses
T5's ``shared.weight`` and calls anything with ``emb`` in its name an embedding):

* the weight of every ``nn.Embedding`` and ``nn.EmbeddingBag`` (token and position tables);
* the output head, tied to the input embedding or not: what
  ``model.get_output_embeddings()`` returns (Hugging Face models), or else the model's last
  ``nn.Linear`` when its weight has an embedding table's shape (vocabulary × width; only the
  last, so a square layer inside a block that happens to match a position table's shape is
  not taken for a head).

Names are those of ``model.named_parameters()`` (a tied weight is listed once, under its
first name), the names a fragment layout uses.
"""

from __future__ import annotations

from torch import nn


def embedding_parameter_names(model: nn.Module) -> frozenset[str]:
    """The parameter names of ``model`` that are embedding tables or output heads."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    weights = [m.weight for m in tables]
    heads = []
    output = getattr(model, "get_output_embeddings", None)
    head = output() if callable(output) else None
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), nn.Parameter):
        heads.append(head.weight)
    else:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        shapes = {tuple(w.shape) for w in weights}
        if linears and tuple(linears[-1].weight.shape) in shapes:
            heads.append(linears[-1].weight)
    return frozenset(name_of[id(w)] for w in weights + heads if id(w) in name_of)
