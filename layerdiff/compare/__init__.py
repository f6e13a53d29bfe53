"""The compare pass: every matched tensor pair measured (max abs, mean abs, max rel, cosine) in bounded memory, in
this process or in worker processes, and the tolerances it is judged by."""
