"""The match pass: which module of one run is which of the other (mapping, from names, structure and weights), which
record pairs with which, and which tensor with which, under the rule sets that say how ports name, fuse and lay
out the same model."""
