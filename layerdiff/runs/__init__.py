"""A run of several ranks (one trace per rank in a directory) read as one trace, and its ranks compared with
each other."""
