"""The drafters of one configuration, built one way wherever they run: SD's draft runner, and
SSD's TreeDrafter (in the engine's thread with draft_transport='inprocess', in a draft worker
otherwise: ssd/worker/main.py)."""

from __future__ import annotations

import functools

from ssd.core.config import EngineConfig
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.loader import load_tokenizer
from ssd.model.runner import draft_runner


def config_draft_runner(config: EngineConfig, draft_model):
    """The runner of a loaded draft on config's draft device, lean or not, graphed or eager."""
    return draft_runner(draft_model, config.draft_device, config.lean_forward, config.enforce_eager)


def build_tree_drafter(config: EngineConfig, draft_model, vocab: int) -> TreeDrafter:
    """SSD's drafter over a loaded draft (its tokenizer, for draft grammars, loaded when first asked for)."""
    tokenizer = functools.partial(load_tokenizer, config.target, config.trust_remote_code)
    return TreeDrafter(
        config_draft_runner(config, draft_model),
        vocab,
        config.k,
        config.saguaro_c,
        tokenizer=tokenizer,
        early_drafts=config.ssd_backup != "fast",
    )
