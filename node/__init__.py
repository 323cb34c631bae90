"""The node: the process host of W rank processes, the rank protocol and worker, the engine backend, and the
HTTP server both node kinds share (prefill_node/ and decode_node/ add their handlers)."""
