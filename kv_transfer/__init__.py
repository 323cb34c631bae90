"""Packed-row layout, capacity planning, transfer params, P->D remap, NIXL transport and leases."""
