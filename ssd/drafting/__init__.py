"""Speculation: SD's just-in-time drafter, SSD's drafter (speculation cache) and its target-side
proposer, Saguaro's formulas, the cache budget, the fast backup.
"""
