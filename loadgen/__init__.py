"""Load generator: AgentX-like sessions, random and trace workloads, TTFT/TPOT/ITL/goodput reports."""
