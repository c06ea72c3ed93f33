"""Lightning strategies with each rank's share of every batch from one hetsplit plan, shaped as Lightning's own.

Users import the strategies from :mod:`hetsplit.lightning`.
"""
