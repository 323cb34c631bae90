"""`pdcluster up`: the cluster config schema (the one Helm values map onto) and the local launcher."""
