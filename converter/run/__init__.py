"""A conversion run: the plan, the shards across workers, DST's identity and space, finalize."""
