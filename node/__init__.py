"""The node: the process host of W rank processes, the rank protocol and worker (over the rank's engine, which
applies the commands itself), the served tokenizer, and the HTTP server both node kinds share (prefill_node/ and
decode_node/ add their handlers)."""
