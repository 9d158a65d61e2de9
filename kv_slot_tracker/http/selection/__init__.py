"""The selection API's HTTP edge: request schemas, operations, and the replicated variant."""
