"""Llama's parallelize plan, kept beside the model (as torchtitan keeps one per model).

``TP_PLAN`` is the tensor-parallel plan as a table (picotron's form): a module-name pattern and
the style that replaces it. ``meshtrain.parallel.parallelize.apply_tensor_parallel`` applies any
such table; the styles are its vocabulary:

* ``colwise``: a ``ColumnParallelLinear`` (weight and bias split by output rows);
* ``rowwise``: a ``RowParallelLinear`` (weight split by input columns; its partial outputs summed);
* ``vocab``: a ``VocabParallelEmbedding`` (rows of the vocabulary split);
* ``sequence_norm``: with sequence parallelism only, a norm applied to this rank's sequence slice;
* ``shared_input``: a module whose column-parallel children all read its input (attention's q, k,
  v; the MLP's w1, w3): it all-gathers that input once (with sequence parallelism) or all-reduces
  its gradient once, not once per child.

q, k, v are split by heads through their output rows (rank r holds q heads r*hq/tp.. and the KV
heads they use), and the output projection by its input columns, so attention needs no
communication inside; the MLP likewise (w1, w3 by rows, w2 by columns). Which fields of the
model must divide by tp is checked with the config (``meshtrain.config.parallel.check_tensor_parallel``).
"""

from __future__ import annotations

from typing import Any

TP_PLAN: dict[str, str] = {
    "tok_emb": "vocab",
    "layers.*.attn_norm": "sequence_norm",
    "layers.*.attn": "shared_input",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp_norm": "sequence_norm",
    "layers.*.mlp": "shared_input",
    "layers.*.mlp.w1": "colwise",
    "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
    "norm": "sequence_norm",
    "head": "colwise",
}
"""Module-name pattern (``*`` is any layer index) -> tensor-parallel style."""


def tie_weights(model: Any) -> None:
    """Re-tie the output head to the embedding (``tie_embeddings``) after a step that replaced or
    re-made either parameter; both split the vocabulary the same way under tensor parallelism."""
    if model.cfg.tie_embeddings and model.head is not None and model.tok_emb is not None:
        model.head.weight = model.tok_emb.weight
