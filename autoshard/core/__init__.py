"""The core: the graph and its tags, ops, specs, Config, the cost model, plans."""
