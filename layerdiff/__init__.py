"""layerdiff: find where two runs of "the same" model start to differ, forward and backward."""
__version__ = "0.1.0"

from .tracing import trace  # noqa: E402  (needs __version__)

__all__ = ["trace", "__version__"]
