"""layerdiff: find where two runs of "the same" model start to differ, forward and backward."""
from layerdiff.api import Report, align, bisect, config_diff, logs_diff, rethreshold, show, weights_diff
from layerdiff.tracing import trace
from layerdiff.version import __version__

__all__ = ["trace", "align", "rethreshold", "bisect", "weights_diff", "logs_diff", "config_diff", "show", "Report",
           "__version__"]
