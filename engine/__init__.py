"""Reference engine: the K3.1-style model (MLA + DSA indexer + KDA + MoE) and everything that runs it."""
