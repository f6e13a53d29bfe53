"""Replay (``layerdiff bisect``): the candidate run again with the reference's recorded values forced in at every
module boundary, so each difference left is one segment's own error; and the binary search over blocks."""
