"""User-facing errors: the CLI prints their message as one line and exits 2."""


class LayerdiffError(Exception):
    """A problem with the user's input (file, flag, trace) rather than a bug in layerdiff."""


class TraceFormatError(LayerdiffError):
    """A file that is missing, not HDF5, not a layerdiff trace, or damaged."""
