"""Drafting: what proposes the tokens a round verifies.

sd_proposer.py     SDProposer: ordinary SD, the draft drafts K tokens just in time
ssd_proposer.py    SSDProposer: SSD's target side (cache hits, backups, fan-out, estimates)
tree_drafter.py    TreeDrafter: SSD's draft side (glue, fork, tree decode, the cache)
neural_backup.py   the drafter's just-in-time drafts, and a new row's first one during its prefill
tree.py            the fork, the tree's attention mask, one round's SpeculationTree
saguaro.py         Saguaro's formulas: fan-out, sampling, the miss law, Theorems 7 and 17
backup_choice.py   the live figures of the backup choice
budget.py          BudgetSizer: the cache budget that fits one verification
ngram.py           the fast backup: n-gram lookup, else random tokens
"""
