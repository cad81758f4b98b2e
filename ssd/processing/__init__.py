"""Logits processing: what a request's sampling parameters do to the logits before a token is
drawn, on every side that draws or verifies one. The bottom layer: it imports nothing of ssd's
outside itself (core's types, SamplingParams, Sequence and SequenceSampling, hold its values).

Glossary (b rows, n positions scored, K speculation length, V the target's vocabulary, m the
tracked columns of a row):

    processing       what a request asks beyond the shaping: repetition, frequency and presence
                     penalties, logit_bias, allowed_token_ids, min_tokens, min_p, bad_words and
                     structured outputs. Each position is processed with its own history: the
                     committed output plus the draft tokens before it.
    Processing       one request's processing, resolved to token ids at admission (request.py);
                     Sequence.processing, and SequenceSampling.processing over the wire.
    token masks      [b, n, V] bool: the tokens each position allows under a row's grammar
                     (structured.py -> grammar.py) and bad words (bad_words.py); token_masks.py
                     joins them.
    adjustments      a batch's processing as tensors, applied to logits [b, n, V] -> adjusted
                     logits (float32): penalties, bias and min_tokens on m tracked columns per
                     row (tracked.py), then allowed tokens and token masks as -inf. Three forms,
                     one name each; BatchSampling.adjust holds whichever a side uses:
      Adjustments          the exact form (adjustments.py): n positions at once, the order the
                           reference (tests/refimpl.py) follows. Built on the host (`build`),
                           extended to a speculation (`speculated`), carried to the next
                           round (`committed`).
      DraftAdjustments     the draft form (draft_adjustments.py): one position, stepped token by
                           token (`advanced`), its factors kept instead of derived per apply;
                           tensor operations on the draft's device.
      HostDraftAdjustments the draft form on the host (host_draft_adjustments.py): the same
                           columns and arithmetic as compiled loops (numba).
                     `draft_form(first, device)` turns a first position's Adjustments into the
                     draft form for that device.
    shaping          temperature, min_p, top-k and top-p: adjusted logits -> probs
                     (ssd/core/sampling.py's process_logits; min_p is a request's processing
                     but filters the scaled logits, so the adjustments lend it: min_p_filtered).

Which side uses which:

    target verification   RoundAdjustments (round_adjustments.py): the round's first position,
                          built or carried from the last round, made the exact form at K + 1
                          positions for the verified logits [b, K + 1, V].
    SD draft              that first position in the draft form (draft_form on the draft's
                          device), advanced by each drafted token (ssd/drafting/sd_proposer.py).
    SSD tree drafter      on a draft worker, from the Processing the admission carried: the fork
                          ranks outcome j's candidates with the exact form at K + 1 positions
                          (ForkAdjustments), each branch drafts in the host draft form, one row
                          per branch (BranchAdjustments; ssd/drafting/tree_adjustments.py), and
                          the neural backup as the SD draft does. ForkProcessing and
                          BranchProcessing (ssd/drafting/tree_processing.py) add the drafter's
                          own grammars (draft_grammars.py) to those adjustments.

Why the draft's form may round differently: verification is exact for any draft distribution.
It reads the probabilities the draft reports (the ones it drew from) and processes the target's
logits itself, in the exact form, so the output follows the processed target distribution
whatever the draft did. A draft's processing only moves acceptance: it must be the distribution
the draft drew from, read consistently by the acceptance test, not the target's bit for bit.
The draft form multiplies a positive logit by 1 / penalty instead of dividing, and sums one
-frequency per occurrence instead of multiplying the count; tests/test_draft_adjustments.py
holds both draft forms to the exact one within float32 rounding.
"""
