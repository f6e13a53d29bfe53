"""The report pass: the JSON report on disk, its terminal and HTML views, progress display, and ``layerdiff show``."""
