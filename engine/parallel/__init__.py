"""Every collective lives here: process groups, token-sharded prefill, DCP decode merges, head-sharded baseline."""
