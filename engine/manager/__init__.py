"""The Node Manager: leader election with fencing, allocation (Theorem 1), rebalancing."""
