"""Execution of compiled programs: sharded storage, collectives, autograd glue."""
