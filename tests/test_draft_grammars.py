"""SSD's drafter under a grammar (ssd/drafting/draft_grammars.py): every cached branch follows it
from its candidate on, candidates are ranked among the tokens it allows, committed tokens
advance it, and a drafter without the tokenizer drafts unmasked rather than failing."""

from __future__ import annotations

import torch

from ssd.core.protocol import AdmitMsg, BeginRoundMsg, NeuralBackupMsg, ReleaseMsg, ResolveMsg
from ssd.core.sampling import SequenceSampling
from ssd.drafting.tree_drafter import TreeDrafter
from ssd.model.demo_models import EOS_ID, build_tokenizer
from ssd.model.runner import draft_runner
from ssd.processing.structured import StructuredOutputs

DIGITS = StructuredOutputs(regex="[0-9]{12}").grammar_text()
PROMPT = list(b"n = ")


def drafter(tiny_pair, tokenizer=build_tokenizer, k: int = 4) -> TreeDrafter:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], local_files_only=True).eval()
    return TreeDrafter(draft_runner(model, "cpu", True), model.config.vocab_size, k, tokenizer=tokenizer)


def admitted(d: TreeDrafter, output: list[int]) -> None:
    sampling = SequenceSampling(1.0, 0, 1.0, DIGITS, len(PROMPT), EOS_ID)
    d.admit(AdmitMsg([1], [PROMPT + output], [7], [sampling]))


def test_every_branch_follows_the_grammar(tiny_pair):
    d = drafter(tiny_pair)
    admitted(d, list(b"12"))  # re-admitted mid-output: the matcher is past "12"
    spec = torch.tensor([list(b"3456")])
    fanout = [2, 2, 2, 2, 2]
    assert d.begin_round(BeginRoundMsg(1, [1], spec, torch.tensor([4]), fanout))
    tree = d.round
    digits = set(b"0123456789")
    for n, (accepted, candidate) in enumerate(zip(tree.grid.outcome[0].tolist(), tree.grid.candidates[0].tolist())):
        assert candidate in digits, (accepted, candidate)  # the fork ranked digits only
        assert set(tree.tokens[0, n].tolist()) <= digits  # and the branch drafted digits only
    # The outcome commits s_T[:2] and a bonus; the next round's drafts follow from there.
    d.resolve(ResolveMsg(1, [1], torch.tensor([2]), torch.tensor([ord("9")]), False, fanout))
    d.reply()
    assert d.states[1].tokens[-3:] == list(b"349")
    # 12 digits allowed: "12" + "349" leaves 7, then only EOS.
    d.release(ReleaseMsg([1]))
    assert not d.grammars.matchers


def test_the_last_allowed_token_is_eos_once_the_grammar_is_complete(tiny_pair):
    d = drafter(tiny_pair)
    admitted(d, list(b"1234567890"))
    spec = torch.tensor([list(b"12") + [EOS_ID, 0]])
    assert d.begin_round(BeginRoundMsg(1, [1], spec, torch.tensor([3]), [1, 1, 1, 1]))
    masks = d.grammars.fork_masks(d.grammars.spines([1], [spec[0, :3].tolist()]), 5)
    assert masks[0, 2].nonzero().flatten().tolist() == [EOS_ID]  # after 12 digits: EOS only


def test_the_neural_backup_drafts_under_the_grammar_too(tiny_pair):
    d = drafter(tiny_pair)
    admitted(d, list(b"12"))
    for round_id in range(1, 6):  # several draws: an unmasked draft of the random model is rarely a digit
        reply = d.neural_backup(NeuralBackupMsg(round_id, [1], [True]))
        drafted = reply.tokens[0, : int(reply.num_draft[0])].tolist()
        assert set(drafted) <= set(b"0123456789"), drafted
        # Each drafted token's reported probability is the masked distribution's: it sums to 1
        # over the digits (what verification compares against).
        assert torch.allclose(reply.probs[0, :, list(b"0123456789")].sum(-1), torch.ones(4))


def test_without_the_tokenizer_the_drafts_are_unmasked(tiny_pair):
    def missing():
        raise OSError("no tokenizer files here")

    d = drafter(tiny_pair, tokenizer=missing)
    admitted(d, [])
    assert not d.grammars.matchers
    assert d.begin_round(BeginRoundMsg(1, [1], torch.tensor([list(b"3456")]), torch.tensor([4]), [2, 2, 2, 2, 2]))


def test_a_grammar_the_drafter_cannot_compile_leaves_it_unmasked(tiny_pair, caplog):
    d = drafter(tiny_pair)
    d.admit(AdmitMsg([1], [PROMPT], [7], [SequenceSampling(1.0, 0, 1.0, "start: ((", len(PROMPT), EOS_ID)]))
    assert not d.grammars.matchers and "cannot follow" in caplog.text
    assert d.begin_round(BeginRoundMsg(1, [1], torch.tensor([list(b"3456")]), torch.tensor([4]), [2, 2, 2, 2, 2]))
