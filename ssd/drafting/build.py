"""The drafters of one configuration, built one way wherever they run: SD's draft runner, and
SSD's TreeDrafter (in the engine's thread with draft_transport='inprocess', in a draft worker
otherwise: ssd/worker/main.py)."""

from __future__ import annotations

import functools

from ssd.core.config import EngineConfig
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.loader import context_limit, load_tokenizer
from ssd.model.runner import draft_runner


def config_draft_runner(config: EngineConfig, draft_model):
    """The runner of a loaded draft on config's draft device, lean or not, graphed or eager."""
    return draft_runner(draft_model, config.draft_device, config.lean_forward, config.enforce_eager)


def build_tree_drafter(config: EngineConfig, draft_model, vocab: int, max_model_len: int | None = None) -> TreeDrafter:
    """SSD's drafter over a loaded draft (its tokenizer, for draft grammars, loaded when first asked
    for). max_model_len: the engine's, where it is known (a worker process knows config's alone,
    else the draft's own limit, which is at least the engine's)."""
    tokenizer = functools.partial(load_tokenizer, config.target, config.trust_remote_code)
    context = max_model_len or config.max_model_len or context_limit(draft_model.config)
    return TreeDrafter(
        config_draft_runner(config, draft_model),
        vocab,
        config.k,
        config.saguaro_c,
        tokenizer=tokenizer,
        early_drafts=config.ssd_backup != "fast",
        rows=config.max_num_seqs,
        columns=context + tree_scratch_columns(config),
        max_bytes=config.kv_cache_bytes,
    )


def tree_scratch_columns(config: EngineConfig) -> int:
    """Columns a round's tree writes past its rows' lengths: the glue's (the pending committed
    tokens and the speculation verified, at most K + 1) and K depths of one shard's branches, at
    most ssd_budget (a shard builds its share of ssd_budget x the shards' branches;
    tree_decode.decode_tree)."""
    return config.k + 1 + config.k * config.ssd_budget
