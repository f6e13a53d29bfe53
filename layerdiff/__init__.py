"""layerdiff: find where two runs of "the same" model start to differ, forward and backward."""
from layerdiff.native import use_current_sources

use_current_sources()  # before the recording's modules are imported: a compiled one may be stale (native.py)

from layerdiff.api import Report, align, bisect, config_diff, logs_diff, rethreshold, show, weights_diff  # noqa: E402
from layerdiff.tracing import trace  # noqa: E402
from layerdiff.version import __version__  # noqa: E402

__all__ = ["trace", "align", "rethreshold", "bisect", "weights_diff", "logs_diff", "config_diff", "show", "Report",
           "__version__"]
