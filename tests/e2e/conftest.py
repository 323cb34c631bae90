"""The e2e tests' topologies are the run's shared ones (tests/topologies.py): `cluster` (the `pdcluster up`
reference topology), `vllm_cluster` (`pdcluster up --engine vllm`), each started once per run and stopped after
its last test. A missing node CLI fails the fixture with the node's log tail: e2e tests never skip for a missing
part."""
