"""The judge pass: pure functions of measured metrics. The call tree, the origin rule (inputs agree, outputs do
not), trust, and how the error grows."""
