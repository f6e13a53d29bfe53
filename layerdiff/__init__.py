"""layerdiff: find where two runs of "the same" model start to differ, forward and backward."""
__version__ = "0.1.0"

from .tracing import trace  # noqa: E402  (needs __version__)
from .api import Report, align, rethreshold  # noqa: E402

__all__ = ["trace", "align", "rethreshold", "Report", "__version__"]
