"""layerdiff: find where two runs of "the same" model start to differ, forward and backward."""
__version__ = "0.1.0"

from .tracing import trace  # noqa: E402  (needs __version__)
from .api import Report, align, bisect, config_diff, logs_diff, rethreshold, show, weights_diff  # noqa: E402

__all__ = ["trace", "align", "rethreshold", "bisect", "weights_diff", "logs_diff", "config_diff", "show", "Report",
           "__version__"]
