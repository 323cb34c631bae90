"""The cluster simulator (`pdcluster sim`, `pdcluster plan --workload`): docs/PLANNING.md."""
