"""The installed version of layerdiff (``layerdiff.__version__``), recorded in every trace."""

__version__ = "0.1.0"
