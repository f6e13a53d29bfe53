"""Framework-neutral core: trace format, records, metrics, alignment and report.

Nothing under ``layerdiff.core`` imports a deep-learning framework.
"""
